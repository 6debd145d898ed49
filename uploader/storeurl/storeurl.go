// Package storeurl turns a store URL into an uploader.Store:
//
//	file:///var/lib/hermesfs/store    a local directory (a bare path works too)
//	s3://bucket/prefix                Amazon S3
//	s3://bucket/prefix?endpoint=https://ACCOUNT.r2.cloudflarestorage.com&region=auto
//	s3://bucket/prefix?endpoint=http://127.0.0.1:9000&path_style=true
//
// It lives apart from package uploader so the catalog does not depend on
// the AWS SDK, and apart from the CLI so the daemon and the commands parse
// URLs the same way.
package storeurl

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/s3"
)

// Options are the settings that can come from outside the URL. Explicit
// values here (from flags) beat the URL's query, which beats the
// environment.
type Options struct {
	// Getenv reads the environment; nil means os.Getenv.
	Getenv func(string) string
	// UID picks the default local directory (root gets /var/lib); use
	// os.Getuid().
	UID int
	// Endpoint, Region: "" means not set.
	Endpoint, Region string
	// PathStyle, if not nil, overrides the URL and the default (path-style
	// when a custom endpoint is set, virtual-hosted for AWS).
	PathStyle *bool
	// NoCreate opens only an existing local store: commands that read
	// (list, status, verify, restore) and prune must not create the
	// directory a mistyped URL names.
	NoCreate bool
	// PartSize and Concurrency tune S3 multipart uploads (0: defaults).
	PartSize    int64
	Concurrency int
	HTTPClient  *http.Client
	Logger      *slog.Logger
}

// Location is a parsed store URL.
type Location struct {
	Scheme string // "file" or "s3"
	Dir    string // file: the absolute directory

	Bucket, Prefix, Endpoint, Region string // s3
	PathStyle                        bool   // s3
}

// String is the URL in canonical form. It never holds credentials (Parse
// refuses URLs with them).
func (l Location) String() string {
	if l.Scheme == "file" {
		return "file://" + l.Dir
	}
	u := url.URL{Scheme: "s3", Host: l.Bucket, Path: "/" + l.Prefix}
	q := url.Values{}
	if l.Endpoint != "" {
		q.Set("endpoint", l.Endpoint)
	}
	if l.Region != "" {
		q.Set("region", l.Region)
	}
	if l.PathStyle {
		q.Set("path_style", "true")
	}
	u.RawQuery = q.Encode()
	return strings.TrimSuffix(u.String(), "/")
}

// Parse reads raw ("" means the default local directory).
func Parse(raw string, o Options) (Location, error) {
	getenv := o.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	if raw == "" {
		dir, err := uploader.DefaultLocalDir(getenv, o.UID)
		if err != nil {
			return Location{}, err
		}
		return Location{Scheme: "file", Dir: dir}, nil
	}
	if strings.TrimSpace(raw) != raw {
		return Location{}, fmt.Errorf("store URL %q: leading or trailing blanks", redact(raw))
	}
	if !strings.Contains(raw, "://") {
		if err := schemeWithoutSlashes(raw); err != nil {
			return Location{}, err
		}
		return fileLocation(raw)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return Location{}, fmt.Errorf("store URL %q: %w", redact(raw), err)
	}
	if u.User != nil {
		return Location{}, fmt.Errorf("store URL %s: credentials do not belong in the URL (it is logged and shown); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or use an AWS profile", redact(raw))
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return Location{}, fmt.Errorf("store URL %s: write file:///absolute/path (three slashes)", raw)
		}
		return fileLocation(u.Path)
	case "s3":
		return s3Location(u, o, getenv)
	}
	if u.Scheme == "http" || u.Scheme == "https" {
		return Location{}, fmt.Errorf("store URL %s: unknown scheme %q; for an S3-compatible server write s3://bucket/prefix?endpoint=%s://%s", redact(raw), u.Scheme, u.Scheme, u.Host)
	}
	return Location{}, fmt.Errorf("store URL %s: unknown scheme %q; use file:///dir or s3://bucket/prefix", redact(raw), u.Scheme)
}

// schemeWithoutSlashes refuses what looks like a URL whose "//" is
// missing or cut ("s3:bucket", "s3:/bucket", "file:dir"): taken as a bare
// path it would name a local directory called "s3:bucket".
func schemeWithoutSlashes(raw string) error {
	i := strings.IndexByte(raw, ':')
	if i <= 0 {
		return nil
	}
	scheme := strings.ToLower(raw[:i])
	for j, ch := range scheme {
		if !(ch >= 'a' && ch <= 'z' || j > 0 && (ch >= '0' && ch <= '9' || ch == '+' || ch == '-' || ch == '.')) {
			return nil // not a scheme: a path with a colon
		}
	}
	switch scheme {
	case "s3":
		return fmt.Errorf("store URL %q: an S3 URL is s3://bucket/prefix (two slashes after \"s3:\")", redact(raw))
	case "file":
		return fmt.Errorf("store URL %q: a file URL is file:///absolute/path (three slashes after \"file:\"); a bare path works too", redact(raw))
	}
	return fmt.Errorf("store URL %q: unknown scheme %q; use file:///dir or s3://bucket/prefix (write ./%s for a directory with a colon in its name)", redact(raw), scheme, raw)
}

func fileLocation(p string) (Location, error) {
	if p == "" {
		return Location{}, errors.New("store URL: empty path")
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return Location{}, err
	}
	return Location{Scheme: "file", Dir: abs}, nil
}

func s3Location(u *url.URL, o Options, getenv func(string) string) (Location, error) {
	l := Location{Scheme: "s3", Bucket: u.Host, Prefix: strings.Trim(u.Path, "/")}
	if l.Bucket == "" {
		return Location{}, fmt.Errorf("store URL %s: no bucket; write s3://bucket/prefix", u)
	}
	if strings.Contains(l.Bucket, ":") {
		return Location{}, fmt.Errorf("store URL %s: %q is not a bucket name (the part after s3:// is the bucket); give the server as ?endpoint=http://%s", u, l.Bucket, l.Bucket)
	}
	if len(l.Bucket) > 255 || strings.Trim(l.Bucket, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_") != "" {
		return Location{}, fmt.Errorf("store URL %s: %q is not a bucket name (letters, digits, dots and hyphens)", u, l.Bucket)
	}
	if strings.Contains(l.Prefix, "//") {
		return Location{}, fmt.Errorf("store URL %s: the prefix %q has an empty path segment (\"//\")", u, l.Prefix)
	}
	q := u.Query()
	for k := range q {
		switch k {
		case "endpoint", "region", "path_style":
		default:
			return Location{}, fmt.Errorf("store URL %s: unknown setting %q (known: endpoint, region, path_style)", u, k)
		}
	}
	l.Endpoint = first(o.Endpoint, q.Get("endpoint"), getenv("AWS_ENDPOINT_URL_S3"), getenv("AWS_ENDPOINT_URL"))
	if l.Endpoint != "" {
		eu, err := url.Parse(l.Endpoint)
		if err != nil || (eu.Scheme != "http" && eu.Scheme != "https") || eu.Host == "" {
			return Location{}, fmt.Errorf("S3 endpoint %q: want http(s)://host[:port]", l.Endpoint)
		}
	}
	l.Region = first(o.Region, q.Get("region"))
	if l.Region == "" && strings.Contains(l.Endpoint, ".r2.cloudflarestorage.com") {
		l.Region = "auto"
	}
	l.PathStyle = l.Endpoint != ""
	if v := q.Get("path_style"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return Location{}, fmt.Errorf("store URL %s: path_style=%q: want true or false", u, v)
		}
		l.PathStyle = b
	}
	if o.PathStyle != nil {
		l.PathStyle = *o.PathStyle
	}
	return l, nil
}

func first(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// redact hides a password in a URL for error messages.
func redact(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		return u.Redacted()
	}
	return "(unparsable URL)"
}

// Open connects the store at l. The local store's directory is created; an
// S3 store sends no request yet.
func (l Location) Open(ctx context.Context, o Options) (uploader.Store, error) {
	switch l.Scheme {
	case "file":
		if o.NoCreate {
			return uploader.OpenLocal(l.Dir)
		}
		return uploader.NewLocal(l.Dir)
	case "s3":
		getenv := o.Getenv
		if getenv == nil {
			getenv = os.Getenv
		}
		c := s3.Config{
			Bucket: l.Bucket, Prefix: l.Prefix, Endpoint: l.Endpoint, Region: l.Region, PathStyle: l.PathStyle,
			PartSize: o.PartSize, Concurrency: o.Concurrency, HTTPClient: o.HTTPClient, Logger: o.Logger,
		}
		// The standard chain reads the process environment; reading these
		// through Getenv first keeps the CLI testable in-process.
		if id := getenv("AWS_ACCESS_KEY_ID"); id != "" {
			c.AccessKeyID, c.SecretAccessKey, c.SessionToken = id, getenv("AWS_SECRET_ACCESS_KEY"), getenv("AWS_SESSION_TOKEN")
		}
		if c.Region == "" {
			c.Region = first(getenv("AWS_REGION"), getenv("AWS_DEFAULT_REGION"))
		}
		return s3.New(ctx, c)
	}
	return nil, fmt.Errorf("store: unknown scheme %q", l.Scheme)
}

// Open parses raw and opens the store.
func Open(ctx context.Context, raw string, o Options) (uploader.Store, Location, error) {
	l, err := Parse(raw, o)
	if err != nil {
		return nil, Location{}, err
	}
	s, err := l.Open(ctx, o)
	if err != nil {
		return nil, l, err
	}
	return s, l, nil
}
