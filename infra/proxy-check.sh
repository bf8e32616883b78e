#!/usr/bin/env bash
# The gateway behind real proxies (infra/proxy_check.py): `ecoscan up` behind Debian's HAProxy
# and nginx on loopback, with the configurations docs/proxies.md gives — SSE undelayed, the
# keepalive against a short proxy timeout, per-client limits behind trusted proxies (forwarding
# headers and PROXY v2), header mode refusing a forged Host through a proxy.
#
# Usage: infra/proxy-check.sh
#
# Installs when missing: haproxy and nginx-light (apt-get). Bounded: every wait in the check has
# a deadline, and the whole check is cut after 5 minutes. Traffic stays on 127.0.0.0/8. Fails,
# never skips, when a proxy cannot be had.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "proxy-check: $*"; }
die() { echo "proxy-check: $*" >&2; exit 1; }

# shellcheck source=lib/apt.sh
source infra/lib/apt.sh
haproxy_bin=$(command -v haproxy || true)
[[ -n "$haproxy_bin" ]] || [[ ! -x /usr/sbin/haproxy ]] || haproxy_bin=/usr/sbin/haproxy
nginx_bin=$(command -v nginx || true)
[[ -n "$nginx_bin" ]] || [[ ! -x /usr/sbin/nginx ]] || nginx_bin=/usr/sbin/nginx
missing=()
[[ -n "$haproxy_bin" ]] || missing+=(haproxy)
[[ -n "$nginx_bin" ]] || missing+=(nginx-light)
if ((${#missing[@]})); then
    apt_install "${missing[@]}"
    haproxy_bin=/usr/sbin/haproxy nginx_bin=/usr/sbin/nginx
fi
[[ -x "$haproxy_bin" && -x "$nginx_bin" ]] || die "no haproxy or nginx after installing them"
say "$("$haproxy_bin" -v | head -n 1); $("$nginx_bin" -v 2>&1)"

say "building the suite binary"
# The test command's own build (see infra/lib/suite.sh): nothing to recompile after it.
cargo build --locked --quiet --workspace --bins
ecoscan="${CARGO_TARGET_DIR:-$PWD/target}/debug/ecoscan"
[[ -x "$ecoscan" ]] || die "no suite binary at $ecoscan after cargo build"

work=$(mktemp -d)
chmod 755 "$work" # HAProxy reads its configuration after it has become nobody in one check
trap 'rm -rf "$work"' EXIT
status=0
CHECK_NAME=proxy-check CHECK_ECOSCAN="$ecoscan" CHECK_WORK="$work" \
    PROXY_HAPROXY="$haproxy_bin" PROXY_NGINX="$nginx_bin" \
    timeout 300 python3 infra/proxy_check.py || status=$?
if ((status != 0)); then
    for log in "$work"/*.log; do
        echo "proxy-check: the end of $log:" >&2
        tail -n 20 "$log" >&2
    done
    die "the proxy checks failed (exit status $status)"
fi
