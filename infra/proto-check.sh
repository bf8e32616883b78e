#!/usr/bin/env bash
# Holds the gRPC API to buf's standard: `buf lint` (STANDARD + COMMENTS, see proto/buf.yaml) and
# `buf breaking` against the committed image of the last released API
# (proto/released/ecoscan-v1.json). Installs the pinned buf CLI from npm when it is absent.
#
# Usage: infra/proto-check.sh            lint and check for breaking changes
#        infra/proto-check.sh --release  after a deliberate, released API change: rewrite the
#                                        baseline image from the current protos
set -euo pipefail
cd "$(dirname "$0")/../proto"

BUF_VERSION=1.75.0
TOOLS_DIR="${ECOSCAN_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ecoscan-tools}"
BASELINE=released/ecoscan-v1.json

buf_bin() {
    if command -v buf >/dev/null 2>&1 && [ "$(buf --version 2>/dev/null)" = "$BUF_VERSION" ]; then
        command -v buf
        return
    fi
    local local_buf="$TOOLS_DIR/node_modules/.bin/buf"
    if ! [ -x "$local_buf" ] || [ "$("$local_buf" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
        echo "proto-check: installing buf $BUF_VERSION from npm into $TOOLS_DIR" >&2
        mkdir -p "$TOOLS_DIR"
        # The npm package ships the buf binary for this platform as an optional dependency.
        npm install --silent --no-audit --no-fund --prefix "$TOOLS_DIR" "@bufbuild/buf@$BUF_VERSION" >&2
    fi
    echo "$local_buf"
}

BUF=$(buf_bin)

if [ "${1:-}" = "--release" ]; then
    tmp=$(mktemp)
    trap 'rm -f "$tmp"' EXIT
    "$BUF" build --exclude-source-info -o "$tmp#format=json"
    # One field per line, so that a review of a release shows what changed.
    python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1])), open(sys.argv[2], "w"), indent=1, ensure_ascii=False); open(sys.argv[2], "a").write("\n")' "$tmp" "$BASELINE"
    echo "proto-check: wrote $BASELINE from the current protos"
    exit 0
fi

echo "proto-check: buf lint"
"$BUF" lint
echo "proto-check: buf breaking against $BASELINE"
"$BUF" breaking --against "$BASELINE"
echo "proto-check: ecoscan.v1 is lint-clean and compatible with the released API"
