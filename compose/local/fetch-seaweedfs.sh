#!/usr/bin/env bash
# Build SeaweedFS's `weed` (the S3-compatible store the tests use; Apache-2.0) from its
# Go module, once, into the ignored cache folder. Later runs find the binary and return
# at once; a machine that built it before reuses Go's module and build caches, so a
# rebuild there takes about a minute, a first build on 2 cores several.
set -euo pipefail
source "$(dirname "$0")/env.sh"

if [ -x "$WEED_BIN" ]; then
  exit 0
fi
command -v go >/dev/null || die "go is not on PATH; Conveyor's S3 tests build SeaweedFS with Go 1.26 (https://go.dev/dl/) or set S3_PORT to a running S3-compatible store"
MODULE=github.com/seaweedfs/seaweedfs
log "building SeaweedFS ($MODULE@$SEAWEEDFS_VERSION) into $WEED_BIN; the first build takes minutes"
# `go install MODULE/weed@VERSION` refuses modules with replace directives (this one has
# one), so the module is downloaded and built as the main module, where they apply.
src=$(go mod download -json "$MODULE@$SEAWEEDFS_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || die "could not download $MODULE@$SEAWEEDFS_VERSION from the Go module proxy"
mkdir -p "$(dirname "$WEED_BIN")"
(cd "$src" && go build -trimpath -ldflags="-s -w" -o "$WEED_BIN.tmp" ./weed) \
  || die "building SeaweedFS failed (see the output above)"
mv "$WEED_BIN.tmp" "$WEED_BIN"
