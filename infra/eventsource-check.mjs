// Chromium's own EventSource against a running `ecoscan up`, cut mid-stream. Run by
// infra/demo-check.sh after the demo page's checks, with the same suite and environment
// (DEMO_GATEWAY, DEMO_TOKEN, DEMO_CHROMIUM, DEMO_PLAYWRIGHT).
//
// The page is opened through a TCP forwarder on loopback that this script controls, so the
// stream's connection can be cut the way a network cuts it (the browser sees the socket close,
// no HTTP answer). For each way a browser can authenticate a stream — a ticket bound at its
// first use, a ticket bound to the stream at issue, the token cookie — the EventSource must:
// reconnect by itself with Last-Event-ID, get every event once and in order up to `ready`,
// then on its reconnect after the end get 204 and stop for good (readyState CLOSED, no further
// request). The page's own code is not used: this is the bare EventSource any app would open.
import { createRequire } from "node:module";
import net from "node:net";
import assert from "node:assert/strict";

const env = (name) => process.env[name] || (() => { throw new Error(`${name} is not set`); })();
const GATEWAY = new URL(env("DEMO_GATEWAY"));
const TOKEN = env("DEMO_TOKEN");
const { chromium } = createRequire(import.meta.url)(env("DEMO_PLAYWRIGHT"));

const log = (msg) => console.log(`eventsource-check: ${msg}`);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A forwarder to the gateway: counts the requests and answers it carries; `cut()` drops every
 *  open connection at once. */
function forwarder() {
  const sockets = new Set();
  const seen = { requests: [], answers: [] };
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(GATEWAY.port), GATEWAY.hostname);
    sockets.add(client).add(upstream);
    client.on("data", (b) => {
      for (const m of b.toString("latin1").matchAll(/^(GET|POST) (\S+) HTTP\/1\.1\r$/gm)) {
        seen.requests.push(`${m[1]} ${m[2]}`);
      }
      upstream.write(b);
    });
    upstream.on("data", (b) => {
      for (const m of b.toString("latin1").matchAll(/^HTTP\/1\.1 (\d{3})/gm)) seen.answers.push(Number(m[1]));
      client.write(b);
    });
    const close = () => { client.destroy(); upstream.destroy(); sockets.delete(client); sockets.delete(upstream); };
    client.on("close", close).on("error", close);
    upstream.on("close", close).on("error", close);
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({
    port: server.address().port,
    seen,
    cut() { for (const s of sockets) s.destroy(); sockets.clear(); },
    close() { this.cut(); server.close(); },
  })));
}

async function api(method, path, body, headers = {}) {
  const res = await fetch(new URL(path, GATEWAY), {
    method, body, headers: { authorization: `Bearer ${TOKEN}`, ...headers },
  });
  const text = await res.text();
  assert.ok(res.ok, `${method} ${path} -> ${res.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

async function submit() {
  // A 1×1 PNG; the mock model takes its configured time per stage, so the stream lasts seconds.
  const png = Buffer.from("89504e470d0a1a0a0000000d4948445200000001000000010806000000" +
    "1f15c4890000000d49444154789c63f8cfc0f01f0005000101ff89993d1d0000000049454e44ae426082", "hex");
  const form = new FormData();
  form.append("image", new Blob([png], { type: "image/png" }), "a.png");
  return (await api("POST", "/api/v1/scan", form)).job_id;
}

/** Opens a bare EventSource on `url` in the page and records what it sees. */
async function open(page, url) {
  await page.evaluate((url) => {
    const rec = { events: [], errors: 0, opens: 0 };
    window.__es = { rec, es: new EventSource(url) };
    const es = window.__es.es;
    es.onopen = () => { rec.opens += 1; };
    es.onerror = () => { rec.errors += 1; };
    for (const name of ["stage", "delta", "ready", "error", "resync"]) {
      // A failed connection fires a plain `error` Event too; the scan's `error` is a message.
      es.addEventListener(name, (e) => {
        if (e instanceof MessageEvent) rec.events.push({ name, id: e.lastEventId });
      });
    }
  }, url);
}

const state = (page) => page.evaluate(() => ({ ...window.__es.rec, readyState: window.__es.es.readyState }));

async function until(page, what, pred, ms) {
  const deadline = Date.now() + ms;
  for (;;) {
    const s = await state(page);
    if (pred(s)) return s;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms / 1000} s (${JSON.stringify(s)})`);
    await sleep(100);
  }
}

async function variant(browser, name, prepare) {
  const fwd = await forwarder();
  const origin = `http://127.0.0.1:${fwd.port}`;
  const context = await browser.newContext({ bypassCSP: true });
  const page = await context.newPage();
  try {
    await page.goto(`${origin}/healthz`);
    const job = await submit();
    const path = `/api/v1/scan/${job}/events`;
    const url = await prepare(page, path, origin);
    await open(page, url);
    await until(page, `${name}: two events`, (s) => s.events.length >= 2, 30_000);
    fwd.cut();
    log(`${name}: cut the stream's connection after ${(await state(page)).events.length} events`);
    const end = await until(page, `${name}: ready after the cut`,
      (s) => s.events.some((e) => e.name === "ready"), 90_000);
    // The stream ends after `ready`; the EventSource reconnects once (its retry delay, 3 s by
    // default) with the last id, gets 204, and stops.
    const closed = await until(page, `${name}: closed by the 204`, (s) => s.readyState === 2, 15_000);
    const requests = fwd.seen.requests.filter((r) => r.startsWith(`GET ${path}`)).length;
    await sleep(7_000);
    const later = fwd.seen.requests.filter((r) => r.startsWith(`GET ${path}`)).length;
    const ids = end.events.map((e) => e.id);
    assert.deepEqual(ids, [...new Set(ids)], `${name}: an event came twice: ${ids}`);
    for (let i = 1; i < ids.length; i++) {
      assert.ok(cmpId(ids[i - 1], ids[i]) < 0, `${name}: events out of order: ${ids}`);
    }
    assert.equal(end.events.at(-1).name, "ready", `${name}: ready is the last event`);
    assert.ok(closed.opens >= 2, `${name}: the EventSource reconnected by itself (${closed.opens} opens)`);
    assert.equal(fwd.seen.answers.at(-1), 204, `${name}: the reconnect after the end got 204 (${fwd.seen.answers})`);
    assert.equal(later, requests, `${name}: no request after the 204 (${requests} then ${later})`);
    log(`ok   ${name}: ${closed.opens} opens, ${ids.length} events once each to ready, ` +
      `answers ${fwd.seen.answers.join(",")}, then closed (readyState 2, no request in 7 s)`);
  } finally {
    await context.close();
    fwd.close();
  }
}

/** Event ids are `<stream position>` numbers or `<n>-<m>` pairs: compare numerically. */
function cmpId(a, b) {
  const pa = a.split(/[-:]/).map(Number), pb = b.split(/[-:]/).map(Number);
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const d = (pa[i] ?? 0) - (pb[i] ?? 0);
    if (d) return d;
  }
  return 0;
}

const browser = await chromium.launch({ executablePath: env("DEMO_CHROMIUM"), args: ["--no-sandbox"] });
try {
  await variant(browser, "ticket bound at first use", async (_page, path) => {
    const { ticket } = await api("POST", "/api/v1/sse-tickets");
    return `${path}?ticket=${encodeURIComponent(ticket)}`;
  });
  await variant(browser, "ticket bound at issue", async (_page, path) => {
    const { ticket, stream } = await api("POST", `/api/v1/sse-tickets?stream=${encodeURIComponent(path)}`);
    assert.equal(stream, path);
    return `${path}?ticket=${encodeURIComponent(ticket)}`;
  });
  await variant(browser, "token cookie", async (page, path) => {
    await page.evaluate((t) => { document.cookie = `ecoscan_token=${t}; path=/; SameSite=Strict`; }, TOKEN);
    return path;
  });
} finally {
  await browser.close();
}
log("every check passed");
