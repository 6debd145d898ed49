package main

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader/s3test"
)

// TestE2ES3ErrorsExplained: a mount whose S3 store cannot be used (a
// missing bucket, a wrong secret, no credentials at all) fails at once,
// without waiting for a lease, with a message that leads with one plain
// sentence saying what to fix, the SDK's error after it as detail, and no
// SDK warning of its own on stderr.
func TestE2ES3ErrorsExplained(t *testing.T) {
	need(t, "/dev/fuse")
	endpoint, bucket, key, secret := s3test.Start(t)
	mp := e2eDir(t, "home")
	noAWS := []string{"AWS_ACCESS_KEY_ID=", "AWS_SECRET_ACCESS_KEY=", "AWS_SESSION_TOKEN=", "AWS_PROFILE=",
		"AWS_EC2_METADATA_DISABLED=true", "AWS_SHARED_CREDENTIALS_FILE=/nonexistent/credentials", "AWS_CONFIG_FILE=/nonexistent/config",
		"AWS_REGION=" + s3test.Region}
	for _, c := range []struct {
		name, bucket string
		env          []string
		want         string
	}{
		{"a missing bucket", "no-such-bucket", []string{"AWS_ACCESS_KEY_ID=" + key, "AWS_SECRET_ACCESS_KEY=" + secret},
			`the bucket "no-such-bucket" does not exist`},
		{"a wrong secret", bucket, []string{"AWS_ACCESS_KEY_ID=" + key, "AWS_SECRET_ACCESS_KEY=not-" + secret},
			"the store refused the credentials: the secret key does not match the access key"},
		{"no credentials", bucket, nil,
			"no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"},
		// As on a machine with no instance role: the SDK asks the
		// instance metadata service last (here a closed loopback port).
		{"no credentials, no instance role", bucket,
			[]string{"AWS_EC2_METADATA_DISABLED=false", "AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9"},
			"no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"},
	} {
		h := newHost(t, fmt.Sprintf("s3://%s/home?endpoint=%s&path_style=true", c.bucket, endpoint))
		h.extraEnv = append(append([]string(nil), noAWS...), c.env...)
		d := h.start(mp)
		code := d.wait()
		msg := d.stderr.String()
		lead := ""
		if i := strings.Index(msg, "hermesfs mount: "); i >= 0 {
			lead = msg[i+len("hermesfs mount: "):]
		}
		if code == 0 || !strings.HasPrefix(lead, c.want) || !strings.Contains(lead, "detail: ") {
			t.Errorf("%s: exit %d; want a message leading with %q, then the detail:\n%s", c.name, code, c.want, msg)
		}
		for _, l := range strings.Split(msg, "\n") {
			if strings.HasPrefix(l, "SDK ") {
				t.Errorf("%s: the SDK's own warning on stderr: %q", c.name, l)
			}
		}
		if _, err := os.Stat(h.state + "/upper"); err == nil {
			t.Errorf("%s: the refused mount left its state dir", c.name)
		}
	}
}
