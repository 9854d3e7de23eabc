// specserve web UI: chat through the server's own /v1/chat/completions stream and colour every token by where
// it came from (stream_options.include_spec_info: delta.spec_tokens / delta.spec_accepted). No dependencies.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "specserve-api-key";
  const st = { history: [], controller: null, model: null };

  // -- API key (only asked for when the server answers 401) ------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY) || "";
  let keyPromise = null;

  function askKey() {
    if (keyPromise) return keyPromise;
    keyPromise = new Promise((resolve) => {
      const dlg = $("key-dialog");
      $("key-input").value = apiKey();
      dlg.onclose = () => {
        keyPromise = null;
        resolve(dlg.returnValue === "save");
      };
      dlg.returnValue = "";
      dlg.showModal();
      $("key-input").focus();
    });
    return keyPromise;
  }
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-dialog").close("save");
  });
  $("key-cancel").onclick = () => $("key-dialog").close("");
  $("set-key").onclick = async () => { if (await askKey()) init(); };

  async function api(path, init = {}, prompt = true) {
    for (let attempt = 0; ; attempt++) {
      const headers = Object.assign({}, init.headers || {});
      if (apiKey()) headers.Authorization = "Bearer " + apiKey();
      const r = await fetch(path, Object.assign({}, init, { headers }));
      if (r.status !== 401 || !prompt || attempt >= 3 || !(await askKey())) return r;
    }
  }

  // -- messages --------------------------------------------------------------------------------------------
  function addMessage(role, text) {
    $("empty")?.remove();
    const el = document.createElement("div");
    el.className = "msg " + role;
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    el.append(body, meta);
    $("messages").append(el);
    scroll(true);
    return { el, body, meta };
  }

  function scroll(force) {
    const m = $("messages");
    if (force || m.scrollHeight - m.scrollTop - m.clientHeight < 80) m.scrollTop = m.scrollHeight;
  }

  function appendPieces(view, texts, flags) {
    const frag = document.createDocumentFragment();
    texts.forEach((text, i) => {
      if (!text) return; // EOS, or a byte-level token whose character completes in the next one
      const span = document.createElement("span");
      span.className = "tok " + (flags[i] ? "tok-accepted" : "tok-target");
      span.title = flags[i] ? "accepted draft token" : "target token";
      span.textContent = text;
      frag.append(span);
    });
    view.body.append(frag);
  }

  // -- this answer's numbers -------------------------------------------------------------------------------
  const fmt = (x, d = 1) => (x == null || !isFinite(x) ? "–" : x.toFixed(d));
  const pct = (x) => (x == null || !isFinite(x) ? "–" : (100 * x).toFixed(1) + "%");

  function answerNumbers(a) {
    const now = a.end || performance.now();
    const tokens = a.usage ? a.usage.completion_tokens : a.tokens;
    const spec = a.usage && a.usage.speculative;
    const secs = a.first ? (now - a.first) / 1000 : 0;
    return {
      tokens,
      tps: a.first && secs > 0.05 ? Math.max(tokens - 1, 0) / secs : null,
      ttft: a.first ? (a.first - a.start) / 1000 : null,
      share: a.tokens ? a.accepted / a.tokens : null,
      // While streaming: tokens per target-produced token (each verification step yields exactly one).
      rate: spec ? (spec.draft_tokens ? spec.acceptance_rate : null) : null,
      mal: spec ? spec.mean_acceptance_length : (a.tokens > a.accepted ? a.tokens / (a.tokens - a.accepted) : null),
      live: !spec,
    };
  }

  function showAnswer(a) {
    const n = answerNumbers(a);
    $("ans-tokens").textContent = n.tokens;
    $("ans-tps").textContent = fmt(n.tps);
    $("ans-ttft").textContent = n.ttft == null ? "–" : fmt(n.ttft, 2) + " s";
    $("ans-accepted").textContent = `${a.accepted} (${pct(n.share)})`;
    $("ans-rate").textContent = n.live ? (a.end ? "–" : "…") : pct(n.rate); // usage comes with the last chunk
    $("ans-mal").textContent = (n.live && n.mal != null ? "≈ " : "") + fmt(n.mal, 2);
    $("ans-bar").style.width = n.share == null ? "0" : (100 * n.share).toFixed(1) + "%";
  }

  // -- since start ----------------------------------------------------------------------------------------
  async function refreshStats() {
    try {
      const r = await api("v1/specserve/stats", {}, false);
      if (!r.ok) return;
      const s = await r.json();
      const sp = s.speculative;
      $("all-tokens").textContent = s.generation_tokens;
      $("all-drafts").textContent = sp.draft_tokens;
      $("all-accepted").textContent = sp.accepted_tokens;
      $("all-rate").textContent = sp.draft_tokens ? pct(sp.acceptance_rate) : "–";
      $("all-mal").textContent = fmt(sp.mean_acceptance_length, 2);
      $("all-running").textContent = `${s.num_requests_running} / ${s.num_requests_waiting}`;
      $("all-kv").textContent = pct(s.kv_cache_usage);
    } catch (e) { /* server restarting: keep the old numbers */ }
  }

  // -- chatting -------------------------------------------------------------------------------------------
  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.dataset.state = busy ? "streaming" : "idle";
  }

  function onChunk(chunk, view, a) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) a.usage = chunk.usage;
    for (const c of chunk.choices || []) {
      if (c.index !== 0) continue;
      const d = c.delta || {};
      const text = d.content || "";
      if (text && !a.first) a.first = performance.now();
      if (Array.isArray(d.spec_tokens)) {
        appendPieces(view, d.spec_tokens, d.spec_accepted);
        a.tokens += d.spec_accepted.length;
        a.accepted += d.spec_accepted.filter(Boolean).length;
      } else if (text) {
        view.body.append(text);
        a.tokens += 1;
      }
      a.content += text;
      if (c.finish_reason) a.finish = c.finish_reason;
    }
    scroll(false);
  }

  async function send(text) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...st.history, { role: "user", content: text });
    addMessage("user", text);
    st.history.push({ role: "user", content: text });
    const view = addMessage("assistant", "");
    view.el.classList.add("streaming");
    const a = { start: performance.now(), first: null, end: null, tokens: 0, accepted: 0, content: "",
                usage: null, finish: null, stopped: false, error: null };
    const ctl = new AbortController();
    st.controller = ctl;
    setBusy(true);
    showAnswer(a);
    const ticker = setInterval(() => showAnswer(a), 250);
    try {
      const body = {
        messages, stream: true, stream_options: { include_usage: true, include_spec_info: true },
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) || 256,
        speculative: $("speculative").checked,
      };
      if (st.model) body.model = st.model;
      const r = await api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: ctl.signal,
      });
      if (!r.ok) {
        const err = await r.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
      }
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, i);
          buf = buf.slice(i + 2);
          for (const line of event.split("\n")) {
            if (line.startsWith("data: ") && line !== "data: [DONE]") onChunk(JSON.parse(line.slice(6)), view, a);
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") a.stopped = true;
      else a.error = e.message;
    } finally {
      clearInterval(ticker);
      a.end = performance.now();
      st.controller = null;
      view.el.classList.remove("streaming");
      if (a.content) st.history.push({ role: "assistant", content: a.content });
      if (a.error) {
        view.el.classList.add("error");
        view.body.append((a.content ? "\n" : "") + "Error: " + a.error);
      }
      showAnswer(a);
      const n = answerNumbers(a);
      const parts = [`${n.tokens} tokens`, `${fmt(n.tps)} tok/s`];
      if (n.share != null) parts.push(`${pct(n.share)} accepted drafts`);
      if (n.rate != null) parts.push(`acceptance ${pct(n.rate)}`);
      if (a.finish) parts.push(a.finish);
      view.meta.textContent = parts.join(" · ");
      if (a.stopped) {
        const s = document.createElement("span");
        s.className = "stopped";
        s.textContent = " · stopped";
        view.meta.append(s);
      }
      view.el.dataset.done = a.stopped ? "stopped" : a.error ? "error" : "finished";
      setBusy(false);
      refreshStats();
      setTimeout(refreshStats, 600); // an abort is processed by the engine loop a step later
    }
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || st.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").onclick = () => st.controller && st.controller.abort();
  $("new-chat").onclick = () => {
    if (st.controller) st.controller.abort();
    st.history = [];
    $("messages").replaceChildren();
    $("prompt").focus();
  };
  const temp = $("temperature");
  temp.oninput = () => { $("temperature-out").textContent = Number(temp.value).toFixed(2); };
  temp.oninput();
  const colour = $("colour");
  colour.onchange = () => $("messages").classList.toggle("colour", colour.checked);
  colour.onchange();

  async function init() {
    try {
      const r = await api("v1/models");
      if (!r.ok) throw new Error(r.status === 401 ? "API key needed" : `HTTP ${r.status}`);
      const card = (await r.json()).data[0];
      st.model = card.id;
      $("model").textContent = card.id + (card.max_model_len ? ` · ${card.max_model_len} ctx` : "");
      $("model").classList.remove("error");
    } catch (e) {
      $("model").textContent = "not connected: " + e.message;
      $("model").classList.add("error");
    }
    refreshStats();
  }

  setBusy(false);
  init();
  setInterval(refreshStats, 3000);
})();
