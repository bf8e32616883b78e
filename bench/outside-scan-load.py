#!/usr/bin/env python3
"""scan-load by a client that shares no code with the suite: raw asyncio sockets, PyJWT tokens.

`scan-load` (Rust, reqwest) measures 1000 users through the gateway; this measures the same load
as an outside client sees it, with nothing of the project's own on the client side: it starts
`ecoscan up` (the binary given) with the mock model at 8 s per call and otherwise defaults (but
the per-address connection cap: every user is 127.0.0.1), on
the stores of the environment (embedded unless REDIS_URL, a postgres:// DATABASE_URL and S3_*
are set, as bench/run-all sets them), mints one HS256 token per user with PyJWT from the secret
`ecoscan up` keeps in its data directory, and runs USERS closed-loop users ramped over RAMP
seconds. Each scan is what a browser's form sends over a socket of its own: `POST
/api/v1/scan/completion` as multipart/form-data (the photo as a file part, the hint as a field)
with `Authorization: Bearer`, then the answer's SSE stream (chunked HTTP/1.1, decoded here) read
to `ready`. E2E is from the request's first byte to the `ready` event. Scans that start after
the ramp and before its DURATION ends count (each is followed to its end); it prints their success rate, E2E p50/p95/p99 and
scans per minute, beside the issue's target (p95 ≤ 16.8 s: the model's 16 s plus 5 %).

    cargo build --release -p ecoscan
    python3 bench/outside-scan-load.py --binary $CARGO_TARGET_DIR/release/ecoscan

Needs PyJWT (`pip install PyJWT`). The client's own CPU shares the machine with the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

try:
    import jwt  # PyJWT
except ImportError:
    sys.exit("outside-scan-load: needs PyJWT: python3 -m pip install PyJWT")

SERVICES = ["ingest", "vision", "rule", "answer", "reward", "analytics", "notification"]
# A 1x1 PNG; the mock model classifies from the hint.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4"
    "890000000d49444154789c63f8cfc0f01f00050001ff89993d1d0000000049454e44ae426082")
HINTS = ["투명 페트병 pet bottle", "milk carton 우유팩", "can 캔", "glass bottle 유리병"]
TARGET_P95_S = 16.8


def start_suite(binary: str, data_dir: Path, log) -> tuple[subprocess.Popen, str, str]:
    cmd = [binary, "up", "--data-dir", str(data_dir), "--host", "127.0.0.1"]
    for service in ["gateway", "gateway-admin", *SERVICES]:
        cmd += [f"--{service}-port", "0"]
    # Every user connects from 127.0.0.1: the per-address connection cap (512) is raised, as
    # `scan-load` does; nothing else differs from the defaults.
    env = dict(os.environ, LLM_PROVIDER="mock", LLM_MOCK_LATENCY="8s", LLM_MOCK_JITTER="0",
               GATEWAY_MAX_CONNECTIONS_PER_IP="100000",
               RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    found: dict[str, str] = {}
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        # `name   http://127.0.0.1:PORT …` or `name   127.0.0.1:PORT`.
        m = re.match(r"\s*([a-z][a-z ]*?)\s+(?:http://)?(127\.0\.0\.1:\d+)", line)
        if m:
            found[m.group(1)] = m.group(2)
        if "notification" in found or time.monotonic() > deadline:
            break
    if "gateway" not in found or "gateway admin" not in found:
        proc.kill()
        sys.exit("outside-scan-load: the suite printed no gateway address (see its log)")
    # Keep reading stdout so that the suite never blocks writing to it.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, found["gateway"], found["gateway admin"]


def wait_ready(admin: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{admin}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit("outside-scan-load: the suite was not ready within 60 s")


def token(secret: str, user: str) -> str:
    now = int(time.time())
    return jwt.encode({"sub": user, "iss": "ecoscan-local", "aud": "ecoscan", "iat": now,
                       "nbf": now, "exp": now + 3600}, secret, algorithm="HS256")


def form(hint: str) -> tuple[bytes, str]:
    boundary = "----outside" + secrets.token_hex(12)
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
        f"filename=\"photo.png\"\r\nContent-Type: image/png\r\n\r\n".encode()
        + PNG
        + f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"hint\"\r\n\r\n".encode()
        + hint.encode()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, boundary


async def read_chunked_events(reader: asyncio.StreamReader):
    """The SSE events (their `event:` names) of a chunked HTTP/1.1 body, as they arrive."""
    pending = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            raise ConnectionError("connection closed mid-stream")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        pending += data[:-2]
        *blocks, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
        for block in blocks:
            for line in block.split(b"\n"):
                if line.startswith(b"event:"):
                    yield line[6:].strip().decode()


async def scan(gateway: str, bearer: str, hint: str, timeout: float) -> tuple[float, str | None]:
    """One scan: (seconds from the first byte to `ready`, None) or (elapsed, the error)."""
    host, port = gateway.rsplit(":", 1)
    body, boundary = form(hint)
    head = (
        f"POST /api/v1/scan/completion HTTP/1.1\r\nHost: {gateway}\r\n"
        f"Authorization: Bearer {bearer}\r\nAccept: text/event-stream\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.monotonic()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body)
            await writer.drain()
            status = (await reader.readline()).split(b" ")
            code = int(status[1]) if len(status) > 1 else 0
            chunked = False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                    chunked = True
            if code != 200:
                return time.monotonic() - start, f"http {code}"
            if not chunked:
                return time.monotonic() - start, "not chunked"
            async for event in read_chunked_events(reader):
                if event == "ready":
                    return time.monotonic() - start, None
                if event == "error":
                    return time.monotonic() - start, "sse error"
            return time.monotonic() - start, "stream ended before ready"
    except TimeoutError:
        return time.monotonic() - start, "timeout"
    except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
        return time.monotonic() - start, type(e).__name__
    finally:
        if writer is not None:
            writer.close()


async def user(i: int, gateway: str, bearer: str, t0: float, args, results: list) -> None:
    await asyncio.sleep(args.ramp * i / args.users)
    end = t0 + args.ramp + args.duration
    n = 0
    while time.monotonic() < end:
        started = time.monotonic()
        e2e, error = await scan(gateway, bearer, HINTS[(i + n) % len(HINTS)], args.timeout)
        n += 1
        if error is not None:
            await asyncio.sleep(1)  # as a browser's retry would, not at once
        # Counted: scans started after the ramp (the loop starts none after the window).
        if started >= t0 + args.ramp:
            results.append((e2e, error, time.monotonic()))


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


async def run(args, gateway: str, secret: str) -> list:
    results: list = []
    tokens = [token(secret, f"outside-{i}") for i in range(args.users)]
    t0 = time.monotonic()
    await asyncio.gather(*(user(i, gateway, tokens[i], t0, args, results)
                           for i in range(args.users)))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", required=True, help="the ecoscan binary (release)")
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--ramp", type=float, default=10.0, help="seconds to start every user")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds after the ramp")
    p.add_argument("--timeout", type=float, default=120.0, help="longest one scan may take")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.users + 256)), hard))

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        with open(Path(tmp) / "suite.log", "w") as log:
            proc, gateway, admin = start_suite(args.binary, data_dir, log)
            try:
                wait_ready(admin)
                secret = (data_dir / "token-secret").read_text().strip()
                stores = "production (REDIS_URL, DATABASE_URL, S3_*)" if os.environ.get(
                    "REDIS_URL") else "embedded"
                print(f"outside-scan-load: {args.users} users, ramp {args.ramp:.0f} s, "
                      f"{args.duration:.0f} s measured, mock 8 s a call, stores {stores}",
                      file=sys.stderr)
                started = time.time()
                results = asyncio.run(run(args, gateway, secret))
                elapsed = time.time() - started
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    ok = [e for e, err, _ in results if err is None]
    errors: dict[str, int] = {}
    for _, err, _ in results:
        if err is not None:
            errors[err] = errors.get(err, 0) + 1
    done = [at for _, err, at in results if err is None]
    rate = 0.0
    if len(done) > 1:
        rate = 60 * len(done) / (max(done) - min(done))
    p95 = percentile(ok, 95)
    print(f"| figure | measured | target |\n|---|---|---|")
    print(f"| success | {100 * len(ok) / max(1, len(results)):.1f} % ({len(ok)} of "
          f"{len(results)}) | 100 % |")
    print(f"| E2E p50 / p95 / p99 | {percentile(ok, 50):.2f} / **{p95:.2f}** / "
          f"{percentile(ok, 99):.2f} s | p95 ≤ {TARGET_P95_S} s "
          f"({'met' if p95 <= TARGET_P95_S else 'missed'}) |")
    print(f"| scans/min (first to last completion counted) | {rate:,.0f} | |")
    print(f"| errors | {errors or 'none'} | |")
    print(f"| run | {elapsed:.0f} s, load average after {os.getloadavg()} | |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
