// specstream playground: a chat over /v1/chat/completions (streamed, SSE over fetch) that
// colours every reply by how its tokens arrived, plus live charts from /metrics.
//
// Model and user text only ever reaches the page through textContent (never parsed as HTML),
// and the page's Content-Security-Policy allows no inline script.
//
// How a reply is coloured: each streamed chunk is one speculative round and carries
// choices[0].speculative = {drafted, accepted, tokens}; its tokens arrive in order, the
// accepted drafts first, then the target's own token(s). The page asks for logprobs, whose
// entries carry each token's raw bytes; it decodes them as a stream of UTF-8 (as the server's
// detokenizer does), labels each character "draft" or "target" by the token that completed
// it, and splits the chunk's text exactly along those labels. When a chunk's text is not the
// next run of decoded characters (no logprobs, or text that differs from the token bytes, e.g.
// a tokenizer that cleans up spaces), that chunk is shown in one colour mixed by its
// accepted / tokens share (the "mixed" legend entry), and matching starts afresh after it.
"use strict";

(() => {
  const KEY_STORAGE = "specstream-api-key";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const METRICS_PERIOD_MS = 1000;
  const TPS_WINDOW = 60;
  const MAX_POSITIONS_SHOWN = 16;

  const $ = (id) => document.getElementById(id);
  const history = []; // [{role, content}] of finished turns, sent with every request
  let model = null;
  let serverMethod = "off";
  let controller = null; // AbortController of the reply being streamed
  let conversation = 0; // bumped by "Clear chat", so a reply stopped by it is not kept

  // ------------------------------------------------------------------ server access
  function apiKey() {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  }

  function authHeaders() {
    const key = apiKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (_) {
      // not JSON: fall through to the status line
    }
    return `${response.status} ${response.statusText}`;
  }

  function setStatus(text, kind) {
    const el = $("server-status");
    el.textContent = text;
    el.className = `status ${kind || ""}`;
  }

  async function loadServerInfo() {
    const response = await fetch("/playground/server.json");
    if (!response.ok) return;
    serverMethod = (await response.json()).speculative_method;
    const select = $("spec-method");
    select.replaceChildren();
    for (const method of serverMethod === "off" ? ["off"] : [serverMethod, "off"]) {
      const option = document.createElement("option");
      option.value = method;
      option.textContent = method;
      select.append(option);
    }
    $("legend-draft").textContent = serverMethod === "off"
      ? "accepted draft token (this server does not speculate)"
      : `accepted draft token (proposed by ${serverMethod})`;
  }

  async function loadModel() {
    model = null;
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders() });
    } catch (err) {
      setStatus(`cannot reach the server: ${err.message}`, "bad");
      return;
    }
    if (response.status === 401) {
      setStatus("this server needs an API key: enter it under Settings", "bad");
      return;
    }
    if (!response.ok) {
      setStatus(`models: ${await errorMessage(response)}`, "bad");
      return;
    }
    const body = await response.json();
    model = body.data && body.data.length ? body.data[0].id : null;
    if (model) setStatus(`model ${model} · speculation ${serverMethod}`, "ok");
    else setStatus("the server lists no model", "bad");
  }

  // ------------------------------------------------------------------ SSE over fetch
  // Calls onData(parsed JSON) for each `data:` event until [DONE] or the end of the body.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (!data.length) continue; // a comment such as the keep-alive ping
        const text = data.join("\n");
        if (text === "[DONE]") return;
        onData(JSON.parse(text));
      }
    }
  }

  // ------------------------------------------------------------------ one reply
  class ReplyView {
    constructor(item) {
      this.text = document.createElement("div");
      this.text.className = "text";
      this.stats = document.createElement("p");
      this.stats.className = "stats";
      item.append(this.text, this.stats);
      this.content = "";
      this.decoder = new TextDecoder(); // streaming, like the server's incremental detokenizer
      this.chars = []; // characters decoded from token bytes, not yet matched to text
      this.labels = []; // "draft" or "target", one per entry of chars
      this.rounds = 0;
      this.drafted = 0;
      this.accepted = 0;
      this.tokens = 0;
      this.sent = performance.now();
      this.first = null; // [time, tokens] of the first round with tokens
      this.last = null;
      this.mixedRounds = 0;
      this.outcome = "streaming";
    }

    addChoice(choice) {
      const spec = choice.speculative || null;
      if (spec && spec.tokens > 0) this.countRound(spec);
      const tokens = choice.logprobs && choice.logprobs.content;
      if (tokens) this.labelTokens(tokens, spec);
      const text = choice.delta && choice.delta.content;
      if (text) this.render(text, spec, Boolean(tokens));
      if (choice.finish_reason) this.outcome = choice.finish_reason;
      this.showStats();
    }

    countRound(spec) {
      const now = performance.now();
      this.rounds += 1;
      this.drafted += spec.drafted;
      this.accepted += spec.accepted;
      this.tokens += spec.tokens;
      if (!this.first) this.first = [now, spec.tokens];
      this.last = now;
    }

    // The round's tokens in order: its accepted drafts first, then the target's own.
    labelTokens(tokens, spec) {
      const accepted = spec ? Math.min(spec.accepted, tokens.length) : 0;
      tokens.forEach((token, i) => {
        const label = i < accepted ? "draft" : "target";
        for (const ch of this.decoder.decode(new Uint8Array(token.bytes || []), { stream: true })) {
          this.chars.push(ch);
          this.labels.push(label);
        }
      });
    }

    // Appends one chunk's text: split exactly by label when it is the next run of decoded
    // token characters, else in one colour mixed by the round's accepted share.
    render(text, spec, withTokens) {
      this.content += text;
      const round = document.createElement("span");
      round.className = "round";
      if (spec) round.title = `round: ${spec.drafted} drafted, ${spec.accepted} accepted, ${spec.tokens} tokens`;
      const chars = Array.from(text);
      if (withTokens && chars.length <= this.chars.length && chars.every((ch, i) => ch === this.chars[i])) {
        this.appendRuns(round, chars);
      } else {
        this.decoder = new TextDecoder(); // start matching afresh with the next round
        this.chars = [];
        this.labels = [];
        this.mixedRounds += 1;
        const span = document.createElement("span");
        span.className = "tok-mixed";
        const share = spec && spec.tokens ? Math.min(spec.accepted, spec.tokens) / spec.tokens : 0;
        span.style.setProperty("--share", share.toFixed(3));
        span.textContent = text;
        round.append(span);
      }
      this.text.append(round);
    }

    appendRuns(round, chars) {
      let start = 0;
      for (let i = 1; i <= chars.length; i += 1) {
        if (i < chars.length && this.labels[i] === this.labels[start]) continue;
        const span = document.createElement("span");
        span.className = `tok-${this.labels[start]}`;
        span.textContent = chars.slice(start, i).join("");
        round.append(span);
        start = i;
      }
      this.chars.splice(0, chars.length);
      this.labels.splice(0, chars.length);
    }

    showStats() {
      const parts = [`${this.tokens} tokens`];
      if (this.first) {
        const [firstTime, firstTokens] = this.first;
        const seconds = (this.last - firstTime) / 1000;
        // Generation speed after the first round, so the prompt's prefill is not in it.
        const rate = seconds > 0
          ? (this.tokens - firstTokens) / seconds
          : this.tokens / ((this.last - this.sent) / 1000);
        parts.push(`${rate.toFixed(1)} tok/s`, `first token ${Math.round(firstTime - this.sent)} ms`);
        parts.push(`${(this.accepted / this.rounds).toFixed(2)} accepted/round over ${this.rounds} rounds`);
        if (this.drafted) parts.push(`${Math.round((100 * this.accepted) / this.drafted)}% of drafts accepted`);
      }
      if (this.mixedRounds) parts.push(`${this.mixedRounds} rounds coloured by share`);
      parts.push(this.outcome);
      this.stats.textContent = parts.join(" · ");
    }

    fail(message) {
      this.outcome = "error";
      const error = document.createElement("p");
      error.className = "error";
      error.textContent = message;
      this.text.after(error);
      this.showStats();
    }
  }

  // ------------------------------------------------------------------ the chat
  function addTurn(role, text) {
    const item = document.createElement("li");
    item.className = `turn ${role}`;
    const who = document.createElement("p");
    who.className = "who";
    who.textContent = role;
    item.append(who);
    if (text !== undefined) {
      const body = document.createElement("div");
      body.className = "text";
      body.textContent = text;
      item.append(body);
    }
    $("transcript").append(item);
    return item;
  }

  function numberField(id) {
    const value = $(id).value.trim();
    return value === "" ? null : Number(value);
  }

  function requestBody(messages) {
    const body = { model, messages, stream: true, logprobs: true };
    const temperature = numberField("temperature");
    const maxTokens = numberField("max-tokens");
    const k = numberField("spec-k");
    if (temperature !== null) body.temperature = temperature;
    if (maxTokens !== null) body.max_tokens = maxTokens;
    if ($("ignore-eos").checked) body.ignore_eos = true;
    const method = $("spec-method").value;
    if (method === "off") {
      if (serverMethod !== "off") body.speculative = "off";
    } else {
      body.speculative = k === null ? { method } : { method, num_speculative_tokens: k };
    }
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  // Follows the reply as it grows, unless the reader has scrolled up.
  function follow(item) {
    const nearBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 80;
    if (nearBottom) item.scrollIntoView({ block: "end" });
  }

  async function send(text) {
    if (!model) await loadModel();
    if (!model) {
      $("prompt").value = text; // keep the message; the status line says what is missing
      return;
    }
    const turn = conversation;
    const system = $("system").value.trim();
    const messages = [...history, { role: "user", content: text }];
    if (system) messages.unshift({ role: "system", content: system });
    addTurn("user", text);
    const item = addTurn("assistant");
    const reply = new ReplyView(item);
    controller = new AbortController();
    setBusy(true);
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(requestBody(messages)),
        signal: controller.signal,
      });
      if (!response.ok) {
        reply.fail(await errorMessage(response));
        return;
      }
      await readEvents(response, (event) => {
        if (event.error) throw new Error(event.error.message);
        for (const choice of event.choices || []) reply.addChoice(choice);
        follow(item);
      });
      if (reply.outcome === "streaming") reply.fail("the stream ended before the reply finished");
    } catch (err) {
      if (err.name === "AbortError") {
        reply.outcome = "stopped";
        reply.showStats();
      } else {
        reply.fail(err.message);
      }
    } finally {
      controller = null;
      setBusy(false);
    }
    if (reply.outcome !== "error" && turn === conversation) {
      history.push({ role: "user", content: text }, { role: "assistant", content: reply.content });
    }
  }

  // ------------------------------------------------------------------ /metrics
  // Prometheus text format: `name{label="v",...} value` per line; # lines are comments.
  function parseMetrics(text) {
    const samples = new Map();
    for (const line of text.split("\n")) {
      const m = /^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const pair of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
      if (!samples.has(m[1])) samples.set(m[1], []);
      samples.get(m[1]).push({ labels, value: Number(m[3]) });
    }
    return samples;
  }

  const metricValue = (samples, name) => ((samples.get(name) || [])[0] || { value: 0 }).value;

  function svgElement(tag, attributes, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attributes)) el.setAttribute(k, String(v));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function drawAcceptance(svg, rates) {
    svg.replaceChildren();
    if (!rates.length) {
      svg.append(svgElement("text", { x: 150, y: 60, "text-anchor": "middle", class: "empty" }, "no drafts yet"));
      return;
    }
    const width = 280 / rates.length;
    rates.forEach((rate, i) => {
      const h = 90 * rate;
      const x = 10 + i * width + 1;
      const bar = svgElement("rect", { x, y: 100 - h, width: Math.max(width - 2, 1), height: h, class: "bar" });
      bar.append(svgElement("title", {}, `position ${i + 1}: ${(100 * rate).toFixed(1)}%`));
      const middle = 10 + (i + 0.5) * width;
      svg.append(bar, svgElement("text", { x: middle, y: 114, "text-anchor": "middle" }, i + 1));
      if (width >= 16) {
        const y = Math.max(100 - h - 2, 18);
        svg.append(svgElement("text", { x: middle, y, "text-anchor": "middle" }, `${Math.round(100 * rate)}%`));
      }
    });
    svg.append(svgElement("line", { x1: 10, y1: 100, x2: 290, y2: 100, class: "axis" }));
    svg.append(svgElement("text", { x: 12, y: 9 }, "100%"));
  }

  function drawTokensPerSecond(svg, series) {
    svg.replaceChildren();
    const top = Math.max(1, ...series);
    const points = series.map((v, i) => `${10 + (280 * i) / (TPS_WINDOW - 1)},${80 - (70 * v) / top}`);
    svg.append(svgElement("line", { x1: 10, y1: 80, x2: 290, y2: 80, class: "axis" }));
    if (points.length > 1) svg.append(svgElement("polyline", { points: points.join(" "), class: "line" }));
    const now = series.length ? series[series.length - 1] : 0;
    svg.append(svgElement("text", { x: 12, y: 9 }, `${top.toFixed(0)} tok/s max · now ${now.toFixed(1)}`));
  }

  function startMetrics() {
    const series = [];
    let previous = null; // [time, generation tokens]
    let inFlight = false;
    const poll = async () => {
      if (inFlight || document.hidden) return;
      inFlight = true;
      try {
        const response = await fetch("/metrics", { headers: authHeaders() });
        if (!response.ok) {
          $("metrics-status").textContent = `metrics: ${await errorMessage(response)}`;
          return;
        }
        const samples = parseMetrics(await response.text());
        const drafts = metricValue(samples, "specstream_spec_decode_num_drafts_total");
        const rates = [];
        for (const s of samples.get("specstream_spec_decode_num_accepted_tokens_per_pos_total") || []) {
          const pos = Number(s.labels.position);
          if (pos < MAX_POSITIONS_SHOWN && drafts > 0) rates[pos] = s.value / drafts;
        }
        drawAcceptance($("chart-acceptance"), Array.from(rates, (r) => r || 0));
        const now = performance.now();
        const generated = metricValue(samples, "specstream_generation_tokens_total");
        if (previous) series.push(Math.max(0, (generated - previous[1]) / ((now - previous[0]) / 1000)));
        previous = [now, generated];
        if (series.length > TPS_WINDOW) series.shift();
        drawTokensPerSecond($("chart-tps"), series);
        const running = metricValue(samples, "specstream_num_requests_running");
        const waiting = metricValue(samples, "specstream_num_requests_waiting");
        const kv = metricValue(samples, "specstream_kv_cache_usage_perc");
        const load = `running ${running} · waiting ${waiting} · KV cache ${(100 * kv).toFixed(1)}%`;
        $("metrics-status").textContent = load;
      } catch (err) {
        $("metrics-status").textContent = `metrics: ${err.message}`;
      } finally {
        inFlight = false;
      }
    };
    poll();
    setInterval(poll, METRICS_PERIOD_MS);
  }

  // ------------------------------------------------------------------ wiring
  function init() {
    const keyField = $("api-key");
    keyField.value = apiKey();
    keyField.addEventListener("change", () => {
      sessionStorage.setItem(KEY_STORAGE, keyField.value.trim());
      loadModel();
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      conversation += 1;
      history.length = 0;
      $("transcript").replaceChildren();
    });
    loadServerInfo().finally(loadModel);
    startMetrics();
  }

  init();
})();
