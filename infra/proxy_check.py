#!/usr/bin/env python3
"""The gateway behind the proxies operators put in front of it: Debian's HAProxy and nginx,
run here on loopback with the configurations docs/proxies.md gives, and `ecoscan up` behind
them. Run by infra/proxy-check.sh (which installs what it needs).

- SSE undelayed: every event of a scan read through each proxy and directly at once; through
  the proxy it arrives a few ms after the direct copy, far below the ~200 ms Nagle stall of a
  HAProxy without `option http-no-delay` (measured here too, for comparison, never asserted).
- A proxy timeout shorter than a quiet stream: the gateway's keepalive comment
  (GATEWAY_SSE_KEEPALIVE) keeps the stream open through it.
- Trusted proxies (GATEWAY_TRUSTED_PROXIES): clients from different addresses behind one proxy
  get a per-IP unauthenticated budget each; more clients than the per-IP connection cap stream
  at once through one proxy; a client that is no proxy cannot choose its address with
  X-Forwarded-For. The same through HAProxy's PROXY protocol v2 (GATEWAY_PROXY_PROTOCOL=v2),
  where a trusted peer without the header is closed.
- Header mode `loopback` behind HAProxy running as another user: a forged `Host` and
  `X-User-Id` get 401.

The client addresses are 127.0.0.0/8 source addresses; the proxies connect from addresses of
their own (127.0.0.9 and 127.0.0.10), which the gateway is told to trust. Every wait is bounded;
every figure is printed. Environment: CHECK_ECOSCAN, CHECK_WORK (see lib/suiteproc.py),
PROXY_HAPROXY, PROXY_NGINX.
"""

import http.client
import os
import statistics
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from suiteproc import (  # noqa: E402  (the path above first)
    WORK, bearer, check, children, free_port, gateway_env, report, request, say, start_gateway,
    start_nginx, start_up, stop_all, wait_listening,
)

HAPROXY = os.environ.get("PROXY_HAPROXY", "/usr/sbin/haproxy")
NGINX = os.environ.get("PROXY_NGINX", "/usr/sbin/nginx")
HAPROXY_FROM = "127.0.0.9"
NGINX_FROM = "127.0.0.10"
UNAUTHENTICATED_PER_MINUTE = 20
CAP = 30
KEEPALIVE_S = 1
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63f8cfc0f01f0005000101ff89993d1d0000000049454e44ae426082"
)


# --- the proxies -----------------------------------------------------------------------------

def haproxy_config(listen, backend, *, no_delay=True, server_options="proto h2",
                   timeout="60s", user=None):
    """The configuration docs/proxies.md gives (with `no_delay`, the defaults of the test)."""
    return f"""
global
  maxconn 4096
  {f"user {user}" if user else ""}
  {"group nogroup" if user else ""}
defaults
  mode http
  {"option http-no-delay" if no_delay else ""}
  option forwardfor
  timeout connect 5s
  timeout client {timeout}
  timeout server {timeout}
  timeout http-keep-alive 10s
frontend web
  bind 127.0.0.1:{listen}
  default_backend gateway
backend gateway
  server gw 127.0.0.1:{backend} {server_options} source {HAPROXY_FROM}
"""


def start_haproxy(name, config):
    path = os.path.join(WORK, f"{name}.cfg")
    with open(path, "w") as f:
        f.write(config)
    log = os.path.join(WORK, f"{name}.log")
    p = subprocess.Popen([HAPROXY, "-db", "-f", path], stdin=subprocess.DEVNULL,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    children.append(p)
    return p, log


def start_proxy_nginx(name, listen, backend):
    """nginx with the settings docs/proxies.md gives for SSE."""
    start_nginx(NGINX, name, f"""
  upstream gateway {{ server 127.0.0.1:{backend}; keepalive 16; }}
  server {{
    listen 127.0.0.1:{listen};
    location / {{
      proxy_pass http://gateway;
      proxy_bind {NGINX_FROM};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_buffering off;
      proxy_read_timeout 60s;
    }}
  }}""")


# --- scans and streams -----------------------------------------------------------------------

def submit(port, token):
    boundary = "proxycheck"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\""
            f"\r\nContent-Type: image/png\r\n\r\n").encode() + PNG + \
        f"\r\n--{boundary}--\r\n".encode()
    status, h, body = request(port, "POST", "/api/v1/scan",
                              dict(bearer(token), **{"Content-Type":
                                                     f"multipart/form-data; boundary={boundary}"}),
                              form)
    if status != 202:
        raise SystemExit(f"submitting a scan answered {status}: {body[:300]!r}")
    return h["location"].rsplit("/", 1)[1]


class Stream:
    """An SSE response read line by line in a thread: when each event id arrived, its name,
    how many keepalive comments came, and how it ended."""

    def __init__(self, port, path, headers, source="127.0.0.1"):
        self.arrived = {}
        self.names = []
        self.keepalives = 0
        self.status = None
        self.ended = None
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                               source_address=(source, 0))
        self.conn.request("GET", path, headers=dict(headers, Accept="text/event-stream"))
        self.res = self.conn.getresponse()
        self.status = self.res.status
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        name = None
        try:
            while True:
                line = self.res.readline()
                now = time.monotonic()
                if not line:
                    self.ended = "eof"
                    return
                line = line.decode().rstrip("\r\n")
                if line.startswith(":"):
                    self.keepalives += 1
                elif line.startswith("event:"):
                    name = line[6:].strip()
                    self.names.append(name)
                elif line.startswith("id:"):
                    self.arrived[line[3:].strip()] = now
        except (OSError, ValueError, AttributeError, http.client.HTTPException) as e:
            # (`close()` from the main thread leaves http.client without its file: the
            # AttributeError and ValueError of a read after it.)
            self.ended = repr(e)

    def wait(self, seconds):
        self.thread.join(seconds)
        return not self.thread.is_alive()

    def close(self):
        self.conn.close()


def event_delays(direct_port, proxy_port, token, scans=2):
    """Delays (ms) of each event through the proxy behind the same event read directly."""
    delays = []
    for _ in range(scans):
        job = submit(direct_port, token)
        path = f"/api/v1/scan/{job}/events"
        direct = Stream(direct_port, path, bearer(token))
        proxied = Stream(proxy_port, path, bearer(token), source="127.0.0.2")
        ok = direct.wait(60) and proxied.wait(60)
        if not ok or direct.status != 200 or proxied.status != 200:
            raise SystemExit(f"scan {job}: streams {direct.status}/{proxied.status} did not end "
                             f"in 60 s ({direct.ended}, {proxied.ended})")
        for event_id, at in proxied.arrived.items():
            if event_id in direct.arrived:
                delays.append((at - direct.arrived[event_id]) * 1000)
        check("ready" in proxied.names, f"scan {job} through the proxy reached `ready` "
              f"({len(proxied.arrived)} events)")
    return delays


def figures(delays):
    delays = sorted(delays)
    return (statistics.median(delays), delays[int(len(delays) * 0.9)], delays[-1])


# --- the checks ------------------------------------------------------------------------------

def undelayed(up_port, token):
    say("-- SSE through HAProxy and nginx: undelayed, kept open by the keepalive")
    ha_port, ng_port, bare_port = free_port(), free_port(), free_port()
    start_haproxy("haproxy", haproxy_config(ha_port, up_port))
    start_proxy_nginx("nginx", ng_port, up_port)
    # For comparison only: HAProxy's defaults, HTTP/1.1 to the gateway, Nagle left on.
    start_haproxy("haproxy-bare", haproxy_config(bare_port, up_port, no_delay=False,
                                                 server_options=""))
    for port, what in [(ha_port, "haproxy"), (ng_port, "nginx"), (bare_port, "haproxy-bare")]:
        wait_listening(port, what)
    for port, what in [(ha_port, "HAProxy (http-no-delay, h2 to the gateway)"),
                       (ng_port, "nginx (proxy_buffering off, HTTP/1.1 kept alive)")]:
        delays = event_delays(up_port, port, token)
        median, p90, worst = figures(delays)
        say(f"{what}: {len(delays)} events, behind the direct copy by median {median:.1f} ms, "
            f"p90 {p90:.1f} ms, max {worst:.1f} ms")
        check(len(delays) >= 10 and median < 50 and p90 < 150,
              f"{what}: events arrive within a few ms of direct (median {median:.1f} ms "
              f"< 50, p90 {p90:.1f} ms < 150; the stall is ~200 ms)")
    median, p90, worst = figures(event_delays(up_port, bare_port, token))
    say(f"for comparison, HAProxy without http-no-delay: median {median:.1f} ms, "
        f"p90 {p90:.1f} ms, max {worst:.1f} ms behind")

    # A proxy whose timeouts (3 s) are shorter than a quiet stream: the keepalive (1 s) keeps
    # the notification stream, silent otherwise, open through it.
    short = free_port()
    start_haproxy("haproxy-short", haproxy_config(short, up_port, timeout="3s"))
    wait_listening(short, "haproxy-short")
    stream = Stream(short, "/api/v1/notifications/stream", bearer(token), source="127.0.0.3")
    ended = stream.wait(8)
    check(stream.status == 200 and not ended and stream.keepalives >= 4,
          f"a quiet stream through a 3 s proxy timeout stays open 8 s on the {KEEPALIVE_S} s "
          f"keepalive ({stream.status}, {stream.keepalives} keepalives, ended: {stream.ended})")
    stream.close()


def per_client_limits(name, port, extra_source):
    """Client A spends its unauthenticated budget; B behind the same proxy keeps its own."""
    a, b = f"127.0.{extra_source}.2", f"127.0.{extra_source}.3"
    statuses = [request(port, "GET", "/api/v1/characters/me", source=a)[0]
                for _ in range(UNAUTHENTICATED_PER_MINUTE + 5)]
    check(statuses[0] == 401 and statuses[-1] == 429,
          f"{name}: client {a} past its {UNAUTHENTICATED_PER_MINUTE} unauthenticated "
          f"requests a minute -> {statuses[0]} … {statuses[-1]}")
    status = request(port, "GET", "/api/v1/characters/me", source=b)[0]
    check(status == 401, f"{name}: client {b} behind the same proxy keeps its own budget -> "
          f"{status} (not 429)")


def trusted_proxies(up_port, token, addrs):
    say("-- trusted proxies: the client's address, from X-Forwarded-For and PROXY v2")
    ha_port, ng_port = free_port(), free_port()
    start_haproxy("haproxy-limits", haproxy_config(ha_port, up_port))
    start_proxy_nginx("nginx-limits", ng_port, up_port)
    wait_listening(ha_port, "haproxy")
    wait_listening(ng_port, "nginx")
    per_client_limits("through HAProxy", ha_port, 1)
    per_client_limits("through nginx", ng_port, 2)

    # No proxy: whatever X-Forwarded-For it sends, a client is its own address.
    c = "127.0.3.2"
    statuses = [request(up_port, "GET", "/api/v1/characters/me",
                        {"X-Forwarded-For": f"127.0.3.{100 + i}"}, source=c)[0]
                for i in range(UNAUTHENTICATED_PER_MINUTE + 5)]
    check(statuses[-1] == 429, f"a direct client {c} forging X-Forwarded-For is still itself "
          f"-> {statuses[-1]} at the end")

    # More clients than the per-IP cap through one proxy (nginx opens a connection to the
    # gateway per stream), each holding an open stream.
    streams = [Stream(ng_port, "/api/v1/notifications/stream", bearer(token),
                      source=f"127.0.4.{i + 1}") for i in range(CAP + 5)]
    time.sleep(2)
    open_ok = sum(1 for s in streams if s.status == 200 and s.ended is None)
    check(open_ok == CAP + 5, f"{CAP + 5} clients stream at once through one nginx past the "
          f"per-IP cap of {CAP}: {open_ok} open")
    for s in streams:
        s.close()

    # PROXY protocol v2: a gateway of its own, HAProxy sending the header.
    secret = open(os.path.join(WORK, "data", "token-secret")).read().strip()
    v2_port, _ = start_gateway("proxy-v2", gateway_env(addrs, {
        "GATEWAY_PROXY_PROTOCOL": "v2",
        "GATEWAY_TRUSTED_PROXIES": f"{HAPROXY_FROM},{NGINX_FROM}",
        "GATEWAY_UNAUTHENTICATED_PER_MINUTE": str(UNAUTHENTICATED_PER_MINUTE),
        "GATEWAY_JWT_SECRET": secret,
        "GATEWAY_JWT_ISSUER": "ecoscan-local", "GATEWAY_JWT_AUDIENCE": "ecoscan",
    }))
    hv2 = free_port()
    start_haproxy("haproxy-v2", haproxy_config(hv2, v2_port, server_options="send-proxy-v2"))
    wait_listening(hv2, "haproxy-v2")
    per_client_limits("through HAProxy with PROXY v2", hv2, 5)
    status = request(hv2, "GET", "/api/v1/characters/me", bearer(token), source="127.0.5.9")[0]
    check(status == 200, f"through HAProxy with PROXY v2: the printed token -> {status}")
    status = request(v2_port, "GET", "/healthz")[0]
    check(status == 200, f"PROXY v2 gateway: a direct client that is no proxy -> {status}")
    # A trusted proxy's connection without the header: closed, nothing answered.
    with socket.create_connection(("127.0.0.1", v2_port), timeout=10,
                                  source_address=(HAPROXY_FROM, 0)) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{v2_port}\r\n\r\n".encode())
        try:
            answer = s.recv(64)
        except ConnectionResetError:
            answer = b""
    check(answer == b"", f"PROXY v2 gateway: a trusted proxy's connection without the header "
          f"is closed unanswered ({answer!r})")


def header_mode(addrs):
    say("-- header mode `loopback` behind HAProxy running as nobody")
    if os.geteuid() != 0:
        check(False, "header mode behind HAProxy as another user needs root (to start "
              "HAProxy as nobody); run the test command as root")
        return
    secret = open(os.path.join(WORK, "data", "token-secret")).read().strip()
    hdr_port, _ = start_gateway("header-mode", gateway_env(addrs, {
        "GATEWAY_TRUST_USER_HEADER": "loopback",
        "GATEWAY_JWT_SECRET": secret,
        "GATEWAY_JWT_ISSUER": "ecoscan-local", "GATEWAY_JWT_AUDIENCE": "ecoscan",
    }))
    status = request(hdr_port, "GET", "/api/v1/characters/me", {"X-User-Id": "victim"})[0]
    check(status == 200, f"header mode, a direct client of the gateway's own user -> {status}")
    port = free_port()
    # HAProxy's defaults pass the client's Host on; this one adds no X-Forwarded-For either,
    # so only the peer socket's owner tells it from a local client.
    config = haproxy_config(port, hdr_port, server_options="", user="nobody")
    start_haproxy("haproxy-nobody", config.replace("option forwardfor", ""))
    wait_listening(port, "haproxy-nobody")
    for host in [f"127.0.0.1:{hdr_port}", f"localhost:{hdr_port}"]:
        status = request(port, "GET", "/api/v1/characters/me", {"X-User-Id": "victim"},
                         host=host)[0]
        check(status == 401, f"header mode behind HAProxy: Host {host} + X-User-Id victim "
              f"-> {status}")


def main():
    up_port, addrs, token, _ = start_up({
        "GATEWAY_TRUSTED_PROXIES": f"{HAPROXY_FROM},{NGINX_FROM}",
        "GATEWAY_UNAUTHENTICATED_PER_MINUTE": str(UNAUTHENTICATED_PER_MINUTE),
        "GATEWAY_MAX_CONNECTIONS_PER_IP": str(CAP),
        "GATEWAY_SSE_KEEPALIVE": f"{KEEPALIVE_S}s",
        # Stages a second apart: events spread over several seconds, as a person sees them.
        "LLM_MOCK_LATENCY": "1s",
    })
    say(f"ecoscan up: gateway on {up_port}")
    try:
        undelayed(up_port, token)
        trusted_proxies(up_port, token, addrs)
        header_mode(addrs)
    finally:
        stop_all()
    report()


if __name__ == "__main__":
    main()
