#!/usr/bin/env bash
# Checks the running REST/SSE edge against the OpenAPI document it serves:
#   1. builds the suite binary (`cargo build --workspace --bins`, the test command's own build) and starts
#      `ecoscan up` on loopback, every service on a port of its own choosing (port 0), with its
#      data in a temporary directory, and waits for the gateway's /readyz;
#   2. mints a bearer token for it (`ecoscan token --user schemathesis --admin`);
#   3. runs Schemathesis against http://127.0.0.1:PORT/api/v1/openapi.json with that token:
#      every phase (examples, coverage, fuzzing, stateful), a bounded number of examples per
#      operation, and these checks on every response:
#        not_a_server_error            no 5xx
#        status_code_conformance       every status is one the operation documents
#        content_type_conformance      every Content-Type is one the status documents
#        response_headers_conformance  documented headers are present and match their schema
#        response_schema_conformance   every body (JSON, and each SSE event) matches its schema
#        negative_data_rejection       a request the document calls invalid is refused (4xx)
#      (positive_data_acceptance is left out: a schema-valid scan may still carry bytes that are
#      not an image, and `since` may be after `until`; the gateway rightly refuses both);
#   4. stops the suite and removes its data.
#
# Usage: infra/api-check.sh            (from anywhere; exit status 0 when every check passes)
#   API_CHECK_MAX_EXAMPLES  test cases per operation and phase [25]
#   API_CHECK_SEED          Schemathesis seed, to replay a run (it prints the one it used)
#
# Traffic goes to 127.0.0.1 only: the suite listens on loopback, and a `before_call` hook points
# every generated `image_url` at 127.0.0.1:9, which ingest refuses to fetch (a loopback address)
# before connecting, so no generated URL makes the suite reach out. The scan and schedule rate
# limits are raised for the run so the fuzzer reaches the handlers' logic, not only 429s.
#
# Needs python3 with venv, curl, and cargo. The one thing it installs is the pinned PyPI package
# schemathesis, into a virtualenv under ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}, once.
# The binary comes from cargo's target directory (CARGO_TARGET_DIR when set, as .ci/run sets it).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

SCHEMATHESIS_VERSION=4.32.5
TOOLS_DIR="${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}"
VENV="$TOOLS_DIR/schemathesis-$SCHEMATHESIS_VERSION"
MAX_EXAMPLES="${API_CHECK_MAX_EXAMPLES:-25}"

say() { echo "api-check: $*"; }
die() { echo "api-check: $*" >&2; exit 1; }

command -v curl >/dev/null || die "curl is not installed"

if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -qF "$SCHEMATHESIS_VERSION"; then
    command -v python3 >/dev/null || die "python3 is not installed"
    say "installing schemathesis==$SCHEMATHESIS_VERSION into $VENV"
    rm -rf "$VENV"
    mkdir -p "$TOOLS_DIR"
    python3 -m venv "$VENV" ||
        die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "schemathesis==$SCHEMATHESIS_VERSION" ||
        { rm -rf "$VENV"; die "could not install schemathesis from PyPI"; }
fi

# shellcheck source=lib/suite.sh
source infra/lib/suite.sh
suite_build
# SSE responses end after 2 s: a live stream (the notification stream has no end of its own)
# would otherwise hold each generated request until the 10 s request timeout, and 25 of them
# took most of the time the whole check has. What is checked of a stream (its status, headers
# and each event against the schema) is all in its first moments.
suite_start GATEWAY_SCANS_PER_MINUTE=100000 GATEWAY_SCHEDULES_PER_MINUTE=100000 \
    GATEWAY_SSE_MAX_LIFETIME=2s

token=$("$ecoscan" token --user schemathesis --admin --data-dir "$work/data")

# Runs before every request Schemathesis sends (every phase): no generated URL leaves loopback.
cat >"$work/ecoscan_api_check_hooks.py" <<'EOF'
import schemathesis

# Loopback: ingest refuses to fetch it before connecting (INGEST_FETCH_ALLOW is unset).
LOOPBACK_IMAGE = "http://127.0.0.1:9/photo.png"


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("image_url"), str):
        # As a URL parser reads it: leading controls and spaces dropped, tabs and newlines
        # removed anywhere, the scheme case-insensitive.
        url = "".join(c for c in body["image_url"] if c > " ").lower()
        if not url.startswith(("http:", "https:")):
            return
        body["image_url"] = LOOPBACK_IMAGE
EOF

seed=()
[[ -n "${API_CHECK_SEED:-}" ]] && seed=(--seed "$API_CHECK_SEED")
checks=not_a_server_error,status_code_conformance,content_type_conformance
checks+=,response_headers_conformance,response_schema_conformance,negative_data_rejection
say "schemathesis $SCHEMATHESIS_VERSION: $checks, $MAX_EXAMPLES examples per operation"
started=$SECONDS
status=0
(
    cd "$work"
    PYTHONPATH="$work" SCHEMATHESIS_HOOKS=ecoscan_api_check_hooks \
        timeout 300 "$VENV/bin/schemathesis" run "http://$gateway/api/v1/openapi.json" \
        --header "Authorization: Bearer $token" \
        --checks "$checks" \
        --max-examples "$MAX_EXAMPLES" \
        --request-timeout 10 \
        --no-color \
        "${seed[@]}"
) || status=$?
say "schemathesis finished in $((SECONDS - started))s (exit status $status)"

stop_suite
if ((status != 0)); then
    echo "api-check: the suite's log:" >&2
    tail -n 50 "$work/suite.log" >&2
    die "the API does not match its OpenAPI document (see above)"
fi
say "ok"
