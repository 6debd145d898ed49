package storeurl_test

import (
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

func TestParse(t *testing.T) {
	yes, no := true, false
	env := map[string]string{"HOME": "/home/u"}
	getenv := func(k string) string { return env[k] }
	for _, c := range []struct {
		raw  string
		o    storeurl.Options
		want string
	}{
		{"", storeurl.Options{UID: 1000}, "file:///home/u/.local/share/hermesfs/store"},
		{"", storeurl.Options{UID: 0}, "file:///var/lib/hermesfs/store"},
		{"file:///srv/store", storeurl.Options{}, "file:///srv/store"},
		{"/srv/store/", storeurl.Options{}, "file:///srv/store"},
		{"/srv/a:b", storeurl.Options{}, "file:///srv/a:b"},
		{"s3://Legacy_Bucket", storeurl.Options{}, "s3://Legacy_Bucket"},
		{"s3://bkt", storeurl.Options{}, "s3://bkt"},
		{"s3://bkt/team/agent1/", storeurl.Options{}, "s3://bkt/team/agent1"},
		{"s3://bkt/p?region=eu-west-1", storeurl.Options{}, "s3://bkt/p?region=eu-west-1"},
		{"s3://bkt/p?endpoint=https://acc.r2.cloudflarestorage.com", storeurl.Options{},
			"s3://bkt/p?endpoint=https%3A%2F%2Facc.r2.cloudflarestorage.com&path_style=true&region=auto"},
		{"s3://bkt/p?endpoint=http://127.0.0.1:9000", storeurl.Options{PathStyle: &no}, "s3://bkt/p?endpoint=http%3A%2F%2F127.0.0.1%3A9000"},
		{"s3://bkt/p?path_style=true", storeurl.Options{}, "s3://bkt/p?path_style=true"},
		// Flags beat the URL, which beats the environment.
		{"s3://bkt/p?endpoint=http://a:1", storeurl.Options{Endpoint: "http://b:2", Region: "r", PathStyle: &yes},
			"s3://bkt/p?endpoint=http%3A%2F%2Fb%3A2&path_style=true&region=r"},
	} {
		c.o.Getenv = getenv
		l, err := storeurl.Parse(c.raw, c.o)
		if err != nil || l.String() != c.want {
			t.Errorf("Parse(%q) = %q, %v; want %q", c.raw, l.String(), err, c.want)
		}
	}
	env["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:7070"
	if l, err := storeurl.Parse("s3://b", storeurl.Options{Getenv: getenv}); err != nil || l.Endpoint != "http://127.0.0.1:7070" || !l.PathStyle {
		t.Errorf("AWS_ENDPOINT_URL_S3: %+v, %v", l, err)
	}
	if l, _ := storeurl.Parse("s3://b?endpoint=http://x:1", storeurl.Options{Getenv: getenv}); l.Endpoint != "http://x:1" {
		t.Errorf("the URL's endpoint must beat the environment: %+v", l)
	}
}

func TestParseErrors(t *testing.T) {
	for raw, want := range map[string]string{
		"s3://AKIA:secret@bkt/p":       "credentials do not belong",
		"s3:///p":                      "no bucket",
		"gs://bkt":                     "unknown scheme",
		"s3://b?endpont=http://x":      "unknown setting",
		"s3://b?endpoint=127.0.0.1:90": "want http(s)://",
		"s3://b?path_style=maybe":      "path_style",
		"file://host/dir":              "three slashes",
		"s3:/bkt/p":                    "s3://bucket/prefix (two slashes",
		"s3:bkt":                       "s3://bucket/prefix (two slashes",
		"S3:/bkt":                      "s3://bucket/prefix (two slashes",
		"file:relative/dir":            "file:///absolute/path",
		"file:/srv/store":              "file:///absolute/path",
		"gs:bkt/p":                     "unknown scheme \"gs\"",
		"https://s3.amazonaws.com/bkt": "endpoint=https://s3.amazonaws.com",
		"s3://":                        "no bucket",
		"s3://localhost:9000/bkt":      "?endpoint=http://localhost:9000",
		"s3://my bucket/p":             "invalid",
		"s3://my+bucket/p":             "not a bucket name",
		"s3://bkt/a//b":                "empty path segment",
		" s3://bkt":                    "blanks",
		"file://":                      "empty path",
	} {
		_, err := storeurl.Parse(raw, storeurl.Options{Getenv: func(string) string { return "" }})
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "secret") {
			t.Errorf("Parse(%q): %v, want an error containing %q (and no secret)", raw, err, want)
		}
	}
}
