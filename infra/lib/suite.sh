# Shared by the checks that drive a running suite (api-check.sh, demo-check.sh; the build and
# the directory, and `tools_venv`, also grpc-client-check.sh and otlp-check.sh): build the
# `ecoscan` binary, start `ecoscan up` on loopback with every port 0 in a temporary directory,
# wait until its gateway is ready, and stop it (and remove the directory) on exit.
# The caller defines `say` and `die` and sources this file from the repository's root.
# After `suite_start`: $ecoscan (the binary), $work (the directory), $gateway (host:port) and
# $gateway_admin (host:port of its admin listener: /metrics, /readyz).

SUITE_READY_TIMEOUT=${SUITE_READY_TIMEOUT:-60}

suite_build() {
    say "building the suite binary"
    # The same build as the test command's (`--workspace --bins`): a narrower one (`-p ecoscan`)
    # unifies fewer features, recompiles the crates whose features differ and replaces the binary.
    cargo build --locked --quiet --workspace --bins
    ecoscan="${CARGO_TARGET_DIR:-$PWD/target}/debug/ecoscan"
    [[ -x "$ecoscan" ]] || die "no suite binary at $ecoscan after cargo build"
}

work=$(mktemp -d)
suite_pid=
gateway=
gateway_admin=

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

suite_cleanup() {
    stop_suite
    rm -rf "$work"
}
trap suite_cleanup EXIT

# suite_start [VAR=value …]: `ecoscan up` with these variables (and the mock model provider).
suite_start() {
    local ports=() service deadline
    for service in gateway gateway-admin ingest vision rule answer reward analytics notification; do
        ports+=("--$service-port" 0)
    done
    say "starting ecoscan up on 127.0.0.1 (logs: $work/suite.log while it runs)"
    # Made here, not by the background job's redirections: the loop below may read them before
    # that job has run far enough to open them (and under `set -e` a failed read ends the check).
    : >"$work/suite.out"
    : >"$work/suite.log"
    env LLM_PROVIDER=mock RUST_LOG="${RUST_LOG:-warn}" "$@" \
        "$ecoscan" up --data-dir "$work/data" --host 127.0.0.1 "${ports[@]}" \
        >"$work/suite.out" 2>"$work/suite.log" &
    suite_pid=$!

    # `ecoscan up` prints the gateway's addresses once every port is bound.
    gateway=
    gateway_admin=
    deadline=$((SECONDS + SUITE_READY_TIMEOUT))
    while [[ -z "$gateway" || -z "$gateway_admin" ]]; do
        kill -0 "$suite_pid" 2>/dev/null ||
            { tail -n 30 "$work/suite.log" >&2; die "ecoscan up exited before listening"; }
        ((SECONDS < deadline)) ||
            die "ecoscan up printed no gateway address in ${SUITE_READY_TIMEOUT}s"
        gateway=$(sed -n 's|^gateway *http://\(127\.0\.0\.1:[0-9]*\).*|\1|p' "$work/suite.out")
        gateway_admin=$(sed -n 's|^gateway admin *http://\(127\.0\.0\.1:[0-9]*\).*|\1|p' "$work/suite.out")
        [[ -n "$gateway" && -n "$gateway_admin" ]] || sleep 0.2
    done
    until curl -fsS -o /dev/null "http://$gateway_admin/readyz" 2>/dev/null; do
        kill -0 "$suite_pid" 2>/dev/null ||
            { tail -n 30 "$work/suite.log" >&2; die "ecoscan up exited before it was ready"; }
        ((SECONDS < deadline)) ||
            die "http://$gateway_admin/readyz did not answer 200 in ${SUITE_READY_TIMEOUT}s"
        sleep 0.2
    done
    say "gateway ready at http://$gateway"
}

# tools_venv NAME PACKAGE==VERSION…: a virtualenv of its own for these pinned PyPI packages under
# ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}/NAME, installed once; sets $venv to it.
tools_venv() {
    local name=$1
    shift
    venv="${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}/$name"
    [[ -f "$venv/.installed" ]] && return 0
    say "installing $* into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv" ||
        die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$@" ||
        { rm -rf "$venv"; die "could not install $*"; }
    touch "$venv/.installed"
}
