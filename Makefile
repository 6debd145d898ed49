# hermesfs — see README.md. `make help` lists the targets.

GO        ?= go
GOBIN     := $(shell $(GO) env GOPATH)/bin
export PATH := $(GOBIN):$(PATH)
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
BIN       := bin/hermesfs
DEMO_DIR  ?= $(CURDIR)/demo
# -race everywhere: the archive writer, the overlay, the uploader and the
# daemon all run goroutines.
TESTFLAGS ?= -race -count=1 -timeout 20m

.PHONY: help build test bench lint demo run deps clean fuzz

help:
	@echo "make build   build $(BIN) (static, CGO_ENABLED=0)"
	@echo "make demo    mount a demo home at $(DEMO_DIR)/home on a local store in $(DEMO_DIR)/store (Ctrl-C to stop)"
	@echo "make test    install what the tests need, then run the whole suite"
	@echo "make bench   benchmarks against native disk and mksquashfs; see BENCHMARKS.md"
	@echo "make lint    gofmt + go vet + staticcheck"
	@echo "make fuzz    fuzz the archive reader for FUZZTIME (default 60s)"

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/hermesfs

deps:
	@scripts/deps.sh test

# The end-to-end tests build their own hermesfs with -race (HERMESFS_BIN
# unset), so the daemon's goroutines are race-checked too; `build` still runs
# to prove the static release binary builds. The suite runs with TMPDIR set
# to a directory of its own, and fails if a mount is left below it or below
# the checkout; mounts other programs make meanwhile are not its business.
test: deps build
	scripts/check-mounts.sh run --root $(CURDIR) -- env HERMESFS_TEST_STRICT=1 $(GO) test $(TESTFLAGS) ./...

lint: deps
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	staticcheck ./...

bench: build
	@scripts/deps.sh bench
	HERMESFS_BIN=$(CURDIR)/$(BIN) scripts/bench.sh

FUZZTIME ?= 60s
fuzz:
	$(GO) test ./archive -run '^$$' -fuzz FuzzOpen -fuzztime $(FUZZTIME)

# The first run generates a small sample Hermes home, which the first mount
# publishes as the store's first snapshot (the seeding path of a real
# `hermesfs mount ~/.hermes`). The demo keeps its store under $(DEMO_DIR) so it
# never touches your real default store. After a demo daemon was killed, the
# next run detaches the dead mount it left (scripts/demo.sh).
demo run: build
	@scripts/deps.sh demo
	@GO=$(GO) scripts/demo.sh $(BIN) $(DEMO_DIR)

clean:
	rm -rf bin
