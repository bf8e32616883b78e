"""Traces as a backend the project did not write reads them (issue 45): an OTLP/gRPC receiver
built here from the official opentelemetry-proto definitions (PyPI `opentelemetry-proto`, served
with grpcio), and `ecoscan up` exporting to it. Scans are run the ways users run them — submitted
then watched (two requests), completed in one call, and failed at a stage whose deadline ran out
— and their spans are checked:

  - the one-call scan's trace has spans from all 8 services, and no span in a scan's trace has a
    parent the trace lacks (no orphans);
  - every span with status ERROR says why: a non-empty, readable (not percent-encoded) message;
  - the watch, a trace of its own, links to the scan's trace;
  - an analytics write batch links to the requests whose calls it wrote;
  - every attribute name is in the one vocabulary (the conventions' namespaces, the project's).

Environment: CHECK_ECOSCAN, CHECK_WORK, CHECK_NAME (infra/lib/suiteproc.py).
"""

import json
import os
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2, trace_service_pb2_grpc)

import suiteproc as sp  # noqa: E402
from suiteproc import bearer, check, request, say  # noqa: E402

SERVICES = {"ecoscan-gateway", "ecoscan-ingest", "ecoscan-vision", "ecoscan-rule",
            "ecoscan-answer", "ecoscan-reward", "ecoscan-analytics", "ecoscan-notification"}
VOCABULARY_PREFIXES = ("rpc.", "db.", "messaging.", "gen_ai.", "http.", "url.", "server.",
                       "client.", "network.", "aws.", "code.", "job.", "llm.", "vision.", "rule.",
                       "answer.", "reward.", "notification.", "analytics.")
VOCABULARY = {"user.id", "error.type"}
STATUS_ERROR = 2
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f8cf00000301010018dd8db40000000049454e44ae426082")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent, flattened."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans = []

    def Export(self, request, context):  # noqa: N802 (the generated service's name)
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service,
                            "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "name": s.name,
                            "status": s.status.code,
                            "message": s.status.message,
                            "attributes": [a.key for a in s.attributes],
                            "links": [(l.trace_id.hex(), l.span_id.hex()) for l in s.links],
                        })
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self):
        with self.lock:
            return list(self.spans)


def form():
    boundary = "otlpcheck"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\""
            f"\r\nContent-Type: image/png\r\n\r\n").encode() + PNG + \
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"hint\"\r\n\r\nplastic " \
        f"bottle\r\n--{boundary}--\r\n".encode()
    return {"Content-Type": f"multipart/form-data; boundary={boundary}"}, body


def events(body):
    """The SSE events of a finished stream: [(event, data)]."""
    out = []
    for block in body.decode().split("\n\n"):
        name, data = "message", []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            out.append((name, json.loads("\n".join(data))))
    return out


def trace_of(evs):
    ids = {d.get("trace_id") for _, d in evs if d.get("trace_id")}
    return ids.pop() if len(ids) == 1 else None


def completion(port, token):
    headers, body = form()
    status, _, out = request(port, "POST", "/api/v1/scan/completion",
                             dict(bearer(token), **headers), body, timeout=90)
    evs = events(out)
    return status, evs, trace_of(evs)


def wait_for(receiver, ready, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        spans = receiver.snapshot()
        if ready(spans):
            return spans
        time.sleep(0.25)
    check(False, f"{what} within {timeout} s")
    return receiver.snapshot()


def in_trace(spans, trace):
    return [s for s in spans if s["trace"] == trace]


def no_orphans(trace_spans):
    ids = {s["id"] for s in trace_spans}
    return [s for s in trace_spans if s["parent"] and s["parent"] not in ids]


def main():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    say(f"OTLP receiver (opentelemetry-proto + grpcio) on 127.0.0.1:{otlp_port}")
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        # --- a suite whose scans succeed -----------------------------------------------------
        port, _, token, _ = sp.start_up(dict(otlp, LLM_MOCK_LATENCY="100ms"))
        status, evs, one_call = completion(port, token)
        check(status == 200 and evs and evs[-1][0] == "ready" and one_call,
              f"a scan completed in one call ({status}, last event {evs[-1][0] if evs else None})")

        headers, body = form()
        status, h, out = request(port, "POST", "/api/v1/scan", dict(bearer(token), **headers),
                                 body)
        check(status == 202, f"a scan submitted ({status})")
        job = json.loads(out)["job_id"]
        status, _, out = request(port, "GET", f"/api/v1/scan/{job}/events", bearer(token),
                                 timeout=90)
        watched = events(out)
        submitted = trace_of(watched)
        check(status == 200 and watched and watched[-1][0] == "ready" and submitted,
              f"the submitted scan watched to its end ({status})")

        def watch_links(spans):
            return [s for s in spans if s["trace"] != submitted
                    and s["service"] in ("ecoscan-ingest", "ecoscan-gateway")
                    and any(t == submitted for t, _ in s["links"])]

        def ready(spans):
            services = {s["service"] for s in in_trace(spans, one_call)}
            return (SERVICES <= services
                    and not no_orphans(in_trace(spans, one_call))
                    and not no_orphans(in_trace(spans, submitted))
                    and watch_links(spans)
                    and any(s["name"] == "analytics.write_batch" and s["links"] for s in spans))

        spans = wait_for(receiver, ready, "every span of the two scans arrived")
        services = {s["service"] for s in in_trace(spans, one_call)}
        check(SERVICES <= services, f"the one-call scan's trace has all 8 services "
              f"(missing {sorted(SERVICES - services)})")
        for name, trace in [("one-call", one_call), ("submitted", submitted)]:
            orphans = no_orphans(in_trace(spans, trace))
            check(not orphans, f"the {name} scan's trace has no orphans "
                  f"({[(o['service'], o['name']) for o in orphans][:5]})")
        linked = watch_links(spans)
        check(linked, f"the watch, a trace of its own, links to the scan's trace "
              f"({[(s['service'], s['name']) for s in linked][:3]})")
        scan_spans = {s["id"] for s in spans if s["trace"] in (one_call, submitted)}
        batches = [s for s in spans if s["name"] == "analytics.write_batch"
                   and any(i in scan_spans for _, i in s["links"])]
        check(batches, "an analytics write batch links to the scans' Record requests")
        sp.stop_all()

        # --- a suite whose vision stage runs out of time -------------------------------------
        sp.children.clear()
        port, _, token, _ = sp.start_up(dict(otlp, LLM_MOCK_LATENCY="3s",
                                             INGEST_STAGE_TIMEOUT="1s", INGEST_STAGE_RETRIES="0"))
        status, evs, failed = completion(port, token)
        check(status == 200 and evs and evs[-1][0] == "error" and failed,
              f"a scan whose stage ran out of time ends with an error event "
              f"({[e for e, _ in evs][-2:]})")
        spans = wait_for(receiver, lambda s: any(x["status"] == STATUS_ERROR
                                                 for x in in_trace(s, failed)),
                         "the failed scan's error spans arrived")
        errors = [s for s in in_trace(spans, failed) if s["status"] == STATUS_ERROR]
        check(errors, f"the failed scan has error spans ({len(errors)})")
        unreadable = [(s["service"], s["name"], s["message"]) for s in errors
                      if not s["message"].strip() or "%20" in s["message"]]
        check(not unreadable, f"every error span says why, readably ({unreadable[:3]})")
        say(f"an error span says: {errors[0]['message']!r}" if errors else "no error span")

        # --- every span of both suites -------------------------------------------------------
        spans = receiver.snapshot()
        outside = sorted({f"{k} (on {s['service']} {s['name']})" for s in spans
                          for k in s["attributes"]
                          if k not in VOCABULARY and not k.startswith(VOCABULARY_PREFIXES)})
        check(not outside, f"every attribute name is in the vocabulary ({outside[:5]})")
        say(f"{len(spans)} spans received")
    finally:
        sp.stop_all()
        server.stop(0)
    sp.report()


if __name__ == "__main__":
    main()
