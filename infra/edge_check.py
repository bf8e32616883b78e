#!/usr/bin/env python3
"""The hostile edge: `ecoscan up` and a gateway on a JWKS, attacked with clients ecoscan did
not write, on loopback only. Run by infra/edge-check.sh (which installs what it needs).

- Identity at the edge, through a real same-host forwarding proxy (nginx): nobody gets an
  identity they did not prove, whatever headers they send; header mode refuses proxied,
  rebinding and HTTP/1.0 requests and never takes roles from a header.
- Tokens from PyJWT + cryptography against a JWKS served here (RS256 and ES256): every forgery
  refused, key rotation picked up within the refetch interval, a kid storm costing the provider
  a bounded number of fetches, no token text in the gateway's log; settings that fail open are
  refused at start.
- Raw sockets: 16,000 silent connections, idle HTTP/2 connections, slow headers, slow bodies,
  unauthenticated uploads, one address past its connection cap and its unauthenticated rate.

Throughout, a fast authenticated client keeps getting answers. Every wait is bounded; every
figure is printed. Environment: CHECK_ECOSCAN (the binary), CHECK_WORK (a scratch directory),
EDGE_NGINX (nginx).
"""

import http.client
import http.server
import json
import os
import random
import resource
import selectors
import socket
import string
import sys
import threading
import time

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from suiteproc import (  # noqa: E402  (the path above first)
    WORK, Fast, bearer, check, free_port, gateway_env, refused_at_start,
    report, request, say, start_gateway, start_nginx, start_up, stop_all, wait_listening,
)

NGINX = os.environ.get("EDGE_NGINX", "/usr/sbin/nginx")
ISSUER = "https://id.edge-check.test/"
AUDIENCE = "ecoscan-edge-check"
SILENT = int(os.environ.get("EDGE_SILENT_CONNECTIONS", "16000"))
# Connections one address may hold: the silent connections come from 64 addresses.
CAP = max(50, SILENT // 64 + 50)
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63f8cfc0f01f0005000101ff89993d1d0000000049454e44ae426082"
)


class Jwks:
    """A key set served on loopback, counting its fetches; the keys can be swapped."""

    def __init__(self):
        self.keys = []
        self.fetches = 0
        jwks = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                jwks.fetches += 1
                body = json.dumps({"keys": jwks.keys}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/jwks.json"


def jwk_of(private, kid, alg, use="sig"):
    pub = private.public_key()
    algo = RSAAlgorithm if alg.startswith("RS") else ECAlgorithm
    d = json.loads(algo.to_jwk(pub))
    d.update({"kid": kid, "alg": alg, "use": use})
    return d


def claims(sub="alice", **extra):
    now = int(time.time())
    c = {"sub": sub, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 600}
    c.update(extra)
    return {k: v for k, v in c.items() if v is not None}


def sign(private, alg, kid, c):
    return jwt.encode(c, private, algorithm=alg, headers={"kid": kid})


# --- the checks ------------------------------------------------------------------------------


def identity_through_a_proxy(up_port, up_token, addrs):
    say("-- identity at the edge, through nginx on the same host")
    fast = Fast(up_port, up_token)
    hdr_port, hdr_log = start_gateway("header-mode", gateway_env(addrs, {
        "GATEWAY_TRUST_USER_HEADER": "loopback",
        "GATEWAY_JWT_SECRET": open(os.path.join(WORK, "data", "token-secret")).read().strip(),
        "GATEWAY_JWT_ISSUER": "ecoscan-local", "GATEWAY_JWT_AUDIENCE": "ecoscan",
    }))
    plain, usual, plain_hdr = free_port(), free_port(), free_port()
    p = start_nginx(NGINX, "nginx", f"""
  # The shortest way to publish ecoscan up: nothing but proxy_pass.
  server {{ listen 127.0.0.1:{plain}; location / {{ proxy_pass http://127.0.0.1:{up_port}; }} }}
  # The usual way: the client's Host and address passed on.
  server {{ listen 127.0.0.1:{usual}; location / {{
    proxy_pass http://127.0.0.1:{hdr_port};
    proxy_set_header Host $host;
    proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
    proxy_set_header X-Real-IP $remote_addr; }} }}
  # Nothing but proxy_pass, in front of a gateway in header mode.
  server {{ listen 127.0.0.1:{plain_hdr}; location / {{ proxy_pass http://127.0.0.1:{hdr_port}; }} }}
""")
    wait_listening(plain, "nginx")

    mallory = {"X-User-Id": "mallory", "X-User-Roles": "admin"}
    for path in ["/api/v1/analytics/usage", "/api/v1/characters/me", "/api/v1/notifications"]:
        status, h, body = request(plain, "GET", path, mallory)
        check(status == 401 and "bearer" in h.get("www-authenticate", "").lower(),
              f"ecoscan up behind nginx: X-User-Id mallory + admin role on {path} -> {status}")
    status, _, _ = request(plain, "GET", "/api/v1/characters/me")
    check(status == 401, f"ecoscan up behind nginx: no credentials -> {status} (no anonymous user)")
    status, _, _ = request(plain, "GET", "/api/v1/characters/me", bearer(up_token))
    check(status == 200, f"ecoscan up behind nginx: the printed token -> {status}")
    status, _, _ = request(plain, "GET", "/api/v1/analytics/usage", bearer(up_token))
    check(status == 403, f"the printed token is no admin -> {status}")

    # Header mode, asked for: believed only from a direct local client naming the listener.
    status, _, body = request(hdr_port, "GET", "/api/v1/characters/me", {"X-User-Id": "ann"})
    check(status == 200, f"header mode, direct: X-User-Id ann -> {status}")
    status, _, _ = request(hdr_port, "GET", "/api/v1/analytics/usage",
                           {"X-User-Id": "ann", "X-User-Roles": "admin"})
    check(status == 403, f"header mode never takes roles from a header -> {status}")
    status, _, _ = request(usual, "GET", "/api/v1/characters/me", {"X-User-Id": "ann"},
                           host="scan.example.test")
    check(status == 401, f"header mode behind nginx (Host, X-Forwarded-For) -> {status}")
    status, _, _ = request(plain_hdr, "GET", "/api/v1/characters/me", {"X-User-Id": "ann"})
    check(status == 401, f"header mode behind a bare proxy_pass (HTTP/1.0 upstream) -> {status}")
    for name, kwargs in [
        ("a rebinding Host", {"host": f"evil.example.test:{hdr_port}"}),
        ("Host on another port", {"host": f"127.0.0.1:{hdr_port + 1}"}),
        ("X-Forwarded-For", {"headers": {"X-Forwarded-For": "203.0.113.5"}}),
        ("Forwarded", {"headers": {"Forwarded": "for=203.0.113.5"}}),
        ("HTTP/1.0", {"version": 10}),
    ]:
        headers = dict(kwargs.pop("headers", {}), **{"X-User-Id": "ann"})
        status, _, _ = request(hdr_port, "GET", "/api/v1/characters/me", headers, **kwargs)
        check(status == 401, f"header mode refuses {name} -> {status}")
    # Whatever came through, every answer carries the security headers.
    for port, path in [(plain, "/api/v1/characters/me"), (up_port, "/"),
                       (up_port, "/api/v1/openapi.json")]:
        _, h, _ = request(port, "GET", path)
        check(h.get("x-content-type-options") == "nosniff"
              and "frame-ancestors 'none'" in h.get("content-security-policy", "")
              and h.get("cache-control") == "no-store",
              f"security headers on {path}: {h.get('x-content-type-options')}, "
              f"{h.get('content-security-policy')}, {h.get('cache-control')}")
    p.terminate()
    p.wait(10)
    fast.finish("the identity checks through nginx")


def tokens_from_a_jwks(addrs):
    say("-- tokens from PyJWT + cryptography against a JWKS on loopback")
    jwks = Jwks()
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    other_rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    enc_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks.keys = [jwk_of(rsa_key, "rsa-1", "RS256"), jwk_of(ec_key, "ec-1", "ES256"),
                 jwk_of(enc_key, "enc-1", "RS256", use="enc")]
    base = {"GATEWAY_JWKS_URL": jwks.url, "GATEWAY_JWT_ISSUER": ISSUER,
            "GATEWAY_JWT_AUDIENCE": AUDIENCE, "GATEWAY_JWKS_MIN_REFRESH": "1s",
            "GATEWAY_JWKS_MAX_AGE": "1m"}

    # Settings that would fail open are refused before anything is served.
    env = gateway_env(addrs, base)
    refused_at_start(dict(env, GATEWAY_JWT_AUDIENCE=""), "GATEWAY_JWT_AUDIENCE",
                     "a JWKS without an audience")
    refused_at_start({k: v for k, v in env.items() if k != "GATEWAY_JWT_ISSUER"},
                     "GATEWAY_JWT_ISSUER", "a JWKS without an issuer")
    refused_at_start(dict(env, GATEWAY_JWKS_URL="http://id.edge-check.test/jwks.json"),
                     "https", "a plain-http JWKS beyond loopback")
    refused_at_start(gateway_env(addrs, {
        "GATEWAY_JWT_SECRET": "dev-only-secret-change-me-0123456789abcdef"}),
        "placeholder", "the old dev overlay's literal secret")
    refused_at_start(gateway_env(addrs, {}), "GATEWAY_JWT_SECRET", "no way to authenticate")

    port, log = start_gateway("jwks", env)
    fast = Fast(port, sign(rsa_key, "RS256", "rsa-1", claims("fast")))
    ok_rsa = sign(rsa_key, "RS256", "rsa-1", claims("alice"))
    ok_ec = sign(ec_key, "ES256", "ec-1", claims("bob"))
    for name, token in [("RS256", ok_rsa), ("ES256", ok_ec)]:
        status, _, _ = request(port, "GET", "/api/v1/characters/me", bearer(token))
        check(status == 200, f"a valid {name} token -> {status}")
    admin = sign(rsa_key, "RS256", "rsa-1", claims("ops", roles=["admin"]))
    status, _, _ = request(port, "GET", "/api/v1/analytics/usage", bearer(admin))
    check(status == 200, f"the admin claim -> {status}")

    pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    now = int(time.time())
    none_token = jwt.encode(claims(), None, algorithm="none")
    # PyJWT refuses to use a public key as an HMAC secret; the token is put together by hand.
    import base64
    import hashlib
    import hmac

    def b64(b):
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
    head = b64(json.dumps({"alg": "HS256", "kid": "rsa-1", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims()).encode())
    sig = b64(hmac.new(pem, f"{head}.{body}".encode(), hashlib.sha256).digest())
    hs_with_public = f"{head}.{body}.{sig}"
    bad = [
        ("alg none", none_token),
        ("HS256 signed with the public key", hs_with_public),
        ("expired", sign(rsa_key, "RS256", "rsa-1", claims(exp=now - 3600, iat=now - 7200,
                                                           nbf=now - 7200))),
        ("not yet valid", sign(rsa_key, "RS256", "rsa-1", claims(nbf=now + 3600))),
        ("wrong iss", sign(rsa_key, "RS256", "rsa-1", claims(iss="https://other.test/"))),
        ("wrong aud", sign(rsa_key, "RS256", "rsa-1", claims(aud="another-app"))),
        ("no exp", sign(rsa_key, "RS256", "rsa-1", claims(exp=None))),
        ("no sub", sign(rsa_key, "RS256", "rsa-1", claims(sub=None))),
        ("no aud", sign(rsa_key, "RS256", "rsa-1", claims(aud=None))),
        ("no iss", sign(rsa_key, "RS256", "rsa-1", claims(iss=None))),
        ("right kid, wrong key", sign(other_rsa, "RS256", "rsa-1", claims())),
        ("an RSA kid with ES256", sign(ec_key, "ES256", "rsa-1", claims())),
        ("a key whose use is enc", sign(enc_key, "RS256", "enc-1", claims())),
        ("RS512 on an RS256 key", jwt.encode(claims(), rsa_key, algorithm="RS512",
                                             headers={"kid": "rsa-1"})),
        ("no kid", jwt.encode(claims(), rsa_key, algorithm="RS256")),
    ]
    for name, token in bad:
        status, h, _ = request(port, "GET", "/api/v1/characters/me", bearer(token))
        check(status == 401, f"refused: {name} -> {status}")
    status, _, _ = request(port, "GET", f"/api/v1/notifications/stream?access_token={ok_rsa}")
    check(status == 401, f"a token in an SSE URL -> {status}")

    # A kid storm: 60 forged kids at once, then 200 more, while the fast client goes on.
    before = jwks.fetches
    started = time.time()
    results = []

    def forged(i):
        kid = "".join(random.choices(string.ascii_letters, k=12)) + str(i)
        t = sign(other_rsa, "RS256", kid, claims())
        try:
            results.append(request(port, "GET", "/api/v1/characters/me", bearer(t))[0])
        except OSError as e:
            results.append(repr(e))
    threads = [threading.Thread(target=forged, args=(i,)) for i in range(260)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    took = time.time() - started
    storm_fetches = jwks.fetches - before
    check(all(r == 401 for r in results) and len(results) == 260,
          f"260 forged kids: all 401 ({sorted(set(map(str, results)))})")
    bound = 2 + int(took / 1.0) + 1
    check(storm_fetches <= bound,
          f"the kid storm cost the provider {storm_fetches} fetches in {took:.1f} s "
          f"(at most one per GATEWAY_JWKS_MIN_REFRESH=1s: <= {bound})")

    # Rotation: the provider publishes a new key and signs with it at once.
    new_key = ec.generate_private_key(ec.SECP256R1())
    jwks.keys = [jwk_of(new_key, "ec-2", "ES256"), jwk_of(rsa_key, "rsa-1", "RS256")]
    rotated = sign(new_key, "ES256", "ec-2", claims("carol"))
    started = time.time()
    status = None
    while time.time() - started < 15:
        status = request(port, "GET", "/api/v1/characters/me", bearer(rotated))[0]
        if status == 200:
            break
        time.sleep(0.2)
    check(status == 200, f"a rotated-in key verified {time.time() - started:.1f} s after "
                         f"it was published (refetch interval 1 s, bound 15 s)")
    fast.finish("the kid storm and the rotation")

    logged = open(log).read()
    leaked = [name for name, token in bad + [("valid", ok_rsa), ("rotated", rotated)]
              if token and token.split(".")[-1] and token.split(".")[-1] in logged]
    check(not leaked, f"no token text in the gateway's log ({len(logged)} bytes; leaked: {leaked})")


def connections(up_port, token):
    say("-- raw sockets: silent, idle HTTP/2, slow, unauthenticated")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The whole count or a clear failure, never a quietly smaller test.
    if SILENT > hard - 2000:
        raise SystemExit(f"edge-check: {SILENT} silent connections need a file limit of "
                         f"{SILENT + 2000}; this machine allows {hard} (EDGE_SILENT_CONNECTIONS "
                         f"sets a smaller count)")
    silent = SILENT

    # Silent connections, from 64 loopback addresses (each under its per-address cap).
    fast = Fast(up_port, token)
    sel = selectors.DefaultSelector()
    socks = []
    started = time.time()
    for i in range(silent):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((f"127.0.1.{1 + i % 64}", 0))
        s.connect_ex(("127.0.0.1", up_port))
        socks.append(s)
        sel.register(s, selectors.EVENT_READ)
    opened = time.time() - started
    say(f"     {silent} silent connections opened in {opened:.1f} s")
    closed = 0
    deadline = time.time() + 60
    while closed < silent and time.time() < deadline:
        for key, _ in sel.select(timeout=1):
            s = key.fileobj
            try:
                data = s.recv(1)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                closed += 1
    took = time.time() - started
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    check(closed == silent, f"{closed} of {silent} silent connections closed by the gateway "
                            f"within {took:.1f} s (first-byte deadline 2 s; bound 60 s)")
    fast.finish(f"{silent} silent connections")

    # HTTP/2: the preface and an empty SETTINGS, then nothing (pings unanswered, no stream).
    fast = Fast(up_port, token)
    h2 = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", up_port), source_address=("127.0.2.1", 0))
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        s.setblocking(False)
        h2.append(s)
    started = time.time()
    open_h2 = set(h2)
    while open_h2 and time.time() - started < 40:
        r, _, _ = __import__("select").select(list(open_h2), [], [], 1)
        for s in r:
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        raise ConnectionError
            except BlockingIOError:
                continue
            except OSError:
                pass
            open_h2.discard(s)
            s.close()
    check(not open_h2, f"{200 - len(open_h2)} of 200 idle HTTP/2 connections closed within "
                       f"{time.time() - started:.1f} s (no whole request within the 3 s header "
                       f"timeout; bound 40 s)")
    for s in open_h2:
        s.close()
    fast.finish("200 idle HTTP/2 connections")

    # Slow headers and slow bodies, 50 each, a byte a second.
    fast = Fast(up_port, token)
    slow = []
    for i in range(100):
        s = socket.create_connection(("127.0.0.1", up_port), source_address=("127.0.3.1", 0))
        if i < 50:
            s.sendall(f"GET /api/v1/characters/me HTTP/1.1\r\nHost: 127.0.0.1:{up_port}\r\n"
                      .encode())
        else:
            s.sendall(f"POST /api/v1/scan HTTP/1.1\r\nHost: 127.0.0.1:{up_port}\r\n"
                      f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 1048576\r\n\r\n".encode())
        s.settimeout(0.01)
        slow.append([s, b"", None])
    started = time.time()
    while any(e[2] is None for e in slow) and time.time() - started < 60:
        for e in slow:
            if e[2] is not None:
                continue
            s = e[0]
            try:
                s.send(b"x" if slow.index(e) < 50 else b" ")
                data = s.recv(4096)
                if not data:
                    e[2] = time.time() - started
                e[1] += data
            except socket.timeout:
                pass
            except OSError:
                e[2] = time.time() - started
        time.sleep(1)
    heads = [e for e in slow[:50] if e[2] is not None]
    bodies = [e for e in slow[50:] if e[2] is not None]
    check(len(heads) == 50, f"{len(heads)} of 50 slow heads cut (header timeout 3 s; bound 60 s)")
    check(len(bodies) == 50 and all(e[1].startswith(b"HTTP/1.1 408") for e in bodies),
          f"{len(bodies)} of 50 slow bodies cut with 408 "
          f"({sorted(set(e[1][:12] for e in bodies))})")
    for e in slow:
        e[0].close()
    fast.finish("slow heads and bodies")

    # Unauthenticated uploads: refused from their headers, before a byte of body is read,
    # while a real upload goes through.
    fast = Fast(up_port, token)
    uploads = []
    for i in range(40):
        s = socket.create_connection(("127.0.0.1", up_port), source_address=("127.0.4.1", 0))
        s.sendall(f"POST /api/v1/scan HTTP/1.1\r\nHost: 127.0.0.1:{up_port}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 13000000\r\n\r\n".encode())
        s.settimeout(15)
        uploads.append(s)
    answers = []
    for s in uploads:
        try:
            answers.append(s.recv(4096)[:12])
        except OSError as e:
            answers.append(repr(e).encode())
        s.close()
    check(all(a == b"HTTP/1.1 401" for a in answers),
          f"40 unauthenticated 13 MB uploads answered 401 before sending a body "
          f"({sorted(set(answers))})")
    boundary = "edgecheck"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\""
            f"\r\nContent-Type: image/png\r\n\r\n").encode() + PNG + f"\r\n--{boundary}--\r\n".encode()
    status, _, body = request(up_port, "POST", "/api/v1/scan",
                              dict(bearer(token), **{"Content-Type":
                                                     f"multipart/form-data; boundary={boundary}"}),
                              form)
    check(status == 202, f"a real upload meanwhile -> {status} {body[:100]!r}")
    fast.finish("40 unauthenticated uploads", at_least=1)

    # One address: past its connection cap new connections are closed at once, unanswered,
    # however whole their request. The held ones are silent, so they must all be open when
    # the extra one asks: the first-byte deadline (2 s) would free their places after that.
    fast = Fast(up_port, token)
    held = []
    began = time.monotonic()
    for i in range(CAP):
        held.append(socket.create_connection(("127.0.0.1", up_port),
                                             source_address=("127.0.5.1", 0)))
    extra = socket.create_connection(("127.0.0.1", up_port), source_address=("127.0.5.1", 0))
    extra.settimeout(1.5)
    try:
        extra.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{up_port}\r\n\r\n".encode())
        first = extra.recv(64)
        verdict = "closed unanswered" if first == b"" else f"answered {first[:20]!r}"
    except socket.timeout:
        verdict = "still open after 1.5 s"
    except OSError:
        verdict = "closed unanswered"
    took = time.monotonic() - began
    check(verdict == "closed unanswered" and took < 2.0,
          f"connection {CAP + 1} of one address, with a whole request: {verdict} "
          f"({CAP} held for {took:.2f} s, under the 2 s first-byte deadline; cap {CAP})")
    other = request(up_port, "GET", "/api/v1/characters/me", bearer(token),
                    source="127.0.5.2")[0]
    check(other == 200, f"another address meanwhile -> {other}")
    for s in held + [extra]:
        s.close()
    fast.finish("one address at its connection cap", at_least=1)

    # One address: requests that prove nobody are limited (60/min here); its authenticated
    # requests are not.
    fast = Fast(up_port, token)
    statuses = [request(up_port, "GET", "/api/v1/characters/me", {"X-User-Id": f"u{i}"},
                        source="127.0.6.1")[0] for i in range(80)]
    check(statuses.count(429) >= 10 and set(statuses) <= {401, 429},
          f"80 unauthenticated requests from one address: {statuses.count(401)} x 401, "
          f"{statuses.count(429)} x 429 (60/min)")
    status = request(up_port, "GET", "/api/v1/characters/me", bearer(token),
                     source="127.0.6.1")[0]
    check(status == 200, f"the same address with a token -> {status}")
    fast.finish("an address past its unauthenticated rate", at_least=1)


def main():
    up_port, addrs, token, _ = start_up({
        "GATEWAY_FIRST_BYTE_TIMEOUT": "2s",
        "GATEWAY_IDLE_TIMEOUT": "3s",
        "GATEWAY_HEADER_TIMEOUT": "3s",
        "GATEWAY_H2_KEEPALIVE_INTERVAL": "2s",
        "GATEWAY_H2_KEEPALIVE_TIMEOUT": "2s",
        "GATEWAY_MAX_CONNECTIONS_PER_IP": str(CAP),
        "GATEWAY_UNAUTHENTICATED_PER_MINUTE": "60",
        "GATEWAY_BODY_MIN_RATE": "16384",
    })
    say(f"ecoscan up: gateway on {up_port}")
    try:
        identity_through_a_proxy(up_port, token, addrs)
        tokens_from_a_jwks(addrs)
        connections(up_port, token)
    finally:
        stop_all()
    report()


if __name__ == "__main__":
    main()
