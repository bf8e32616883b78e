"""gRPC as a team that did not write ecoscan calls it (issue 46): a Python client generated from
proto/ with grpcio-tools, errors decoded with grpcio-status (google.rpc.Status from
grpc-status-details-bin), against `ecoscan up` on loopback.

Checked, each with its code, its ErrorInfo (reason, domain `ecoscan`, metadata) and detail types:
  - a scan submitted and watched to its end (the happy path, generated stubs only), resumed
    after each cut at the watch's lifetime; that cut (DEADLINE_EXCEEDED in the trailers, after
    events) carries the same details as any refusal;
  - every error: a RequestInfo whose request_id is the call's trace id; a LocalizedMessage in
    Korean or English when the call asks with accept-language;
  - a field the service refuses: INVALID_ARGUMENT, INVALID_FIELD and a BadRequest naming it;
  - an unknown job: NOT_FOUND, the code as the reason;
  - a call with no identity: UNAUTHENTICATED, IDENTITY_MISSING;
  - a forged assertion, and one for another service: UNAUTHENTICATED, IDENTITY_REFUSED with the
    service called in metadata;
  - a request over the server's limit: OUT_OF_RANGE, MESSAGE_TOO_LARGE with size and limit;
  - submits past a full backlog: RESOURCE_EXHAUSTED, BACKLOG_FULL with a RetryInfo delay;
and, read by prometheus_client's OpenMetrics parser, the RPC durations' trace-id exemplars.

Environment: CHECK_ECOSCAN, CHECK_WORK, CHECK_NAME (infra/lib/suiteproc.py) and CHECK_STUBS
(the directory the generated modules are in).
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
sys.path.insert(0, os.environ["CHECK_STUBS"])

import grpc  # noqa: E402
from google.rpc import error_details_pb2  # noqa: E402
from grpc_status import rpc_status  # noqa: E402
from prometheus_client.openmetrics.parser import text_string_to_metric_families  # noqa: E402

from ecoscan.v1 import ingest_pb2, ingest_pb2_grpc, rule_pb2, rule_pb2_grpc  # noqa: E402
import suiteproc as sp  # noqa: E402
from suiteproc import check, say  # noqa: E402

# A 1x1 PNG: ingest sniffs the bytes, and the mock model reads the hint.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f8cf00000301010018dd8db40000000049454e44ae426082")


def identity(user, service):
    """The `x-ecoscan-identity` metadata `ecoscan token --grpc` mints for `service`."""
    out = subprocess.run(
        [sp.ECOSCAN, "token", "--user", user, "--grpc", service,
         "--data-dir", os.path.join(sp.WORK, "data")],
        check=True, capture_output=True, text=True).stdout.strip()
    key, value = out.split(":", 1)
    return [(key.strip(), value.strip())]


def details(err):
    """(google.rpc.Status, {type name: message}) of an RpcError's details."""
    status = rpc_status.from_call(err)
    if status is None:
        return None, {}
    found = {}
    for any_msg in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo,
                    error_details_pb2.BadRequest, error_details_pb2.RequestInfo,
                    error_details_pb2.LocalizedMessage):
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                found[cls.DESCRIPTOR.name] = msg
    return status, found


def refused(call, what):
    """Runs `call`, which must fail; returns the RpcError."""
    try:
        call()
    except grpc.RpcError as err:
        return err
    check(False, f"{what}: refused")
    raise SystemExit(1)


def check_error(err, what, code, reason, metadata_keys=(), retry=False, field=None):
    check(err.code() == code, f"{what}: {code.name} (got {err.code().name}: {err.details()!r})")
    status, found = details(err)
    check(status is not None, f"{what}: google.rpc.Status in grpc-status-details-bin")
    if status is None:
        return
    check(status.code == code.value[0] and status.message == err.details(),
          f"{what}: the detailed status repeats the code and message")
    info = found.get("ErrorInfo")
    check(info is not None and info.reason == reason and info.domain == "ecoscan",
          f"{what}: ErrorInfo reason {reason} domain ecoscan "
          f"(got {info.reason if info else None!r} {info.domain if info else None!r})")
    for key in metadata_keys:
        check(info is not None and info.metadata.get(key),
              f"{what}: ErrorInfo metadata has {key} ({dict(info.metadata) if info else {}})")
    request = found.get("RequestInfo")
    check(request is not None and len(request.request_id) == 32 and int(request.request_id, 16),
          f"{what}: RequestInfo with the call's trace id ({request.request_id if request else None!r})")
    if field:
        bad = found.get("BadRequest")
        fields = [v.field for v in bad.field_violations] if bad else []
        check(fields == [field] and bad.field_violations[0].description == err.details(),
              f"{what}: BadRequest names {field} ({fields})")
    if retry:
        delay = found.get("RetryInfo")
        check(delay is not None and delay.retry_delay.ToTimedelta().total_seconds() >= 1,
              f"{what}: RetryInfo with a delay ({delay})")
    plain = err.details() or ""
    check(plain and not any(s in plain for s in ("JSON error", "Invalid", "decoded message length")),
          f"{what}: a plain message ({plain!r})")


def exemplars(addr):
    """The RPC durations carry trace ids as exemplars, as prometheus_client's OpenMetrics parser
    (not the project's code) reads ingest's /metrics when asked the way Prometheus asks."""
    port = int(addr.rsplit(":", 1)[1])
    status, headers, body = sp.request(port, "GET", "/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    check(status == 200 and headers.get("content-type", "").startswith(
        "application/openmetrics-text"), f"/metrics in OpenMetrics when asked ({status}, "
        f"{headers.get('content-type')})")
    found = []
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "rpc_server_duration_seconds":
            found += [s.exemplar for s in family.samples if s.exemplar is not None]
    trace_ids = [e.labels.get("trace_id", "") for e in found]
    check(trace_ids and all(len(t) == 32 and int(t, 16) for t in trace_ids),
          f"rpc_server_duration_seconds buckets carry trace ids as exemplars ({trace_ids[:3]})")


def main():
    _, addrs, _, _ = sp.start_up({
        # Slow scans and a small backlog, so the backlog fills within the check.
        "LLM_MOCK_LATENCY": "3s",
        "INGEST_MAX_BACKLOG": "3",
        # Watches end at 2 s: a stream whose status comes after its messages.
        "INGEST_WATCH_MAX_LIFETIME": "2s",
    })
    say(f"ecoscan up: ingest {addrs['ingest']}")
    channel = grpc.insecure_channel(addrs["ingest"])
    scans = ingest_pb2_grpc.ScanServiceStub(channel)
    me = identity("grpcio-client", "ecoscan.v1.ScanService")

    # The happy path: submit, then watch to the end.
    job = scans.Submit(ingest_pb2.SubmitRequest(image=PNG, hint="plastic bottle", locale="en"),
                       metadata=me, timeout=30)
    check(len(job.job_id) == 36, f"Submit: a job id ({job.job_id})")
    # Watched as a client does: a stream cut at its lifetime (2 s here) is resumed after the
    # last event it delivered, until the job's end.
    stages, last, cut, seen_at_cut = [], "", None, 0
    for _ in range(20):
        try:
            for m in scans.Watch(ingest_pb2.WatchRequest(job_id=job.job_id, after_event_id=last),
                                 metadata=me, timeout=120):
                if m.HasField("event"):
                    stages.append(m.event.stage)
                    last = m.event.event_id
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            if cut is None:
                cut, seen_at_cut = e, len(stages)
    check(stages and ingest_pb2.Stage.Name(stages[-1]) == "STAGE_DONE",
          f"Watch: resumed after each cut, the stream ends done "
          f"({[ingest_pb2.Stage.Name(s) for s in stages[-3:]]})")
    check(cut is not None and seen_at_cut > 0,
          f"a Watch ends at its lifetime after sending events ({seen_at_cut} events)")
    if cut is not None:
        # The status came in the trailers, after messages: the same details all the same.
        check_error(cut, "a Watch at its lifetime", grpc.StatusCode.DEADLINE_EXCEEDED,
                    "DEADLINE_EXCEEDED")

    exemplars(addrs["ingest"])

    request = ingest_pb2.SubmitRequest(image=PNG, hint="plastic bottle")
    err = refused(lambda: scans.Submit(request, timeout=10), "no identity")
    check_error(err, "no identity", grpc.StatusCode.UNAUTHENTICATED, "IDENTITY_MISSING")

    french = ingest_pb2.SubmitRequest(image=PNG, hint="plastic bottle", locale="fr")
    err = refused(lambda: scans.Submit(french, metadata=me + [("accept-language", "ko-KR")],
                                       timeout=10), "unsupported locale")
    check_error(err, "unsupported locale", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD",
                ["field"], field="locale")
    localized = details(err)[1].get("LocalizedMessage")
    check(localized is not None and localized.locale == "ko-KR" and "`locale`" in localized.message
          and any("\uac00" <= c <= "\ud7a3" for c in localized.message),
          f"accept-language ko: a Korean LocalizedMessage ({localized.message if localized else None!r})")
    err = refused(lambda: scans.Submit(french, metadata=me + [("accept-language", "en")],
                                       timeout=10), "unsupported locale, in English")
    localized = details(err)[1].get("LocalizedMessage")
    check(localized is not None and localized.locale == "en-US"
          and localized.message == err.details(),
          f"accept-language en: the message as an English LocalizedMessage ({localized})")

    # Another service's refusal of a field: rule, a lookup with no classification.
    rules = rule_pb2_grpc.RuleServiceStub(grpc.insecure_channel(addrs["rule"]))
    err = refused(lambda: rules.Lookup(rule_pb2.LookupRequest(), timeout=10).next(),
                  "rule lookup without a classification")
    check_error(err, "rule lookup without a classification", grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_FIELD", ["field"], field="classification")

    unknown = ingest_pb2.GetResultRequest(job_id="6f1c1e0e-4f4a-4b7e-9a4e-2d1f0c9b8a7d")
    err = refused(lambda: scans.GetResult(unknown, metadata=me, timeout=10), "unknown job")
    check_error(err, "unknown job", grpc.StatusCode.NOT_FOUND, "NOT_FOUND")

    forged = [("x-ecoscan-identity", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl")]
    err = refused(lambda: scans.Submit(request, metadata=forged, timeout=10), "forged identity")
    check_error(err, "forged identity", grpc.StatusCode.UNAUTHENTICATED, "IDENTITY_REFUSED",
                ["service"])

    elsewhere = identity("grpcio-client", "ecoscan.v1.RewardService")
    err = refused(lambda: scans.Submit(request, metadata=elsewhere, timeout=10),
                  "identity for another service")
    check_error(err, "identity for another service", grpc.StatusCode.UNAUTHENTICATED,
                "IDENTITY_REFUSED", ["service"])

    big = ingest_pb2.SubmitRequest(image=b"\0" * (17 * 1024 * 1024), hint="too big")
    err = refused(lambda: scans.Submit(big, metadata=me, timeout=30), "oversized request")
    check_error(err, "oversized request", grpc.StatusCode.OUT_OF_RANGE, "MESSAGE_TOO_LARGE",
                ["size", "limit"])

    # Fill the backlog (3) with slow scans: a submit past it is refused with when to retry.
    err = None
    for i in range(12):
        try:
            scans.Submit(ingest_pb2.SubmitRequest(image=PNG, hint=f"bottle {i}"),
                         metadata=identity(f"grpcio-backlog-{i}", "ecoscan.v1.ScanService"),
                         timeout=30)
        except grpc.RpcError as e:
            err = e
            break
    check(err is not None, "a full backlog refuses a submit")
    if err is not None:
        check_error(err, "full backlog", grpc.StatusCode.RESOURCE_EXHAUSTED, "BACKLOG_FULL",
                    ["backlog"], retry=True)
    channel.close()


if __name__ == "__main__":
    try:
        main()
    finally:
        sp.stop_all()
    sp.report()
