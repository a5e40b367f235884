"""xgrammar against llguidance on a ~150K-token vocabulary, on the CPU: what picking one rests on.

For each engine: the time to build its tokenizer info, the cold compile time of three grammars (any
JSON object, a nested JSON schema, a Hermes tool call over three tools' schemas), the time to make a
matcher, and the per-token cost of filling a mask row while walking a valid output token by token
(mean, p50, p99, max) and of accepting the token; then one step of a batch of 8 matchers filled in
parallel, the way the engine would fill a decode step's masks. Every walked token must be allowed by
the mask before it (checked), and the stop token must be allowed at the end.

    .venv/bin/python scripts/compare_grammar_engines.py [--gguf ggml-vocab-qwen2.gguf] [--out FILE]

Without --gguf the qwen2 vocabulary (151,936 tokens) comes from llama.cpp's vocab files (tests/fetch_vocab.py).
The xgrammar arm needs `pip install xgrammar` (not a Strata dependency). A third arm, `strata.grammar`,
runs llguidance through Strata's wrapper with the options the server uses.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from strata.tokenizer import Tokenizer  # noqa: E402

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0},
                    "options": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "shipping": {
            "anyOf": [
                {"type": "object", "properties": {"method": {"const": "pickup"}, "store": {"type": "string"}},
                 "required": ["method", "store"], "additionalProperties": False},
                {"type": "object",
                 "properties": {
                     "method": {"const": "delivery"},
                     "address": {"type": "object",
                                 "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                 "required": ["street", "city", "zip"], "additionalProperties": False}},
                 "required": ["method", "address"], "additionalProperties": False},
            ]
        },
        "notes": {"type": ["string", "null"]},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "shipping", "notes", "gift"],
    "additionalProperties": False,
}
NESTED_TEXT = json.dumps({
    "order_id": "ORD-004217",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "tier": "pro"},
    "items": [{"sku": "KB-101", "quantity": 2, "price": 49.5, "options": ["black", "US layout"]},
              {"sku": "MS-7", "quantity": 1, "price": 19.99}],
    "shipping": {"method": "delivery", "address": {"street": "12 Analytical St", "city": "London", "zip": "10001"}},
    "notes": None,
    "gift": False,
})

JSON_OBJECT_TEXT = json.dumps({
    "title": "Grammar engines", "tags": ["json", "llm", "masks"],
    "stats": {"count": 3, "ratio": 0.75, "ok": True, "missing": None},
    "items": [{"id": 1, "name": "first"}, {"id": 2, "name": "second \"quoted\""}],
})

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "search_flights", "parameters": {
        "type": "object",
        "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "date": {"type": "string"}, "passengers": {"type": "integer", "minimum": 1},
                       "cabin": {"enum": ["economy", "business", "first"]}},
        "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False}},
    {"name": "create_event", "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "start": {"type": "string"}, "minutes": {"type": "integer"},
                       "attendees": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "start"], "additionalProperties": False}},
]
CALL_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
     "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}
TOOL_CALL_TEXT = '<tool_call>\n' + json.dumps({"name": "search_flights", "arguments": {
    "origin": "SFO", "destination": "JFK", "date": "2025-06-01", "passengers": 2, "cabin": "economy"}}) + \
    '\n</tool_call>'
CASES = {"json_object": JSON_OBJECT_TEXT, "nested_schema": NESTED_TEXT, "tool_call": TOOL_CALL_TEXT}
# Which JSON-schema features compile at all (not whether they are enforced exactly), and whether a
# malformed schema is refused.
FEATURES: dict[str, Any] = {
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_email": {"type": "string", "format": "email"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "string_length": {"type": "string", "minLength": 2, "maxLength": 5},
    "array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "number_bounds": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "multiple_of": {"type": "integer", "multipleOf": 5},
    "one_of": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                         {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "recursive_ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "pattern_properties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "if_then_else": {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "dependent_required": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "malformed_type": {"type": "objec"},
    "malformed_minimum": {"type": "integer", "minimum": "one"},
    "malformed_ref": {"$ref": "#/$defs/missing"},
}


def _median_s(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def batch_threads() -> int:
    """Both engines get the same thread pool for a batch: a thread per row, up to the machine's cores."""
    return max(1, min(8, os.cpu_count() or 1))


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _stats_us(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"mean": round(float(a.mean()), 2), "p50": round(float(np.percentile(a, 50)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "max": round(float(a.max()), 2)}


class LlguidanceArm:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import llguidance

        self.llg = llguidance
        self.version = llguidance.__version__
        self.tok, self.vocab_size = tok, vocab_size
        self.info = None

    def build_info(self) -> Any:
        self.info = self.llg.LLTokenizer(self.tok.tk.to_str(), n_vocab=self.vocab_size,
                                         eos_token=sorted(self.tok.stop_ids))
        return self.info

    def _grammar(self, case: str) -> str:
        if case == "json_object":
            return self.llg.grammar_from("json_schema", '{"type": "object"}')
        if case == "nested_schema":
            return self.llg.grammar_from("json_schema", json.dumps(NESTED_SCHEMA))
        lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(CALL_SCHEMA) + "\n"
        return self.llg.grammar_from("lark", lark)

    def compile(self, case: str) -> Any:
        m = self.llg.LLMatcher(self.info, self._grammar(case), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def compile_schema(self, schema: Any) -> None:
        m = self.llg.LLMatcher(self.info, self.llg.grammar_from("json_schema", json.dumps(schema)), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()  # a fresh matcher per request: copy the compiled one

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        r = mask[row]
        m.unsafe_compute_mask_ptr(r.ctypes.data, r.nbytes)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def batch_filler(self) -> Callable[[list[Any], np.ndarray], None]:
        ex = self.llg.LLExecutor(num_threads=batch_threads())

        def fill(ms: list[Any], mask: np.ndarray) -> None:
            ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], mask.ctypes.data,
                                       mask.shape[1] * 4, mask.shape[0])
        return fill


class StrataArm:
    """llguidance through strata.grammar as the server runs it: bounded JSON whitespace, strict schemas
    closed, the tool call built by strata.server.tool_grammar; the per-token cost includes the wrapper."""

    name = "strata.grammar"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import llguidance

        self.version = f"llguidance {llguidance.__version__}"
        self.tok, self.vocab_size = tok, vocab_size
        self.compiler = None

    def build_info(self) -> Any:
        from strata.grammar import GrammarCompiler

        self.compiler = GrammarCompiler(self.tok, self.vocab_size, threads=batch_threads(), warm=False)
        return self.compiler

    def compile(self, case: str) -> Any:
        from strata.grammar import GrammarSpec
        from strata.server.tool_grammar import tool_call_grammar
        from strata.server.tools import ToolChoice

        if case == "json_object":
            spec = GrammarSpec.json_object()
        elif case == "nested_schema":
            spec = GrammarSpec.json_schema(NESTED_SCHEMA, strict=True)
        else:
            tools = [{"type": "function", "function": t} for t in TOOLS]
            spec = tool_call_grammar(tools, ToolChoice("required"), "hermes", self.tok, parallel=False)
        self.compiler._cache.clear()  # time the compile, not the cache
        return self.compiler.compile(spec)

    def compile_schema(self, schema: Any) -> None:
        from strata.grammar import GrammarSpec

        self.compiler.compile(GrammarSpec.json_schema(schema, strict=True))

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        m.fill_mask(mask[row])

    def accept(self, m: Any, token: int) -> bool:
        return m.accept(token)

    def batch_filler(self) -> Callable[[list[Any], np.ndarray], None]:
        def fill(ms: list[Any], mask: np.ndarray) -> None:
            self.compiler.fill_masks([(m, i, ()) for i, m in enumerate(ms)], mask)
        return fill


class XgrammarArm:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        self.version = importlib.metadata.version("xgrammar")
        self.tok, self.vocab_size = tok, vocab_size
        self.compiler = None

    def build_info(self) -> Any:
        xgr = self.xgr
        encoded = [""] * self.vocab_size
        for text, i in self.tok.tk.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                encoded[i] = text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(self.tok.tk.to_str())
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=self.vocab_size,
                                 stop_token_ids=sorted(self.tok.stop_ids), add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        return info

    def compile(self, case: str) -> Any:
        xgr, c = self.xgr, self.compiler
        if case == "json_object":
            return c.compile_json_schema('{"type": "object"}')
        if case == "nested_schema":
            return c.compile_json_schema(json.dumps(NESTED_SCHEMA))
        g = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                               xgr.Grammar.from_json_schema(json.dumps(CALL_SCHEMA)),
                               xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
        return c.compile_grammar(g)

    def compile_schema(self, schema: Any) -> None:
        self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: np.ndarray, row: int) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(mask), row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def batch_filler(self) -> Callable[[list[Any], np.ndarray], None]:
        bm = self.xgr.BatchGrammarMatcher(max_threads=batch_threads())

        def fill(ms: list[Any], mask: np.ndarray) -> None:
            bm.batch_fill_next_token_bitmask(ms, self.torch.from_numpy(mask))
        return fill


def walk(arm: Any, compiled: Any, tokens: list[int], words: int, stop: int) -> dict[str, Any]:
    """One request's output, token by token: fill its mask row, check the token is allowed, accept it."""
    m = arm.matcher(compiled)
    mask = np.zeros((1, words), dtype=np.int32)
    fill_ns, accept_ns, refused = [], [], []
    for i, t in enumerate(tokens):
        s = time.perf_counter_ns()
        arm.fill(m, mask, 0)
        fill_ns.append(time.perf_counter_ns() - s)
        if not _allowed(mask[0], t):
            refused.append(i)
        s = time.perf_counter_ns()
        ok = arm.accept(m, t)
        accept_ns.append(time.perf_counter_ns() - s)
        if not ok:
            raise RuntimeError(f"{arm.name} rejected token {i} ({t}) of a valid output")
    arm.fill(m, mask, 0)
    row = mask[0]
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return {"fill_ns": fill_ns, "accept_ns": accept_ns, "refused": refused,
            "stop_allowed_at_end": _allowed(row, stop), "allowed_at_end": int(bits.sum())}


def walks(arm: Any, compiled: Any, tokens: list[int], words: int, stop: int, n: int) -> dict[str, Any]:
    """The first walk over a freshly compiled grammar (cold: engines build lexer/mask caches lazily)
    and n - 1 more over new matchers of the same grammar (warm: a cached schema's later requests)."""
    runs = [walk(arm, compiled, tokens, words, stop) for _ in range(n)]
    cold, warm = runs[0], runs[1:]
    return {"tokens": len(tokens),
            "cold": {"first_mask_us": round(cold["fill_ns"][0] / 1e3, 2), "mask_us": _stats_us(cold["fill_ns"]),
                     "accept_us": _stats_us(cold["accept_ns"])},
            "warm": {"mask_us": _stats_us([x for r in warm for x in r["fill_ns"]]),
                     "accept_us": _stats_us([x for r in warm for x in r["accept_ns"]])},
            "all_tokens_allowed": not any(r["refused"] for r in runs),
            "refused_positions": cold["refused"][:10],
            "stop_allowed_at_end": all(r["stop_allowed_at_end"] for r in runs),
            "allowed_at_end": cold["allowed_at_end"]}


def batch_steps(arm: Any, compiled: dict[str, Any], tokens: dict[str, list[int]], words: int,
                batch: int) -> dict[str, Any]:
    """`batch` matchers (the cases in turn, each started a few tokens in) filled together per step."""
    names = list(compiled)
    rows = [(names[i % len(names)], i // len(names)) for i in range(batch)]
    ms = []
    for name, skip in rows:
        m = arm.matcher(compiled[name])
        for t in tokens[name][:skip * 3]:
            arm.accept(m, t)
        ms.append(m)
    pos = [skip * 3 for _, skip in rows]
    steps = min(len(tokens[name]) - p for (name, _), p in zip(rows, pos))
    mask = np.zeros((batch, words), dtype=np.int32)
    fill = arm.batch_filler()
    step_ns, accept_ns = [], []
    for step in range(steps):
        s = time.perf_counter_ns()
        fill(ms, mask)
        step_ns.append(time.perf_counter_ns() - s)
        s = time.perf_counter_ns()
        for r, ((name, _), m) in enumerate(zip(rows, ms)):
            t = tokens[name][pos[r] + step]
            if not _allowed(mask[r], t):
                raise RuntimeError(f"{arm.name}: batch row {r} refused a valid token")
            arm.accept(m, t)
        accept_ns.append(time.perf_counter_ns() - s)
    return {"batch": batch, "steps": steps, "fill_step_us": _stats_us(step_ns[1:]),
            "accept_step_us": _stats_us(accept_ns)}


def run_arm(arm: Any, tok: Tokenizer, vocab_size: int, repeat: int, batch: int, n_walks: int) -> dict[str, Any]:
    words = (vocab_size + 31) // 32
    info_s, _ = _median_s(arm.build_info, repeat)
    out: dict[str, Any] = {"version": arm.version, "tokenizer_info_s": round(info_s, 4), "cases": {}}
    stop = min(tok.stop_ids)
    compiled, tokens = {}, {}
    for case, text in CASES.items():
        compile_s, compiled[case] = _median_s(lambda c=case: arm.compile(c), repeat)
        matcher_s, _ = _median_s(lambda c=case: arm.matcher(compiled[c]), repeat)
        tokens[case] = tok.encode(text, add_special=False)
        out["cases"][case] = {"compile_ms": round(compile_s * 1e3, 2), "new_matcher_us": round(matcher_s * 1e6, 1),
                              **walks(arm, compiled[case], tokens[case], words, stop, n_walks)}
    out["schema_features"] = {}
    for name, schema in FEATURES.items():
        try:
            arm.compile_schema(schema)
            out["schema_features"][name] = "compiles"
        except Exception as e:  # each engine raises its own error types
            out["schema_features"][name] = "error: " + " ".join(str(e).split())[:160]
    batch_steps(arm, compiled, tokens, words, batch)  # starts the engine's thread pool
    out["batch"] = batch_steps(arm, compiled, tokens, words, batch)
    return out


def median_of_runs(runs: list[Any]) -> Any:
    """Runs merged leaf by leaf: the median of numbers, all() of flags, the first of anything else (on
    a shared machine a single run's figures move by 2x with the load of other jobs)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of_runs([r[k] for r in runs]) for k in first}
    if isinstance(first, bool):
        return all(runs)
    if isinstance(first, (int, float)):
        return round(statistics.median(runs), 2)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="a vocab GGUF (default: llama.cpp's qwen2 vocabulary)")
    ap.add_argument("--vocab-size", type=int, default=None, help="the logits width (default: the tokenizer's)")
    ap.add_argument("--repeat", type=int, default=5, help="set-up timings are the median of this many tries")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--walks", type=int, default=10, help="walks of each output: one cold, the rest warm")
    ap.add_argument("--runs", type=int, default=3, help="whole runs per engine; each figure is their median")
    ap.add_argument("--engines", default="llguidance,xgrammar,strata.grammar")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "grammar_engines_cpu.json"))
    args = ap.parse_args()

    from strata.loaders.gguf import open_reader
    from strata.loaders.gguf_vocab import tokenizer_from_gguf

    path = args.gguf
    if path is None:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from fetch_vocab import fetch

        path = os.path.join(fetch(), "ggml-vocab-qwen2.gguf")
    tok = tokenizer_from_gguf(open_reader(path), path)
    vocab_size = args.vocab_size or tok.vocab_size
    arms = {"llguidance": LlguidanceArm, "xgrammar": XgrammarArm, "strata.grammar": StrataArm}
    result: dict[str, Any] = {
        "vocab": os.path.basename(path), "vocab_size": vocab_size, "stop_ids": sorted(tok.stop_ids),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                    "batch_threads": batch_threads()},
        "cases": {c: len(tok.encode(t, add_special=False)) for c, t in CASES.items()},
        "engines": {},
    }
    result["runs"] = args.runs
    names = args.engines.split(",")
    runs: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(args.runs):  # engines take turns, so that a busy spell of the machine hits them alike
        for name in names:
            print(f"run {i + 1}/{args.runs}: {name} ...", file=sys.stderr)
            runs[name].append(run_arm(arms[name](tok, vocab_size), tok, vocab_size, args.repeat, args.batch,
                                      args.walks))
    result["engines"] = {name: median_of_runs(runs[name]) for name in names}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
