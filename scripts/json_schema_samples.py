"""Seeded `response_format: json_schema` samples from `strata serve` on the embedded model (CPU), as a new
user would ask for them: how many end with `finish_reason: "stop"` in valid, compact JSON.

    python scripts/json_schema_samples.py [--seeds 20] [--schema person|person-bounded|flags] [--max-tokens N]

`person` is an object of a free-text string, an integer and a boolean (`person-bounded`: the string at
most 32 characters); `flags` a boolean, an integer and an array of enums (tests/server/test_llama_api.py's).
Prints one line per seed and the count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "ok": {"type": "boolean"}},
               "required": ["name", "age", "ok"], "additionalProperties": False},
    "person-bounded": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                                        "age": {"type": "integer"}, "ok": {"type": "boolean"}},
                       "required": ["name", "age", "ok"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["ok", "count", "tags"], "additionalProperties": False},
}
CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
CONFIG = {"ctx": 512, "parallel": 2, "device": "cpu", "api_key": "k", "model_name": "m", "log_level": "warning",
          "chat_template": "chatml", "seed": 42}


def main() -> int:
    import openai
    from serving import running_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="person")
    p.add_argument("--max-tokens", type=int, default=None, help="(default: the rest of the context)")
    args = p.parse_args()
    fmt = {"type": "json_schema", "json_schema": {"name": args.schema, "schema": SCHEMAS[args.schema], "strict": True}}
    ended = 0
    with running_server(Path(tempfile.mkdtemp()), CONFIG) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=300)
        for seed in range(args.seeds):
            r = c.chat.completions.create(model="m", messages=CHAT, seed=seed, max_tokens=args.max_tokens,
                                          response_format=fmt)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            ok = finish == "stop" and text == json.dumps(json.loads(text), separators=(",", ":"))
            ended += ok
            print(f"seed {seed:2d}: {finish:6s} {r.usage.completion_tokens:4d} tokens  {text[:90]!r}")
    print(f"{ended} of {args.seeds} ended in valid, compact JSON ({args.schema})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
