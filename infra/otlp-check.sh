#!/usr/bin/env bash
# Traces read by a receiver ecoscan did not write (infra/otlp_check.py): an OTLP/gRPC endpoint
# built from the official opentelemetry-proto definitions with grpcio, and `ecoscan up`
# exporting to it — a scan submitted then watched, one completed in one call, one failed at a
# stage's deadline — checked for all 8 services, no orphans, readable error messages, the
# watch's and the analytics batches' links, and the attribute vocabulary.
#
# Usage: infra/otlp-check.sh
#
# Installs the pinned grpcio and opentelemetry-proto into a virtualenv of their own under
# ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}, once. Cut after 5 minutes. Traffic stays on
# 127.0.0.1.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

GRPCIO_VERSION=1.85.4
OPENTELEMETRY_PROTO_VERSION=1.45.2

say() { echo "otlp-check: $*"; }
die() { echo "otlp-check: $*" >&2; exit 1; }

# The binary and a scratch directory removed on exit ($ecoscan, $work), and the tools' venv.
# shellcheck source=lib/suite.sh
source infra/lib/suite.sh
tools_venv "otlp-$GRPCIO_VERSION-$OPENTELEMETRY_PROTO_VERSION" \
    "grpcio==$GRPCIO_VERSION" "opentelemetry-proto==$OPENTELEMETRY_PROTO_VERSION"
suite_build
status=0
CHECK_NAME=otlp-check CHECK_ECOSCAN="$ecoscan" CHECK_WORK="$work" \
    timeout 300 "$venv/bin/python" infra/otlp_check.py || status=$?
if ((status != 0)); then
    for log in "$work"/*.log; do
        [[ -f "$log" ]] || continue
        echo "otlp-check: the end of $log:" >&2
        tail -n 20 "$log" >&2
    done
    die "the trace checks failed (exit status $status)"
fi
