#!/usr/bin/env bash
# Drives the demo page (gateway/static/index.html) in headless Chromium against `ecoscan up`:
#   1. builds the suite binary (`cargo build -p ecoscan`, cheap after `cargo test`) and starts
#      `ecoscan up` on loopback, every service on a port of its own choosing (port 0), its data
#      in a temporary directory, with GATEWAY_JAEGER_URL set so the page shows a trace link;
#   2. runs infra/demo-check.mjs (playwright-core driving Debian's /usr/bin/chromium): a scan
#      from the file picker to the rendered answer, stages, classification, rules, character and
#      collection, a notification arriving live, both languages, a dropped event stream resumed
#      with Last-Event-ID (no event lost or repeated), and the 415 of a file that is not a photo;
#   3. stops the suite and removes its data.
#
# Usage: infra/demo-check.sh               the check (a screenshot goes to the temporary directory)
#        infra/demo-check.sh --screenshot  the same, and writes docs/demo.png for the README
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
READY_TIMEOUT=60

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

apt_install() {
    local run=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null && sudo -n true 2>/dev/null ||
            die "$* missing and no root to install it: apt-get install $*"
        run=(sudo -n)
    fi
    say "installing $* with apt-get"
    "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >/dev/null || {
        "${run[@]}" apt-get update -qq >/dev/null
        "${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
            >/dev/null
    } || die "apt-get install $* failed"
}
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

say "building the suite binary"
cargo build --locked --quiet -p ecoscan
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
    node -e 'console.log(JSON.parse(require("fs").readFileSync(0, "utf8")).target_directory)')
ecoscan="$target_dir/debug/ecoscan"
[[ -x "$ecoscan" ]] || die "no suite binary at $ecoscan after cargo build"

work=$(mktemp -d)
suite_pid=
stop_suite() {
    if [[ -n "$suite_pid" ]] && kill -0 "$suite_pid" 2>/dev/null; then
        kill -TERM "$suite_pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$suite_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$suite_pid" 2>/dev/null || true
        wait "$suite_pid" 2>/dev/null || true
    fi
    suite_pid=
}
cleanup() {
    stop_suite
    rm -rf "$work"
}
trap cleanup EXIT

ports=()
for service in gateway ingest vision rule answer reward analytics notification; do
    ports+=("--$service-port" 0)
done
say "starting ecoscan up on 127.0.0.1 (logs: $work/suite.log while it runs)"
env LLM_PROVIDER=mock GATEWAY_JAEGER_URL="$JAEGER_URL" RUST_LOG="${RUST_LOG:-warn}" \
    "$ecoscan" up --data-dir "$work/data" --host 127.0.0.1 "${ports[@]}" \
    >"$work/suite.out" 2>"$work/suite.log" &
suite_pid=$!

# `ecoscan up` prints the gateway's address once every port is bound.
gateway=
deadline=$((SECONDS + READY_TIMEOUT))
while [[ -z "$gateway" ]]; do
    kill -0 "$suite_pid" 2>/dev/null ||
        { tail -n 30 "$work/suite.log" >&2; die "ecoscan up exited before listening"; }
    ((SECONDS < deadline)) || die "ecoscan up printed no gateway address in ${READY_TIMEOUT}s"
    gateway=$(sed -n 's|^gateway *http://\(127\.0\.0\.1:[0-9]*\).*|\1|p' "$work/suite.out")
    [[ -n "$gateway" ]] || sleep 0.2
done
until curl -fsS -o /dev/null "http://$gateway/readyz" 2>/dev/null; do
    kill -0 "$suite_pid" 2>/dev/null ||
        { tail -n 30 "$work/suite.log" >&2; die "ecoscan up exited before it was ready"; }
    ((SECONDS < deadline)) || die "http://$gateway/readyz did not answer 200 in ${READY_TIMEOUT}s"
    sleep 0.2
done
say "gateway ready at http://$gateway"

started=$SECONDS
status=0
DEMO_GATEWAY="http://$gateway" DEMO_CHROMIUM="$CHROMIUM" DEMO_JAEGER_URL="$JAEGER_URL" \
    DEMO_PLAYWRIGHT="$PLAYWRIGHT_DIR/node_modules/playwright-core" DEMO_WORK="$work" \
    DEMO_SCREENSHOT="${screenshot:-$work/demo.png}" \
    timeout 120 node infra/demo-check.mjs || status=$?
say "browser checks finished in $((SECONDS - started))s (exit status $status)"

stop_suite
if ((status != 0)); then
    echo "demo-check: the suite's log:" >&2
    tail -n 50 "$work/suite.log" >&2
    die "the demo page failed (see above)"
fi
[[ -n "$screenshot" ]] && say "wrote ${screenshot#"$PWD"/}"
say "ok"
