#!/usr/bin/env bash
# gRPC from a client ecoscan did not write (infra/grpc_client_check.py): Python stubs generated
# from proto/ with grpcio-tools, error details decoded with grpcio-status, against `ecoscan up`
# on loopback — the happy path, and each error's code, ErrorInfo reason and detail types; and
# the RPC durations' trace-id exemplars, read by prometheus_client's OpenMetrics parser.
#
# Usage: infra/grpc-client-check.sh
#
# Installs the pinned grpcio-tools, grpcio-status and prometheus-client into a virtualenv of their own under
# ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}, once. The check is cut after 5 minutes.
# Traffic stays on 127.0.0.1.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

GRPCIO_TOOLS_VERSION=1.85.4
GRPCIO_STATUS_VERSION=1.85.3
PROMETHEUS_CLIENT_VERSION=0.26.0

say() { echo "grpc-client-check: $*"; }
die() { echo "grpc-client-check: $*" >&2; exit 1; }

# The binary and a scratch directory removed on exit ($ecoscan, $work); the Python side starts
# `ecoscan up` itself (infra/lib/suiteproc.py).
# shellcheck source=lib/suite.sh
source infra/lib/suite.sh
tools_venv "grpcio-$GRPCIO_TOOLS_VERSION-$GRPCIO_STATUS_VERSION-$PROMETHEUS_CLIENT_VERSION" \
    "grpcio-tools==$GRPCIO_TOOLS_VERSION" "grpcio-status==$GRPCIO_STATUS_VERSION" \
    "prometheus-client==$PROMETHEUS_CLIENT_VERSION"
suite_build
stubs="$work/stubs"
mkdir -p "$stubs"
say "generating the Python client from proto/ (grpc_tools.protoc)"
"$venv/bin/python" -m grpc_tools.protoc -I proto --python_out="$stubs" \
    --grpc_python_out="$stubs" proto/ecoscan/v1/*.proto
status=0
CHECK_NAME=grpc-client-check CHECK_ECOSCAN="$ecoscan" CHECK_WORK="$work" CHECK_STUBS="$stubs" \
    timeout 300 "$venv/bin/python" infra/grpc_client_check.py || status=$?
if ((status != 0)); then
    for log in "$work"/*.log; do
        [[ -f "$log" ]] || continue
        echo "grpc-client-check: the end of $log:" >&2
        tail -n 20 "$log" >&2
    done
    die "the gRPC client checks failed (exit status $status)"
fi
