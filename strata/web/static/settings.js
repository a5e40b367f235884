// The sampling side panel: values kept in localStorage, read as request fields when a message is sent.

const STORAGE = "strata.sampling";
const DEFAULTS = { temperature: "0.8", top_p: "0.95", top_k: "40", min_p: "0.05", max_tokens: "512", seed: "",
                   system: "" };
const INTEGER_FIELDS = new Set(["top_k", "max_tokens", "seed"]);
const NUMBER_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE) || "{}");
    return { ...DEFAULTS, ...(saved && typeof saved === "object" ? saved : {}) };
  } catch {
    return { ...DEFAULTS };
  }
}

export class Settings {
  constructor(form, resetButton) {
    this.form = form;
    this.fill(load());
    form.addEventListener("input", () => this.save());
    form.addEventListener("submit", (e) => e.preventDefault());
    resetButton.addEventListener("click", () => {
      this.fill(DEFAULTS);
      this.save();
    });
  }

  field(name) {
    return this.form.elements.namedItem(name);
  }

  fill(values) {
    for (const name of Object.keys(DEFAULTS)) this.field(name).value = values[name] ?? "";
  }

  save() {
    const values = {};
    for (const name of Object.keys(DEFAULTS)) values[name] = this.field(name).value;
    localStorage.setItem(STORAGE, JSON.stringify(values));
  }

  // Request fields for the filled-in, valid inputs; a blank or invalid one leaves the server's default.
  sampling() {
    const out = {};
    for (const name of NUMBER_FIELDS) {
      const input = this.field(name);
      const text = input.value.trim();
      if (text === "" || !input.checkValidity()) continue;
      const value = Number(text);
      if (!Number.isFinite(value)) continue;
      out[name] = INTEGER_FIELDS.has(name) ? Math.trunc(value) : value;
    }
    return out;
  }

  systemPrompt() {
    return this.field("system").value.trim();
  }
}
