package fs

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"syscall"
)

// refused logs, at warning level, a change to a guarded path that the
// overlay refuses itself (the Guard logs its own verdicts), naming the
// process, so that "why did my agent's memory write fail" is answered by
// the journal. It returns errno.
func (ov *overlay) refused(ctx context.Context, rel string, errno syscall.Errno, why string) syscall.Errno {
	pid := callerPid(ctx)
	ov.log.Warn("memory file change refused", "file", rel, "reason", why,
		"errno", errno.Error(), "pid", pid, "process", procComm(pid))
	return errno
}

// procComm is the command name of thread or process id, "" if gone.
func procComm(id uint32) string {
	if id == 0 {
		return ""
	}
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(id), 10) + "/comm")
	if err != nil {
		return ""
	}
	return string(bytes.TrimSpace(b))
}

// relOf is the path of name in d, for logs ("" when d is gone).
func relOf(d *node, name string) string {
	rel, ok := d.rel()
	if !ok {
		return ""
	}
	return joinRel(rel, name)
}
