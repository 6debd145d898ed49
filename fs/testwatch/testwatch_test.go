package testwatch

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestHungTestFailsAtItsDeadline: a test that waits past its deadline
// ends the test process at once, exit 2, naming the test, what it waited
// for, and running the OnExpire hooks first; a test within its deadline
// is left alone.
func TestHungTestFailsAtItsDeadline(t *testing.T) {
	if os.Getenv("TESTWATCH_HELPER") == "1" {
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestHelper(Finishes|Hangs)$", "-test.v")
	cmd.Env = append(os.Environ(), "TESTWATCH_HELPER=1", "HERMESFS_TEST_DEADLINE=300ms")
	out, err := cmd.CombinedOutput()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 2 {
		t.Fatalf("the hung helper: %v, want exit 2:\n%s", err, out)
	}
	for _, want := range []string{
		"testwatch: TestHelperHangs is still running after",
		"it has been waiting for the ready line of a daemon that never comes for",
		`before that it waited for: ["something that came"]`,
		"hook ran",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the message lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "also running: TestHelperFinishes") {
		t.Errorf("a test within its deadline was named:\n%s", out)
	}
}

// TestHelperFinishes waits for what comes, within its deadline.
func TestHelperFinishes(t *testing.T) {
	if os.Getenv("TESTWATCH_HELPER") != "1" {
		t.Skip("run by TestHungTestFailsAtItsDeadline")
	}
	Wait(t, "a quick thing")()
}

// TestHelperHangs waits for ever.
func TestHelperHangs(t *testing.T) {
	if os.Getenv("TESTWATCH_HELPER") != "1" {
		t.Skip("run by TestHungTestFailsAtItsDeadline")
	}
	OnExpire(func() { os.Stderr.WriteString("hook ran\n") })
	Wait(t, "something that came")()
	Wait(t, "the ready line of a daemon that never comes")
	time.Sleep(time.Minute)
	t.Error("the deadline did not end the process")
}
