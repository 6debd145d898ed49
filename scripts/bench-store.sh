#!/bin/sh
# Store benchmark: upload and verified-download throughput of an
# archive-sized object (BENCH_SIZE, default 1G) to a local directory store
# and to versitygw on 127.0.0.1, against cp on the same disk (BENCH_DIR),
# and the requests one snapshot publish costs. See BENCHMARKS.md, "Store".
set -eu
cd "$(dirname "$0")/.."
size=${BENCH_SIZE:-1G}
dir=${BENCH_DIR:-/var/tmp/hermesfs-bench}
mkdir -p "$dir"
command -v versitygw >/dev/null 2>&1 || [ -x "$(go env GOPATH)/bin/versitygw" ] ||
	go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
# The benchmark object is an archive, not a home tree: a size like 1G is the
# archive size here.
exec go run ./uploader/internal/storebench -size "$size" -dir "$dir"
