// Wires the page together: model name, API key, sampling settings, chat and the server panel.

import { ApiError, fetchModel, storeApiKey, storedApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { Settings } from "./settings.js";

const $ = (id) => document.getElementById(id);

class Page {
  constructor() {
    this.model = null;  // {name, maxModelLen} once /v1/models answered
    this.modelFailure = null;  // the HTTP status of the last failed /v1/models, 0: unreachable
    this.modelRequest = null;
    this.settings = new Settings($("settings"), $("reset-settings"));
    this.chat = new Chat({
      transcript: $("transcript"),
      hint: $("empty-hint"),
      model: () => this.modelName(),
      requestFields: () => this.settings.sampling(),
      systemPrompt: () => this.settings.systemPrompt(),
      onBusy: (busy) => this.setBusy(busy),
      onError: (e) => this.showProblem(e),
    });
    this.dashboard = new Dashboard({
      totals: $("totals"),
      slots: $("slots"),
      note: $("dash-note"),
      onUnauthorized: () => this.askForKey(),
      onReachable: () => {
        // The server is back after being unreachable: ask again. A refusal waits for a new key.
        if (!this.model && this.modelFailure === 0) this.refreshModel();
      },
    });
    this.bindComposer();
    this.bindKey();
  }

  start() {
    this.refreshModel();
    this.dashboard.start();
    $("message").focus();
  }

  bindComposer() {
    const input = $("message");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.sendInput();
    });
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.sendInput();
      }
    });
    $("stop").addEventListener("click", () => this.chat.stop());
    $("new-chat").addEventListener("click", () => {
      this.chat.clear();
      input.focus();
    });
  }

  bindKey() {
    const field = $("api-key");
    field.value = storedApiKey();
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      storeApiKey(field.value.trim());
      field.classList.remove("wanted");
      this.setStatus("");
      this.model = null;
      this.refreshModel();
      this.dashboard.poke();
    });
  }

  sendInput() {
    const input = $("message");
    const text = input.value;
    if (this.chat.busy || !text.trim()) return;
    input.value = "";
    this.chat.send(text);
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
    if (!busy) $("message").focus();
  }

  setStatus(text, kind = "") {
    const status = $("status");
    status.textContent = text;
    status.dataset.kind = kind;
  }

  askForKey() {
    $("api-key").classList.add("wanted");
    this.setStatus("the server needs an API key: enter it under API key", "error");
  }

  showProblem(e) {
    if (e instanceof ApiError && e.status === 401) this.askForKey();
    else this.setStatus(e.message, "error");
  }

  // Asks /v1/models once at a time; the header shows the answer or why there is none.
  refreshModel() {
    if (!this.modelRequest) {
      this.modelRequest = fetchModel()
        .then((model) => {
          this.model = model;
          this.modelFailure = null;
          const label = $("model-name");
          label.textContent = model.name;
          label.title = model.maxModelLen ? `context ${model.maxModelLen} tokens` : "the served model";
          label.dataset.ready = "true";
          document.title = `${model.name} · Strata`;
          if ($("status").dataset.kind === "error") this.setStatus("");
          return model;
        })
        .catch((e) => {
          this.modelFailure = e instanceof ApiError ? e.status : 0;
          $("model-name").textContent = "no model";
          this.showProblem(e);
          return null;
        })
        .finally(() => {
          this.modelRequest = null;
        });
    }
    return this.modelRequest;
  }

  async modelName() {
    const model = this.model || (await this.refreshModel());
    if (!model) throw new ApiError("chat: the server did not say which model it serves", this.modelFailure ?? 0);
    return model.name;
  }
}

new Page().start();
