// What the page asks the server. Paths are relative, so the page also works behind a path prefix.

const KEY_STORAGE = "strata.apiKey";

export class ApiError extends Error {
  constructor(message, status = 0) {
    super(message);
    this.status = status;  // HTTP status, 0 when the server could not be reached
  }
}

export function storedApiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function storeApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = storedApiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function refusal(resp, what) {
  if (resp.status === 401) {
    return new ApiError(`${what}: the server needs an API key (enter it under API key)`, 401);
  }
  let message = `${resp.status} ${resp.statusText}`.trim();
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = `${resp.status}: ${body.error.message}`;
  } catch {
    // not an OpenAI error body: the status line says enough
  }
  return new ApiError(`${what}: ${message}`, resp.status);
}

async function send(path, init, what) {
  try {
    return await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`${what}: cannot reach the server`, 0);
  }
}

export async function getJSON(path) {
  const resp = await send(path, { headers: headers(), cache: "no-store" }, path);
  if (!resp.ok) throw await refusal(resp, path);
  return resp.json();
}

export async function fetchModel() {
  const doc = await getJSON("v1/models");
  const card = doc && Array.isArray(doc.data) ? doc.data[0] : null;
  if (!card || !card.id) throw new ApiError("v1/models: no model listed");
  return { name: String(card.id), maxModelLen: card.max_model_len || null };
}

// One SSE event's data, or null when the event carries none.
function eventData(lines) {
  return lines.length ? lines.join("\n") : null;
}

// Streams a chat completion: yields {text}, {finish}, {usage} as they arrive. Aborting `signal`
// closes the connection, and the server frees the request's slot when it sees that.
export async function* streamChat(body, signal) {
  const init = {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  };
  const resp = await send("v1/chat/completions", init, "chat");
  if (!resp.ok) throw await refusal(resp, "chat");
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value;
    const lines = pending.split("\n");
    pending = lines.pop();
    for (const raw of lines) {
      const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
      if (line.startsWith("data:")) {
        data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        continue;
      }
      if (line !== "") continue;  // comments and other fields
      const payload = eventData(data);
      data = [];
      if (payload === null) continue;
      if (payload === "[DONE]") return;
      let event;
      try {
        event = JSON.parse(payload);
      } catch {
        continue;
      }
      if (event.error) throw new ApiError(`chat: ${event.error.message || "the server failed the request"}`, 500);
      for (const choice of event.choices || []) {
        const text = choice.delta && choice.delta.content;
        if (text) yield { text };
        if (choice.finish_reason) yield { finish: choice.finish_reason };
      }
      if (event.usage) yield { usage: event.usage };
    }
  }
  throw new ApiError("chat: the connection closed before the reply finished", 0);
}
