// The conversation: kept here, in the page, and sent whole with every turn.

import { streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

// Within this many pixels of the bottom, new text keeps the transcript scrolled to the end.
const STICK_TO_BOTTOM_PX = 48;

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

export class Chat {
  // `model()` resolves to the model name to send; `requestFields()` gives the sampling fields and
  // `systemPrompt()` the optional system message; `onBusy(bool)` and `onError(ApiError)` report back.
  constructor({ transcript, hint, model, requestFields, systemPrompt, onBusy, onError }) {
    Object.assign(this, { transcript, hint, model, requestFields, systemPrompt, onBusy, onError });
    this.history = [];
    this.controller = null;
  }

  get busy() {
    return this.controller !== null;
  }

  clear() {
    this.stop();
    this.history = [];
    this.transcript.replaceChildren(this.hint);
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  nearBottom() {
    const t = this.transcript;
    return t.scrollHeight - t.scrollTop - t.clientHeight < STICK_TO_BOTTOM_PX;
  }

  append(node) {
    const stick = this.nearBottom();
    this.hint.remove();
    this.transcript.append(node);
    if (stick) this.transcript.scrollTop = this.transcript.scrollHeight;
  }

  bubble(role) {
    const wrap = element("div", `msg ${role}`);
    const body = element("div", "body");
    const meta = element("div", "meta");
    wrap.append(body, meta);
    this.append(wrap);
    return { wrap, body, meta };
  }

  // Sends `text` as the next user turn and streams the reply. Resolves when the reply has ended,
  // been stopped or failed.
  async send(text) {
    if (this.busy || !text.trim()) return;
    const user = this.bubble("user");
    user.body.textContent = text;
    const reply = this.bubble("assistant");
    reply.wrap.dataset.status = "streaming";
    reply.meta.textContent = "waiting…";
    this.history.push({ role: "user", content: text });
    this.controller = new AbortController();
    this.onBusy(true);

    let content = "";
    let finish = null;
    let usage = null;
    let firstAt = null;
    let frame = 0;
    const render = () => {
      frame = 0;
      const stick = this.nearBottom();
      reply.body.innerHTML = renderMarkdown(content);
      if (stick) this.transcript.scrollTop = this.transcript.scrollHeight;
    };
    const startedAt = performance.now();
    try {
      const system = this.systemPrompt();
      const messages = system ? [{ role: "system", content: system }, ...this.history] : [...this.history];
      const body = { model: await this.model(), messages, ...this.requestFields() };
      for await (const event of streamChat(body, this.controller.signal)) {
        if (event.text) {
          if (firstAt === null) {
            firstAt = performance.now();
            reply.meta.textContent = "generating…";
          }
          content += event.text;
          if (!frame) frame = requestAnimationFrame(render);
        }
        if (event.finish) finish = event.finish;
        if (event.usage) usage = event.usage;
      }
      reply.wrap.dataset.status = "done";
      reply.meta.textContent = describe(usage, finish, startedAt, firstAt);
    } catch (e) {
      if (e.name === "AbortError") {
        reply.wrap.dataset.status = "stopped";
        reply.meta.textContent = "stopped";
      } else {
        reply.wrap.dataset.status = "error";
        reply.meta.textContent = "";
        reply.wrap.append(element("div", "error", e.message));
        this.onError(e);
      }
    } finally {
      if (frame) cancelAnimationFrame(frame);
      render();
      if (content || reply.wrap.dataset.status !== "error") {
        this.history.push({ role: "assistant", content });
      } else {
        this.history.pop();  // the server never took the turn: leave it out of the next request
        user.wrap.classList.add("failed");
      }
      this.controller = null;
      this.onBusy(false);
    }
  }
}

function describe(usage, finish, startedAt, firstAt) {
  const parts = [];
  const end = performance.now();
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (usage && firstAt !== null && usage.completion_tokens > 1 && end > firstAt) {
    parts.push(`${((usage.completion_tokens - 1) / ((end - firstAt) / 1000)).toFixed(1)} tok/s`);
  }
  if (firstAt !== null) parts.push(`first token ${((firstAt - startedAt) / 1000).toFixed(2)} s`);
  if (finish) parts.push(finish === "length" ? "max_tokens reached" : finish);
  return parts.join(" · ");
}
