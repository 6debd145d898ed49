package memguard

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
)

// process resolves the id a FUSE request carries, which is the calling
// thread's, to the writer's process id and name, so that the audit log names
// the program (python3, sed, sh) rather than one of its threads. The id is
// kept as it is when proc does not know it (the writer has gone, or /proc is
// not mounted).
func process(proc string, id uint32) (pid uint32, name string) {
	if id == 0 {
		return 0, ""
	}
	status, err := os.ReadFile(filepath.Join(proc, strconv.FormatUint(uint64(id), 10), "status"))
	if err != nil {
		return id, ""
	}
	pid = id
	for line := range bytes.SplitSeq(status, []byte("\n")) {
		key, val, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		val = bytes.TrimSpace(val)
		switch string(key) {
		case "Name":
			name = string(val)
		case "Tgid":
			if n, err := strconv.ParseUint(string(val), 10, 32); err == nil && n > 0 {
				pid = uint32(n)
			}
			return pid, name // Name comes first in the file
		}
	}
	return pid, name
}
