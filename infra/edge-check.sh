#!/usr/bin/env bash
# The hostile edge (infra/edge_check.py): `ecoscan up` and a gateway on a JWKS, attacked on
# loopback with clients ecoscan did not write — nginx as a same-host forwarding proxy, tokens
# from PyJWT + cryptography, raw sockets (16,000 silent connections, idle HTTP/2, slow heads and
# bodies, unauthenticated uploads) — while a fast authenticated client keeps getting answers.
#
# Usage: infra/edge-check.sh
#
# Installs when missing: nginx (Debian's nginx-light, with apt-get) and the pinned PyJWT and
# cryptography (pip). Bounded: every wait in the check has a deadline, and the whole check is
# cut after 10 minutes. Traffic stays on 127.0.0.0/8.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYJWT_VERSION=2.10.1
CRYPTOGRAPHY_VERSION=46.0.3

say() { echo "edge-check: $*"; }
die() { echo "edge-check: $*" >&2; exit 1; }

nginx_bin=$(command -v nginx || true)
[[ -n "$nginx_bin" ]] || [[ ! -x /usr/sbin/nginx ]] || nginx_bin=/usr/sbin/nginx
if [[ -z "$nginx_bin" ]]; then
    say "installing nginx-light with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null; } ||
        die "could not install nginx"
    nginx_bin=/usr/sbin/nginx
fi

have=$(python3 -c 'import jwt, cryptography; print(jwt.__version__, cryptography.__version__)' 2>/dev/null || true)
if [[ "$have" != "$PYJWT_VERSION $CRYPTOGRAPHY_VERSION" ]]; then
    say "installing PyJWT==$PYJWT_VERSION cryptography==$CRYPTOGRAPHY_VERSION with pip"
    python3 -m pip install --quiet "PyJWT==$PYJWT_VERSION" "cryptography==$CRYPTOGRAPHY_VERSION" ||
        die "could not install PyJWT and cryptography"
fi

say "building the suite binary"
# The test command's own build (see infra/lib/suite.sh): nothing to recompile after it.
cargo build --locked --quiet --workspace --bins
ecoscan="${CARGO_TARGET_DIR:-$PWD/target}/debug/ecoscan"
[[ -x "$ecoscan" ]] || die "no suite binary at $ecoscan after cargo build"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
CHECK_NAME=edge-check CHECK_ECOSCAN="$ecoscan" CHECK_WORK="$work" EDGE_NGINX="$nginx_bin" \
    timeout 600 python3 infra/edge_check.py || status=$?
if ((status != 0)); then
    for log in "$work"/*.log; do
        echo "edge-check: the end of $log:" >&2
        tail -n 20 "$log" >&2
    done
    die "the hostile-edge checks failed (exit status $status)"
fi
