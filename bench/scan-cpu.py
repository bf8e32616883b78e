#!/usr/bin/env python3
"""CPU time per scan and peak memory of each service, each as its own process.

The sizing in k8s/README.md ("Sizing") comes from this: every service runs as its own
`ecoscan serve <service>` process (as in Kubernetes, one per pod) on the production stores
(Redis, PostgreSQL, and S3 when S3_ENDPOINT is set: a schema, key prefix and bucket of its
own), the mock model answers after a fixed latency, and CLIENTS concurrent clients run SCANS
scans through the gateway (`POST /api/v1/scan/completion`, the SSE stream read to `ready`).
Per process it reports, from /proc: CPU time (user + system) per scan over the measured scans
(after a warm-up), and the peak resident set (VmHWM).

CPU time per scan is what the sizing uses, not throughput: on a machine shared with other work
the wall-clock rate moves with the load, the CPU a scan costs much less.

    cargo build --release -p ecoscan
    python3 bench/scan-cpu.py --binary $CARGO_TARGET_DIR/release/ecoscan --scans 2000

Only the standard library; the load generator's own CPU is not counted (it is not a service).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

SERVICES = ["rule", "analytics", "reward", "notification", "vision", "answer", "ingest", "gateway"]
ADDR_VAR = {s: f"{s.upper()}_ADDR" for s in SERVICES}
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A 1x1 PNG; the mock model answers from the hint.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4"
    "890000000d49444154789c63f8cfc0f01f00050001ff89993d1d0000000049454e44ae426082")
HINTS = ["투명 페트병 pet bottle", "milk carton 우유팩", "can 캔", "glass bottle 유리병"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scan(url: str, token: str, i: int) -> bool:
    boundary = uuid.uuid4().hex
    hint = HINTS[i % len(HINTS)]
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"hint\"\r\n\r\n{hint}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
            f"filename=\"p{i}.png\"\r\nContent-Type: image/png\r\n\r\n").encode() + PNG \
        + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=120) as res:
        for line in res:
            if line.startswith(b"event: ready"):
                return True
            if line.startswith(b"event: error"):
                return False
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", required=True, help="the release `ecoscan` binary")
    ap.add_argument("--scans", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--model-latency", default="200ms")
    ap.add_argument("--database-url", default=os.environ.get(
        "TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--redis-url", default=os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379"))
    ap.add_argument("--s3-endpoint", default=os.environ.get("TEST_S3_ENDPOINT"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="scan-cpu-"))
    schema = f"cpu_{uuid.uuid4().hex[:12]}"
    subprocess.run(["psql", args.database_url, "-qc", f"CREATE SCHEMA {schema}"], check=True)
    sep = "&" if "?" in args.database_url else "?"
    db = f"{args.database_url}{sep}options[search_path]={schema}"
    secret = secrets.token_hex(32)
    (work / "data").mkdir()
    (work / "data/token-secret").write_text(secret)
    common = {
        "PATH": os.environ["PATH"], "RUST_LOG": "warn", "LLM_PROVIDER": "mock",
        "LLM_MOCK_LATENCY": args.model_latency, "ECOSCAN_STORES": "production",
        "REDIS_URL": args.redis_url, "INGEST_REDIS_PREFIX": f"{schema}:",
        "NOTIFICATION_REDIS_PREFIX": f"{schema}:", "DATABASE_URL": db,
    }
    if args.s3_endpoint:
        common.update(S3_ENDPOINT=args.s3_endpoint, S3_BUCKET=schema.replace("_", "-"),
                      S3_ACCESS_KEY_ID="test", S3_SECRET_ACCESS_KEY="test")
    else:
        common.update(INGEST_OBJECT_DIR=str(work / "objects"),
                      ANALYTICS_BODY_DIR=str(work / "bodies"), ECOSCAN_STORES="auto")
    procs: dict[str, subprocess.Popen] = {}
    addrs: dict[str, str] = {}
    try:
        for svc in SERVICES:
            env = dict(common)
            env[ADDR_VAR[svc]] = "127.0.0.1:0"
            env["ECOSCAN_ADDR_FILE"] = str(work / f"{svc}.addr")
            for dep, var in (("rule", "RULE_URL"), ("analytics", "ANALYTICS_URL"),
                             ("reward", "REWARD_URL"), ("notification", "NOTIFICATION_URL"),
                             ("vision", "VISION_URL"), ("answer", "ANSWER_URL"),
                             ("ingest", "INGEST_URL")):
                if dep in addrs and dep != svc:
                    env[var] = f"http://{addrs[dep]}"
            if svc == "gateway":
                env.update(GATEWAY_ADMIN_ADDR="127.0.0.1:0",
                           ECOSCAN_ADMIN_ADDR_FILE=str(work / "gateway.admin"),
                           GATEWAY_JWT_SECRET=secret, GATEWAY_JWT_ISSUER="ecoscan-local",
                           GATEWAY_JWT_AUDIENCE="ecoscan", GATEWAY_SCANS_PER_MINUTE="100000")
            log = open(work / f"{svc}.log", "w")
            procs[svc] = subprocess.Popen([args.binary, "serve", svc], env=env, cwd=work,
                                          stdout=log, stderr=log)
            deadline = time.time() + 60
            while not (work / f"{svc}.addr").exists():
                if procs[svc].poll() is not None or time.time() > deadline:
                    sys.exit(f"{svc} did not start:\n{(work / f'{svc}.log').read_text()}")
                time.sleep(0.05)
            addrs[svc] = (work / f"{svc}.addr").read_text().strip()
            # Listening is not serving: wait until it answers (its stores opened), since the
            # gateway's readiness does not wait on its backends.
            if svc != "gateway":
                while True:
                    try:
                        if urllib.request.urlopen(f"http://{addrs[svc]}/readyz",
                                                  timeout=2).status == 200:
                            break
                    except OSError:
                        pass
                    if procs[svc].poll() is not None or time.time() > deadline:
                        sys.exit(f"{svc} did not serve:\n{(work / f'{svc}.log').read_text()}")
                    time.sleep(0.05)
        admin = None
        while admin is None:
            if (work / "gateway.admin").exists():
                admin = (work / "gateway.admin").read_text().strip()
            time.sleep(0.05)
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"http://{admin}/readyz", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        token = subprocess.run([args.binary, "token", "--user", "cpu-bench", "--ttl", "2h",
                                "--data-dir", str(work / "data")], check=True,
                               capture_output=True, text=True).stdout.strip()
        url = f"http://{addrs['gateway']}/api/v1/scan/completion"

        def run(n: int, offset: int) -> tuple[int, float]:
            ok = 0
            started = time.time()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                for good in pool.map(lambda i: scan(url, token, offset + i), range(n)):
                    ok += good
            return ok, time.time() - started

        run(args.warmup, 0)
        before = {s: cpu_seconds(p.pid) for s, p in procs.items()}
        rss_samples = {s: 0.0 for s in procs}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                for s, p in procs.items():
                    rss_samples[s] = max(rss_samples[s], rss_mib(p.pid))
                stop.wait(0.5)

        t = threading.Thread(target=sample)
        t.start()
        load_before = os.getloadavg()
        ok, wall = run(args.scans, args.warmup)
        stop.set()
        t.join()
        after = {s: cpu_seconds(p.pid) for s, p in procs.items()}
        result = {
            "scans": args.scans, "succeeded": ok, "clients": args.clients,
            "model_latency": args.model_latency, "wall_s": round(wall, 1),
            "scans_per_s": round(args.scans / wall, 1),
            "load_before": [round(x, 1) for x in load_before], "load_after":
                [round(x, 1) for x in os.getloadavg()],
            "stores": "redis+postgres" + ("+s3" if args.s3_endpoint else "+local dirs"),
            "per_service": {s: {
                "cpu_ms_per_scan": round((after[s] - before[s]) * 1000 / max(ok, 1), 3),
                "cpu_cores_at_measured_rate": round((after[s] - before[s]) / wall, 3),
                "rss_max_during_run_mib": round(rss_samples[s], 1),
                "vmhwm_mib": round(peak_rss_mib(procs[s].pid), 1),
            } for s in procs},
        }
        print(json.dumps(result, indent=2))
        return 0 if ok == args.scans else 1
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run(["psql", args.database_url, "-qc", f"SET client_min_messages = warning; DROP SCHEMA {schema} CASCADE"],
                       check=False)


if __name__ == "__main__":
    sys.exit(main())
