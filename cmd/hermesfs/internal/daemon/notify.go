package daemon

import (
	"fmt"
	"net"
	"strings"
	"time"
)

// sdNotify sends state (e.g. "READY=1\nSTATUS=...") to the service manager
// over the datagram socket named by NOTIFY_SOCKET, as systemd's sd_notify
// does. An unset variable is not an error: not run by systemd. A leading
// '@' names a socket in the abstract namespace.
func sdNotify(getenv func(string) string, state string) error {
	addr := getenv("NOTIFY_SOCKET")
	if addr == "" {
		return nil
	}
	if !strings.HasPrefix(addr, "/") && !strings.HasPrefix(addr, "@") {
		return fmt.Errorf("sd_notify: NOTIFY_SOCKET=%q: not a unix socket path", addr)
	}
	if addr[0] == '@' {
		addr = "\x00" + addr[1:]
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	defer c.Close()
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(state)); err != nil {
		return fmt.Errorf("sd_notify: %w", err)
	}
	return nil
}

// watchdogInterval returns how often to send WATCHDOG=1 (half of
// WATCHDOG_USEC, as systemd recommends), or 0 when no watchdog is set for
// this process.
func watchdogInterval(getenv func(string) string, pid int) time.Duration {
	usec := getenv("WATCHDOG_USEC")
	if usec == "" {
		return 0
	}
	if p := getenv("WATCHDOG_PID"); p != "" && p != fmt.Sprint(pid) {
		return 0
	}
	var n int64
	if _, err := fmt.Sscan(usec, &n); err != nil || n <= 0 {
		return 0
	}
	return time.Duration(n) * time.Microsecond / 2
}
