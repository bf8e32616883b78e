// The demo page in headless Chromium, against a running `ecoscan up`. Run by infra/demo-check.sh,
// which starts the suite and passes, in the environment:
//   DEMO_GATEWAY     http://127.0.0.1:PORT
//   DEMO_TOKEN       the token `ecoscan up` printed (the page takes it from its URL's fragment)
//   DEMO_CHROMIUM    the browser (Debian's /usr/bin/chromium)
//   DEMO_PLAYWRIGHT  the playwright-core package directory
//   DEMO_JAEGER_URL  what GATEWAY_JAEGER_URL was set to
//   DEMO_WORK        a scratch directory
//   DEMO_SCREENSHOT  where to save the screenshot
import { createRequire } from "node:module";
import { writeFileSync } from "node:fs";
import { deflateSync } from "node:zlib";
import assert from "node:assert/strict";

const env = (name) => process.env[name] || (() => { throw new Error(`${name} is not set`); })();
const GATEWAY = env("DEMO_GATEWAY");
const TOKEN = env("DEMO_TOKEN");
const JAEGER = env("DEMO_JAEGER_URL");
const { chromium } = createRequire(import.meta.url)(env("DEMO_PLAYWRIGHT"));

const log = (msg) => console.log(`demo-check: ${msg}`);
const t0 = Date.now();
const step = (msg) => log(`[${((Date.now() - t0) / 1000).toFixed(1)}s] ${msg}`);

/** A real PNG: a 96×96 RGB gradient. */
function png() {
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (buf) => {
    let c = 0xffffffff;
    for (const b of buf) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  };
  const chunk = (type, data) => {
    const body = Buffer.concat([Buffer.from(type, "ascii"), data]);
    const out = Buffer.alloc(body.length + 8);
    out.writeUInt32BE(data.length, 0);
    body.copy(out, 4);
    out.writeUInt32BE(crc(body), body.length + 4);
    return out;
  };
  const w = 96, h = 96;
  const raw = Buffer.alloc((w * 3 + 1) * h);
  for (let y = 0; y < h; y++) {
    raw[y * (w * 3 + 1)] = 0;
    for (let x = 0; x < w; x++) {
      const i = y * (w * 3 + 1) + 1 + x * 3;
      raw[i] = 40 + x; raw[i + 1] = 120 + y; raw[i + 2] = 160;
    }
  }
  const ihdr = Buffer.alloc(13);
  ihdr.writeUInt32BE(w, 0); ihdr.writeUInt32BE(h, 4);
  ihdr.set([8, 2, 0, 0, 0], 8);
  return Buffer.concat([Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]),
    chunk("IHDR", ihdr), chunk("IDAT", deflateSync(raw)), chunk("IEND", Buffer.alloc(0))]);
}

const PHOTO = { name: "bottle.png", mimeType: "image/png", buffer: png() };
writeFileSync(`${env("DEMO_WORK")}/bottle.png`, PHOTO.buffer);

const browser = await chromium.launch({
  executablePath: env("DEMO_CHROMIUM"),
  headless: true,
  // --no-sandbox: CI containers run as root, where Chromium's sandbox cannot start.
  args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
});
const problems = [];
try {
  const context = await browser.newContext({ viewport: { width: 1000, height: 800 }, locale: "ko-KR" });
  // Loopback only: anything else is refused and fails the check.
  const gatewayOrigin = new URL(GATEWAY).origin;
  await context.route("**/*", (route) => {
    const url = route.request().url();
    if (new URL(url).origin === gatewayOrigin) return route.fallback();
    problems.push(`request outside the gateway: ${url}`);
    return route.abort("blockedbyclient");
  });
  const page = await context.newPage();
  page.setDefaultTimeout(20_000);
  page.on("pageerror", (err) => problems.push(`page error: ${err.message}`));

  await page.goto(`${GATEWAY}/?lang=ko#access_token=${TOKEN}`);
  assert.equal(await page.getAttribute("html", "lang"), "ko");
  assert.equal(await page.textContent("#submit"), "스캔하기");
  await page.waitForSelector("#notifications-state[data-state=live]");
  await page.waitForSelector("#collection-empty:not(.hidden)");
  step("page loaded in Korean; notifications stream live, empty collection");

  // The answer as it is drawn, to see it grow while the answer stage streams.
  await page.evaluate(() => {
    window.__answerFrames = [];
    new MutationObserver(() => window.__answerFrames.push({
      text: document.getElementById("answer").textContent,
      streaming: document.body.dataset.answerStreaming === "true",
    })).observe(document.getElementById("answer"), { childList: true, characterData: true, subtree: true });
  });

  // 1. A scan from the file picker to the rendered answer.
  const [chooser] = await Promise.all([page.waitForEvent("filechooser"), page.click("label.pick")]);
  await chooser.setFiles(PHOTO);
  await page.waitForSelector("#preview:not(.hidden)");
  await page.fill("#hint", "plastic bottle");
  await page.click("#submit");
  await page.waitForSelector("body[data-scan-state=done]", { timeout: 30_000 });
  const first = await scanState(page);
  assert.deepEqual(first.stages.map((s) => s.state), ["done", "done", "done", "done", "done"], "every stage done");
  assert.deepEqual(first.stages.map((s) => s.label), ["완료", "완료", "완료", "완료", "완료"]);
  for (const s of first.stages) assert.match(s.time, /^\d+(\.\d+)? (ms|s)$/, `a time for ${s.stage}`);
  assert.equal(first.percent, "100%");
  assert.match(first.answer, /mock/, "the mock answer rendered");
  assert.match(first.answer, /모의 응답/);
  const streamed = (await page.evaluate(() => window.__answerFrames)).filter((f) => f.streaming && f.text);
  assert.ok(streamed.some((f) => f.text.length < first.answer.length && first.answer.startsWith(f.text)),
    "part of the answer was on the page while it streamed");
  assert.match(first.classification, /PET/, "classification shown");
  assert.ok(first.ruleSteps > 0 && first.exclusions > 0, `rules laid out: ${first.ruleSteps} steps, ${first.exclusions} exclusions`);
  assert.equal(first.rewardNew, "true", "a new character");
  assert.equal(first.rewardName, "플리");
  assert.deepEqual(first.collection, [{ code: "char-plea", current: "true" }], "the collection holds it");
  assertEventLog(first.log, "first scan");
  assert.match(first.traceId, /^[0-9a-f]{32}$/, "trace id shown");
  assert.equal(first.traceHref, `${JAEGER}/trace/${first.traceId}`, "trace links to Jaeger");
  step(`scan ${first.jobId}: ${first.log.length} events, answer ${first.answer.length} chars, new character 플리`);

  // A notification arrives on the live stream (the scan's "ready" notice).
  await page.waitForSelector("#notifications li[data-source=stream][data-kind=scan_completed]");
  step("the scan's notification arrived live");

  // Both languages: the same scan, English labels.
  await page.click("button[data-lang=en]");
  assert.equal(await page.getAttribute("html", "lang"), "en");
  assert.equal(await page.textContent("#stages li[data-stage=vision] .state"), "done");
  assert.equal(await page.textContent("#reward .name"), "Plea");
  assert.match(await page.textContent("#progress-label"), /Scan complete/);
  step("switched to English");

  // 2. A dropped connection, resumed. The first events request gets the job's events cut off
  // in the middle of the frame after the first answer delta; the next request fails at the
  // connection; the one after goes through. The page must ask for exactly the events after the
  // last whole one it read, twice, and end with every event once.
  const eventsRequests = [];
  let cutAfter = null;
  await page.route("**/api/v1/scan/*/events", async (route) => {
    const n = eventsRequests.push(route.request().headers()["last-event-id"] ?? null);
    if (n === 1) {
      const whole = await (await route.fetch()).text();
      const frames = whole.split("\n\n");
      const firstDelta = frames.findIndex((f) => f.includes("event: delta"));
      assert.ok(firstDelta > 0, "the stream has answer deltas");
      const kept = frames.slice(0, firstDelta + 1);
      cutAfter = kept[kept.length - 1].match(/^id: (.*)$/m)[1];
      const next = frames[firstDelta + 1];
      const body = kept.join("\n\n") + "\n\n" + next.slice(0, Math.floor(next.length / 2));
      return route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body });
    }
    if (n === 2) return route.abort("connectionreset");
    return route.continue();
  });
  await page.click("#submit");
  await page.waitForSelector("body[data-scan-state=done]", { timeout: 30_000 });
  await page.unroute("**/api/v1/scan/*/events");
  const second = await scanState(page);
  assert.ok(eventsRequests.length >= 3, `three events requests (got ${eventsRequests.length})`);
  assert.equal(eventsRequests[0], null, "the first request starts at the beginning");
  assert.deepEqual(eventsRequests.slice(1, 3), [cutAfter, cutAfter], "resumed with Last-Event-ID");
  assertEventLog(second.log, "resumed scan");
  assert.ok(second.reconnects >= 2, "the page reconnected");
  assert.deepEqual(second.stages.map((s) => s.state), ["done", "done", "done", "done", "done"]);
  assert.match(second.answer, /\[mock answer\]/, "English mock answer");
  const result = await page.evaluate(
    async ([url, token]) => (await fetch(url, { headers: { Authorization: `Bearer ${token}` } })).json(),
    [second.resultUrl, TOKEN],
  );
  assert.equal(second.answer, result.answer.text, "the answer is the job's answer");
  assert.equal(second.rewardNew, "false", "the character is already owned");
  assert.match(await page.textContent("#reward .badge"), /Already in your collection/);
  assert.deepEqual(second.collection, [{ code: "char-plea", current: null }], "still one character");
  assert.notEqual(second.traceId, first.traceId);
  await page.waitForFunction(() =>
    document.querySelectorAll("#notifications li[data-kind=scan_completed]").length === 2);
  step(`dropped after ${cutAfter}, resumed twice; ${second.log.length} events, each once`);

  await page.screenshot({ path: env("DEMO_SCREENSHOT"), fullPage: true });
  step(`screenshot ${env("DEMO_SCREENSHOT")}`);

  // 3. An error the API returns, shown: a text file is not a photo (415).
  await page.setInputFiles("#image", { name: "notes.txt", mimeType: "text/plain", buffer: Buffer.from("not a photo\n") });
  await page.click("#submit");
  await page.waitForSelector("#error:not(.hidden)[data-status='415']");
  assert.equal(await page.getAttribute("#error", "data-code"), "UNSUPPORTED_MEDIA_TYPE");
  assert.match(await page.textContent("#error-title"), /not a photo/);
  assert.match(await page.textContent("#error-detail"), /415 UNSUPPORTED_MEDIA_TYPE .*JPEG, PNG, GIF or WebP/);
  assert.equal(await page.getAttribute("body", "data-scan-state"), "failed");
  await page.click("button[data-lang=ko]");
  assert.match(await page.textContent("#error-title"), /사진 파일이 아니에요/);
  step("a text file: 415 shown, in English and Korean");

  // 4. The event contract's harder turns, as the page follows them: a retried answer stage
  // (`restarted`: the first run's text is void), a resume at the final position after the
  // stream broke (the end again, at the id the page has: it must end, not loop), and a
  // `resync` (the page takes the job's state from its result). The gateway's stream is
  // replaced by one written here, for the job the page really submitted.
  await page.setInputFiles("#image", PHOTO);
  const frame = (event, id, data) => `event: ${event}\nid: ${id}\ndata: ${JSON.stringify(data)}\n\n`;
  let turn = 0;
  let releaseEnd;
  const endHeld = new Promise((resolve) => { releaseEnd = resolve; });
  const asked = [];
  await page.route("**/api/v1/scan/*/events", async (route) => {
    const job = new URL(route.request().url()).pathname.split("/")[4];
    asked.push(route.request().headers()["last-event-id"] ?? null);
    const ms = "1800000000000";
    const ev = (seq, stage, status, extra = {}) => ({
      event_id: `${ms}-${seq}`, job_id: job, seq, stage, status, progress: seq / 20, message: "",
      ts: new Date().toISOString(), trace_id: "", ...extra,
    });
    turn += 1;
    if (turn === 1) {
      const body = [
        frame("stage", `${ms}-1`, ev(1, "queued", "completed")),
        frame("stage", `${ms}-2`, ev(2, "answer", "started")),
        frame("delta", `${ms}-3`, ev(3, "answer", "delta", { delta: "void text ", offset: 0 })),
        frame("stage", `${ms}-4`, ev(4, "answer", "restarted")),
        frame("delta", `${ms}-5`, ev(5, "answer", "delta", { delta: "Good", offset: 0 })),
        frame("delta", `${ms}-6`, ev(6, "answer", "delta", { delta: " text", offset: 4 })),
      ].join("");
      // The stream breaks here (the body ends without the job's end): the page resumes.
      return route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body });
    }
    // The resume gets the job's end at the position it has already (as an end rebuilt from the
    // row may stand), once the test has looked at the streamed text.
    await endHeld;
    const body = frame("ready", `${ms}-6`, ev(6, "done", "completed", { result_url: `/api/v1/scan/${job}` }));
    return route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body });
  });
  await page.click("#submit");
  await page.waitForFunction(() => document.querySelector("#answer").textContent === "Good text");
  assert.ok(!(await page.textContent("#answer")).includes("void"), "the restarted run's text is gone");
  assert.match(await page.textContent("#log-list"), /restarted|다시/, "the restart is noted in the log");
  releaseEnd();
  await page.waitForSelector("body[data-scan-state=done]", { timeout: 30_000 });
  assert.deepEqual(asked, [null, "1800000000000-6"], "resumed once, at its last id");
  await page.waitForTimeout(1500);
  assert.equal(turn, 2, "no reconnect after the end, though it repeated the page's last id");
  step("a restarted answer shown as its second run; a resume at the final id ended the scan");
  await page.unroute("**/api/v1/scan/*/events");

  // A gap the log cannot fill: the page redraws the scan from its result and ends with it.
  await page.setInputFiles("#image", PHOTO);
  await page.route("**/api/v1/scan/*/events", async (route) => {
    const job = new URL(route.request().url()).pathname.split("/")[4];
    const ms = "1800000000000";
    const ev = (seq, stage, status, extra = {}) => ({
      event_id: `${ms}-${seq}`, job_id: job, seq, stage, status, progress: 0.5, message: "",
      ts: new Date().toISOString(), trace_id: "", ...extra,
    });
    const real = await (await route.fetch()).text();
    const ready = real.split("\n\n").find((f) => f.startsWith("event: ready"));
    assert.ok(ready, "the real stream ends with ready");
    const body = [
      frame("stage", `${ms}-1`, ev(1, "queued", "completed")),
      frame("delta", `${ms}-2`, ev(2, "answer", "delta", { delta: "a preview that was lost", offset: 0 })),
      frame("resync", `${ms}-30`, {
        job_id: job, reason: "events_lost", event_id: `${ms}-30`, seq: 30, after_event_id: `${ms}-2`,
        result_url: `/api/v1/scan/${job}`, message: "events after your position are no longer in the job's log",
      }),
    ].join("") + ready + "\n\n";
    return route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body });
  });
  await page.click("#submit");
  await page.waitForSelector("body[data-scan-state=done]", { timeout: 30_000 });
  await page.unroute("**/api/v1/scan/*/events");
  const resynced = await scanState(page);
  const stored = await page.evaluate(
    async ([url, token]) => (await fetch(url, { headers: { Authorization: `Bearer ${token}` } })).json(),
    [resynced.resultUrl, TOKEN],
  );
  await page.waitForFunction((text) => document.querySelector("#answer").textContent === text, stored.answer.text);
  assert.match(await page.textContent("#log-list"), /events_lost/, "the gap is noted in the log");
  step("a resync: the page took the job's state from its result");

  assert.deepEqual(problems, [], "no page errors, no traffic beyond the gateway");
  log(`ok in ${((Date.now() - t0) / 1000).toFixed(1)}s`);
} finally {
  await browser.close();
}

/** What the page shows about the current scan. */
function scanState(page) {
  return page.evaluate(() => {
    const $ = (s) => document.querySelector(s);
    const text = (s) => ($(s) ? $(s).textContent : null);
    return {
      jobId: text("#job-id"),
      stages: [...document.querySelectorAll("#stages li")].map((li) => ({
        stage: li.dataset.stage, state: li.dataset.state,
        label: li.querySelector(".state").textContent, time: li.querySelector(".time").textContent,
      })),
      percent: text("#progress-percent"),
      answer: text("#answer"),
      classification: text("#classification"),
      ruleSteps: document.querySelectorAll("#rules ol li").length,
      exclusions: document.querySelectorAll("#rules table tr").length,
      rewardNew: $("#reward").dataset.new,
      rewardName: text("#reward .name"),
      collection: [...document.querySelectorAll("#collection li")].map((li) => ({
        code: li.dataset.code, current: li.dataset.current ?? null,
      })),
      traceId: text("#trace-id"),
      traceHref: $("#trace-link").classList.contains("hidden") ? null : $("#trace-link").getAttribute("href"),
      reconnects: Number($("#connection").dataset.reconnects),
      resultUrl: $("#connection a") ? $("#connection a").getAttribute("href") : null,
      log: [...document.querySelectorAll("#log-list li[data-seq]")].map((li) => ({
        seq: Number(li.dataset.seq), id: li.dataset.id, dup: li.dataset.dup === "true",
      })),
    };
  });
}

/** Every event of the job exactly once, in order: seq 1..n without gaps or repeats. */
function assertEventLog(events, what) {
  assert.ok(events.length > 5, `${what}: events logged`);
  assert.deepEqual(events.filter((e) => e.dup), [], `${what}: no event twice`);
  assert.deepEqual(events.map((e) => e.seq), events.map((_, i) => i + 1), `${what}: no event missing`);
  assert.equal(new Set(events.map((e) => e.id)).size, events.length, `${what}: ids unique`);
}
