"""Shared by the checks that drive `ecoscan up` from Python (edge_check.py, proxy_check.py):
start the suite and extra gateways on loopback ports of their own choosing, send requests on
fresh connections from a chosen loopback source address, record checks, stop everything.

Environment: CHECK_ECOSCAN (the suite binary), CHECK_WORK (a scratch directory) and
CHECK_NAME (the prefix of every printed line).
"""

import http.client
import os
import re
import socket
import subprocess
import threading
import time

ECOSCAN = os.environ["CHECK_ECOSCAN"]
WORK = os.environ["CHECK_WORK"]
NAME = os.environ.get("CHECK_NAME", "check")

children = []
failures = []

def say(msg):
    print(f"{NAME}: {msg}", flush=True)


def check(ok, what):
    if ok:
        say(f"ok   {what}")
    else:
        say(f"FAIL {what}")
        failures.append(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, headers=None, body=None, source="127.0.0.1", host=None,
            timeout=15, version=None):
    """One request on a fresh connection: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    if version == 10:
        conn._http_vsn, conn._http_vsn_str = 10, "HTTP/1.0"
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


# --- processes -------------------------------------------------------------------------------

def clean_env(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GATEWAY_", "ECOSCAN_", "INGEST_", "LLM_", "OTEL_", "REDIS_",
                                "S3_", "GRPC_TLS_"))
           and not k.endswith("_URL")}
    env.update({"RUST_LOG": "info", "LLM_PROVIDER": "mock", "LLM_MOCK_LATENCY": "100ms"})
    env.update(extra)
    return env


def start_up(extra):
    """`ecoscan up` on free loopback ports: (gateway port, service urls, token, log path)."""
    log = os.path.join(WORK, "up.log")
    out = os.path.join(WORK, "up.out")
    args = [ECOSCAN, "up", "--data-dir", os.path.join(WORK, "data"), "--host", "127.0.0.1"]
    for s in ["gateway", "ingest", "vision", "rule", "answer", "reward", "analytics",
              "notification"]:
        args += [f"--{s}-port", "0"]
    p = subprocess.Popen(args, env=clean_env(extra), stdin=subprocess.DEVNULL,
                         stdout=open(out, "w"), stderr=open(log, "w"))
    children.append(p)
    deadline = time.time() + 90
    while time.time() < deadline:
        text = open(out).read()
        if "ecoscan is up" in text and "Explore over gRPC" in text:
            addrs = dict(re.findall(r"^(\w+) +(?:http://)?(127\.0\.0\.1:\d+)", text, re.M))
            token = re.search(r"#access_token=(\S+)", text).group(1)
            port = int(addrs["gateway"].split(":")[1])
            wait_healthy(port)
            return port, addrs, token, log
        if p.poll() is not None:
            raise SystemExit(f"ecoscan up exited: {open(log).read()[-3000:]}")
        time.sleep(0.2)
    raise SystemExit("ecoscan up did not start in 90 s")


def wait_healthy(port):
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if request(port, "GET", "/healthz", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no /healthz on {port}")


def gateway_env(addrs, extra):
    env = {
        "GATEWAY_ADDR": "127.0.0.1:0",
        # Its own admin listener: `ecoscan up`'s holds the default port.
        "GATEWAY_ADMIN_ADDR": "127.0.0.1:0",
        "INGEST_URL": f"http://{addrs['ingest']}",
        "REWARD_URL": f"http://{addrs['reward']}",
        "ANALYTICS_URL": f"http://{addrs['analytics']}",
        "NOTIFICATION_URL": f"http://{addrs['notification']}",
        # ecoscan up's services believe identity signed with its data directory's key only.
        "ECOSCAN_IDENTITY_KEY": open(os.path.join(WORK, "data", "identity-key")).read().strip(),
    }
    env.update(extra)
    return env


def start_gateway(name, env):
    """`ecoscan serve gateway` with `env`: (port, log path)."""
    addr_file = os.path.join(WORK, f"{name}.addr")
    log = os.path.join(WORK, f"{name}.log")
    env = dict(env, ECOSCAN_ADDR_FILE=addr_file)
    p = subprocess.Popen([ECOSCAN, "serve", "gateway"], env=clean_env(env),
                         stdin=subprocess.DEVNULL, stdout=open(log, "w"),
                         stderr=subprocess.STDOUT)
    children.append(p)
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(addr_file):
            port = int(open(addr_file).read().rsplit(":", 1)[1])
            wait_healthy(port)
            return port, log
        if p.poll() is not None:
            raise SystemExit(f"gateway {name} exited: {open(log).read()[-3000:]}")
        time.sleep(0.1)
    raise SystemExit(f"gateway {name} did not start")


def refused_at_start(env, needle, what):
    p = subprocess.run([ECOSCAN, "serve", "gateway"], env=clean_env(env),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    check(p.returncode != 0 and needle in out, f"refused at start: {what}")


# --- the JWKS --------------------------------------------------------------------------------


class Fast:
    """An authenticated client asking every 100 ms in a thread; counts answers and failures."""

    def __init__(self, port, token):
        self.port, self.token = port, token
        self.ok = self.failed = 0
        self.errors = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            try:
                status, _, _ = request(self.port, "GET", "/api/v1/characters/me",
                                       bearer(self.token), timeout=10)
                if status == 200:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(status)
            except OSError as e:
                self.failed += 1
                self.errors.append(repr(e))
            time.sleep(0.1)

    def finish(self, what, at_least=3):
        """`at_least`: answers expected while `what` ran (a section of a fraction of a second
        sees one or two)."""
        self.stop.set()
        self.thread.join(30)
        check(self.failed == 0 and self.ok >= at_least,
              f"a fast authenticated client kept its answers during {what} "
              f"({self.ok} answered, {self.failed} failed {self.errors[:5]})")



def start_nginx(nginx, name, servers):
    """nginx (the binary `nginx`) in a directory of its own under WORK, in the foreground, with
    `servers` (the `upstream` and `server` blocks) inside its `http` block: the process."""
    root = os.path.join(WORK, name)
    os.makedirs(root, exist_ok=True)
    conf = f"""
worker_processes 1;
pid {root}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {root}/body; proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fastcgi; uwsgi_temp_path {root}/uwsgi; scgi_temp_path {root}/scgi;
{servers}
}}
"""
    with open(os.path.join(root, "nginx.conf"), "w") as f:
        f.write(conf)
    p = subprocess.Popen([nginx, "-p", root, "-c", os.path.join(root, "nginx.conf"), "-e",
                          "stderr", "-g", "daemon off;"], stdin=subprocess.DEVNULL,
                         stdout=open(os.path.join(WORK, f"{name}.log"), "w"),
                         stderr=subprocess.STDOUT)
    children.append(p)
    return p


def wait_listening(port, what):
    """Until something answers HTTP on `port` (any status), at most 20 s."""
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            request(port, "GET", "/healthz", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not listen on {port} in 20 s")


def stop_all():
    """Terminate every child started here (then kill what does not stop in 15 s)."""
    for p in children:
        if p.poll() is None:
            p.terminate()
    for p in children:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def report():
    """Print the failed checks and exit 1 if there are any."""
    if failures:
        say(f"{len(failures)} check(s) failed:")
        for f in failures:
            say(f"  {f}")
        raise SystemExit(1)
    say("every check passed")
