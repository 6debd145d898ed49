# Sourced by the benchmarks that reach S3 through a shaped link
# (bench-cost.sh, bench-files.sh, bench-lazy.sh, bench-rpo.sh; bench-e2e.sh
# without the link); POSIX sh, run from the
# checkout's root.
#
#   s3_start NAME
#     starts versitygw ($vgw) on a free loopback port over $work/s3 with
#     one bucket, "bench"; exports the credentials (AWS_*), adds the
#     process to $pids (the caller's cleanup kills them) and sets ep, the
#     server's URL. NAME starts its errors.
#   s3link_start NAME
#     s3_start, and the shaped proxy ($work/shapedproxy, built if missing)
#     in front of it: $LINK_RATE each way, $LINK_LATENCY added to every
#     request. Sets pep (through the link) and ctl (the proxy's control
#     URL: GET $ctl/stats, POST $ctl/reset).
#   reset_counts
#     zeroes the proxy's counters.
#   counts
#     prints "BYTES_UP REQUESTS": request bytes and requests through the
#     link since the last reset_counts.
#   stored PREFIX
#     prints "BYTES OBJECTS" stored under the bucket's PREFIX (the object
#     files of versitygw's posix backend, its temporary upload files
#     excluded).
#   s3curl ARGS...
#     curl with the request signed with those credentials.

s3curl() {
	curl -sS --fail --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
		-H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$@"
}

s3_start() {
	mkdir -p "$work/s3"
	port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
	export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret AWS_REGION=us-east-1
	"$vgw" --access "$AWS_ACCESS_KEY_ID" --secret "$AWS_SECRET_ACCESS_KEY" --port "127.0.0.1:$port" posix "$work/s3" >"$work/versitygw.log" 2>&1 &
	pids="$pids $!"
	ep=http://127.0.0.1:$port
	i=0
	until s3curl -X PUT "$ep/bench" >/dev/null 2>&1; do
		i=$((i + 1))
		[ $i -lt 100 ] || { echo "$1: versitygw did not start" >&2; cat "$work/versitygw.log" >&2; exit 1; }
		sleep 0.1
	done
}

s3link_start() {
	[ -x "$work/shapedproxy" ] || go build -o "$work/shapedproxy" ./uploader/faultproxy/cmd/shapedproxy
	s3_start "$1"
	"$work/shapedproxy" -target "$ep" -latency "$LINK_LATENCY" -rate "$LINK_RATE" >"$work/proxy.out" 2>"$work/proxy.log" &
	pids="$pids $!"
	i=0
	until grep -qs '^proxy ' "$work/proxy.out"; do
		i=$((i + 1))
		[ $i -lt 600 ] || { echo "$1: shapedproxy did not start" >&2; cat "$work/proxy.log" >&2; exit 1; }
		sleep 0.05
	done
	pep=$(awk '/^proxy / {print $2}' "$work/proxy.out")
	ctl=$(awk '/^proxy / {print $4}' "$work/proxy.out")
}

reset_counts() { curl -sS -X POST "$ctl/reset" >/dev/null; }

counts() {
	curl -sS "$ctl/stats" | python3 -c 'import json,sys
s = json.load(sys.stdin); print(s.get("bytes_up", 0), sum((s.get("ops") or {}).values()))'
}

stored() {
	find "$work/s3/bench/$1" -type f -not -path '*/.sgwtmp/*' -printf '%s\n' 2>/dev/null | awk '{s += $1; n++} END {printf "%.0f %d\n", s, n}'
}
