// The server panel: `GET /strata/slots` polled about twice a second, drawn as totals and one row per slot.

import { getJSON } from "./api.js";

const POLL_MS = 500;
// After a refusal or an unreachable server, ask less often (each failed fetch is a console line).
const RETRY_MS = 4000;

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function bar(fraction, label, title) {
  const wrap = element("div", "bar");
  const fill = element("div", "fill");
  const f = Number.isFinite(fraction) ? Math.min(Math.max(fraction, 0), 1) : 0;
  fill.style.width = `${(100 * f).toFixed(1)}%`;
  wrap.append(fill, element("span", "bar-label", label));
  if (title) wrap.title = title;
  return wrap;
}

function stat(name, value, title) {
  const box = element("div", "stat");
  box.dataset.stat = name;
  box.append(element("span", "stat-value", value), element("span", "stat-name", name));
  if (title) box.title = title;
  return box;
}

function num(x) {
  return typeof x === "number" && Number.isFinite(x) ? x : 0;
}

function rate(x) {
  return num(x).toFixed(1);
}

function duration(seconds) {
  const s = Math.floor(num(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function shortId(id) {
  return id.length > 22 ? `${id.slice(0, 21)}…` : id;
}

function slotRow(slot) {
  const state = String(slot.state || "idle");
  const row = element("div", "slot");
  row.dataset.state = state;
  row.dataset.slot = String(slot.id);

  const head = element("div", "slot-head");
  head.append(element("span", "slot-id", `#${slot.id}`), element("span", `state ${state}`, state));
  const request = element("span", "request", slot.request_id ? shortId(String(slot.request_id)) : "—");
  if (slot.request_id) request.title = String(slot.request_id);
  head.append(request, element("span", "rate", state === "idle" ? "" : `${rate(slot.tokens_per_s)} tok/s`));

  const detail = element("div", "slot-detail");
  const read = num(slot.prompt_read);
  const prompt = num(slot.prompt_tokens);
  detail.append(bar(prompt ? read / prompt : 0, state === "idle" ? "read" : `read ${read}/${prompt}`,
                    "prompt tokens read"));
  const acceptance = typeof slot.acceptance === "number" ? `${Math.round(100 * slot.acceptance)}%` : "—";
  const figures = [
    ["gen", state === "idle" ? "—" : `${num(slot.generated)}/${num(slot.max_tokens)}`, "tokens generated / max_tokens"],
    ["give-ways", String(num(slot.give_ways)), "times this request's prompt read gave way"],
    ["acc", acceptance, "drafts accepted / proposed"],
  ];
  for (const [name, value, title] of figures) {
    const f = element("span", "figure");
    f.dataset.figure = name;
    f.title = title;
    f.append(element("span", "figure-name", name), element("span", "figure-value", value));
    detail.append(f);
  }
  row.append(head, detail);
  return row;
}

export class Dashboard {
  // `onUnauthorized()` runs when the server refuses the key; `onReachable()` after a good answer.
  constructor({ totals, slots, note, onUnauthorized, onReachable }) {
    Object.assign(this, { totals, slots, note, onUnauthorized, onReachable });
    this.timer = null;
    this.inFlight = false;
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) this.poke();
    });
  }

  start() {
    this.poke();
  }

  // Polls now instead of at the next tick (after the key changed, or the page became visible).
  poke() {
    clearTimeout(this.timer);
    this.timer = null;
    this.tick();
  }

  async tick() {
    if (this.inFlight) return;
    if (document.hidden) {
      this.timer = setTimeout(() => this.tick(), RETRY_MS);
      return;
    }
    this.inFlight = true;
    let delay = POLL_MS;
    try {
      this.render(await getJSON("strata/slots"));
      this.note.textContent = "";
      this.onReachable();
    } catch (e) {
      delay = RETRY_MS;
      this.note.textContent = e.status === 404 ? "this server does not report its slots (GET /strata/slots: 404)" : e.message;
      this.slots.dataset.stale = "true";
      if (e.status === 401) this.onUnauthorized();
    } finally {
      this.inFlight = false;
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.tick(), delay);
    }
  }

  render(doc) {
    const slots = Array.isArray(doc.slots) ? doc.slots : [];
    const t = doc.totals || {};
    const busy = slots.filter((s) => s.state && s.state !== "idle").length;
    const used = num(t.kv_blocks_used);
    const total = num(t.kv_blocks_total);
    const ttft = typeof t.ttft_last_s === "number" ? `${t.ttft_last_s.toFixed(2)}s` : "—";
    this.totals.replaceChildren(
      stat("slots busy", `${busy}/${num(t.parallel) || slots.length}`),
      stat("queue", String(num(t.queue)), "requests waiting for a slot"),
      stat("gen tok/s", rate(t.generation_tok_s), "engine-wide generation rate over the last seconds"),
      stat("give-ways", String(num(t.give_ways)), "prompt reads that gave way to a newer request"),
      stat("preemptions", String(num(t.preemptions)), "requests preempted when KV blocks ran out"),
      stat("finished", String(num(t.requests_finished))),
      stat("last TTFT", ttft, "time to first token of the latest request"),
      stat("uptime", duration(t.uptime_s)),
      bar(total ? used / total : 0, `KV blocks ${used}/${total}${total ? ` (${Math.round((100 * used) / total)}%)` : ""}`,
          "paged KV cache blocks in use"),
    );
    this.slots.replaceChildren(...slots.map(slotRow));
    delete this.slots.dataset.stale;
  }
}
