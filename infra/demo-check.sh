#!/usr/bin/env bash
# Drives the demo page (gateway/static/index.html) in headless Chromium against `ecoscan up`:
#   1. builds the suite binary (`cargo build --workspace --bins`, the test command's own build) and starts
#      `ecoscan up` on loopback, every service on a port of its own choosing (port 0), its data
#      in a temporary directory, with GATEWAY_JAEGER_URL set so the page shows a trace link;
#   2. runs infra/demo-check.mjs (playwright-core driving Debian's /usr/bin/chromium): a scan
#      from the file picker to the rendered answer, stages, classification, rules, character and
#      collection, a notification arriving live, both languages, a dropped event stream resumed
#      with Last-Event-ID (no event lost or repeated), and the 415 of a file that is not a photo;
#   3. runs infra/eventsource-check.mjs: Chromium's own EventSource, cut mid-stream by a
#      forwarder, must resume by itself to `ready` and stop at the 204 after it (tickets, cookie);
#   4. stops the suite and removes its data.
#
# Usage: infra/demo-check.sh               the check (a screenshot goes to the temporary directory)
#        infra/demo-check.sh --screenshot  the same, and writes docs/demo.png for the README and docs/clients.md
#
# Traffic goes to 127.0.0.1 only: the suite listens on loopback and the page blocks (and the
# check fails on) any request elsewhere; the Jaeger link is checked, never opened.
#
# Needs node (18+), npm, curl and cargo. Installs, once: `chromium` and `fonts-noto-cjk` with
# apt-get when absent (the Korean text needs the CJK fonts), and the pinned npm package
# playwright-core into ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PLAYWRIGHT_VERSION=1.65.1
TOOLS_DIR="${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}"
PLAYWRIGHT_DIR="$TOOLS_DIR/playwright-core-$PLAYWRIGHT_VERSION"
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
JAEGER_URL=http://127.0.0.1:16686

say() { echo "demo-check: $*"; }
die() { echo "demo-check: $*" >&2; exit 1; }

screenshot=
case "${1:-}" in
    --screenshot) screenshot="$PWD/docs/demo.png" ;;
    "") ;;
    *) die "unknown argument $1 (usage: infra/demo-check.sh [--screenshot])" ;;
esac

command -v curl >/dev/null || die "curl is not installed"
command -v node >/dev/null || die "node is not installed (apt-get install nodejs npm)"

# shellcheck source=lib/apt.sh
source infra/lib/apt.sh
missing=()
[[ -x "$CHROMIUM" ]] || missing+=(chromium)
# (Into variables, not `| grep -q`: under pipefail an early exit of grep fails the pipe.)
fonts=$(fc-list 2>/dev/null || true)
[[ "$fonts" == *"Noto Sans CJK"* ]] || missing+=(fonts-noto-cjk)
((${#missing[@]} == 0)) || apt_install "${missing[@]}"
[[ -x "$CHROMIUM" ]] || die "no Chromium at $CHROMIUM"

installed=$(node -p 'require(process.argv[1]).version' \
    "$PLAYWRIGHT_DIR/node_modules/playwright-core/package.json" 2>/dev/null || true)
if [[ "$installed" != "$PLAYWRIGHT_VERSION" ]]; then
    say "installing playwright-core@$PLAYWRIGHT_VERSION from npm into $PLAYWRIGHT_DIR"
    rm -rf "$PLAYWRIGHT_DIR"
    mkdir -p "$PLAYWRIGHT_DIR"
    # playwright-core has no dependencies and downloads no browser: it drives the system one.
    npm install --silent --no-audit --no-fund --prefix "$PLAYWRIGHT_DIR" \
        "playwright-core@$PLAYWRIGHT_VERSION" >&2 ||
        { rm -rf "$PLAYWRIGHT_DIR"; die "could not install playwright-core from npm"; }
fi

# shellcheck source=lib/suite.sh
source infra/lib/suite.sh
suite_build
# The mock model at 2 s a call, as a person would see a real one: its answer then streams in
# several deltas (ingest coalesces them per 250 ms), which the page must show growing.
suite_start GATEWAY_JAEGER_URL="$JAEGER_URL" LLM_MOCK_LATENCY=2s

started=$SECONDS
status=0
DEMO_GATEWAY="http://$gateway" DEMO_TOKEN="$(cat "$work/data/token")" DEMO_CHROMIUM="$CHROMIUM" DEMO_JAEGER_URL="$JAEGER_URL" \
    DEMO_PLAYWRIGHT="$PLAYWRIGHT_DIR/node_modules/playwright-core" DEMO_WORK="$work" \
    DEMO_SCREENSHOT="${screenshot:-$work/demo.png}" \
    timeout 120 node infra/demo-check.mjs || status=$?
say "browser checks finished in $((SECONDS - started))s (exit status $status)"
if ((status == 0)); then
    started=$SECONDS
    DEMO_GATEWAY="http://$gateway" DEMO_TOKEN="$(cat "$work/data/token")" DEMO_CHROMIUM="$CHROMIUM" \
        DEMO_PLAYWRIGHT="$PLAYWRIGHT_DIR/node_modules/playwright-core" \
        timeout 240 node infra/eventsource-check.mjs || status=$?
    say "native EventSource checks finished in $((SECONDS - started))s (exit status $status)"
fi

stop_suite
if ((status != 0)); then
    echo "demo-check: the suite's log:" >&2
    tail -n 50 "$work/suite.log" >&2
    die "the demo page failed (see above)"
fi
[[ -n "$screenshot" ]] && say "wrote ${screenshot#"$PWD"/}"
say "ok"
