"""Grammars that enforce `tool_choice` "required" and a named function, in the model's own call format.

`tool_call_grammar` turns a request's tools and choice into a `GrammarSpec` of kind `tool_call`: the
output is one call (a named function, or `parallel_tool_calls: false`) or one or more calls (required),
written the way `strata.server.tools` parses them, with each call's arguments following its tool's
JSON schema, so that even a small model returns a call the parser reads and the function can run:

- Hermes (Qwen2.5/Qwen3): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, calls joined by
  a newline; the object is JSON-schema constrained (`name` first, as the templates write it);
- GLM-4.5: `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`, the
  arguments in the schema's property order, required ones present. A value whose schema admits only
  strings is raw text, as the template writes it (its `enum`/`const` and a `^...$` pattern are
  enforced, other string keywords are not); any other value is JSON following its schema.

Argument objects are closed (`additionalProperties` false unless the schema says otherwise) and JSON
keywords the engine does not implement are ignored rather than refusing the request. The grammar is
llguidance's Lark dialect: `%json` embeds a schema, `<[id]>` is a token by id. A tag that the tokenizer
holds as a special token (its text never appears in decoded output otherwise) is matched as that token.

`reasoning` lets a thinking model reason first: "optional" allows a leading `<think>...</think>` block,
"open" means the prompt opened `<think>` and the output begins inside it; "none" starts with a call.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from strata.grammar.llguidance_backend import JSON_COMPACT
from strata.grammar.spec import GrammarSpec, bounded_integers, close_objects
from strata.server.reasoning import THINK_CLOSE, THINK_OPEN
from strata.server.tools import (CALL_CLOSE, CALL_OPEN, KEY_CLOSE, KEY_OPEN, VALUE_CLOSE, VALUE_OPEN, ToolChoice,
                                 ToolRequestError)

Reasoning = Literal["none", "optional", "open"]
TOOL_FORMATS = ("hermes", "glm45")
# Embedded schemas: compact as for response_format, and lenient about unknown keywords.
_JSON_OPTIONS = {**JSON_COMPACT, "lenient": True}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark `/.../` regex (Rust syntax: only meta characters escaped)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Lark:
    """Builds the grammar text: rules, terminals, and tags as literals or special tokens."""

    def __init__(self, tokenizer: Any):
        self.special: dict[str, int] = {}
        if tokenizer is not None:
            added = tokenizer.tk.get_added_tokens_decoder()
            self.special = {t.content: i for i, t in added.items() if t.special}
        self.lines: list[str] = []
        self.terminals: dict[tuple[str, str], str] = {}

    def tag(self, text: str) -> str:
        i = self.special.get(text)
        return f"<[{i}]>" if i is not None else _literal(text)

    def until(self, close: str) -> str:
        """Any text up to and including the tag `close` (a terminal: the lexer cannot split a free-text
        lexeme at a tag, so the tag is part of it), or any text then `close` as a special token."""
        if close in self.special:
            return f"FREE_TEXT {self.tag(close)}"
        key = (close, "")
        if key not in self.terminals:
            name = self.terminals[key] = f"UNTIL_{len(self.terminals)}"
            c = _regex_escape(close)
            self.lines.append(f"{name}: /(.|\\n)*{c}/ & ~/(.|\\n)*{c}(.|\\n)+/")
        return self.terminals[key]

    def pattern_until(self, pattern: str, close: str) -> str:
        name = self.terminals[(pattern, close)] = f"PATTERN_{len(self.terminals)}"
        if close in self.special:
            self.lines.append(f"{name}: /{pattern}/")
            return f"{name} {self.tag(close)}"
        self.lines.append(f"{name}: /(?:{pattern}){_regex_escape(close)}/")
        return name

    def rule(self, name: str, body: str) -> None:
        self.lines.append(f"{name}: {body}")

    def text(self) -> str:
        if any("FREE_TEXT" in line for line in self.lines):
            self.lines.append("FREE_TEXT: /(.|\\n)*/")
        return "\n".join(self.lines) + "\n"


def _json(schema: Any) -> str:
    return "%json " + json.dumps({**close_objects(bounded_integers(schema)), "x-guidance": _JSON_OPTIONS},
                                 ensure_ascii=False)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _hermes_call(g: _Lark, tools: list[dict[str, Any]]) -> str:
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    g.rule("call_object", _json(calls[0] if len(calls) == 1 else {"anyOf": calls}))
    return f'{g.tag(CALL_OPEN)} "\\n" call_object "\\n" {g.tag(CALL_CLOSE)}'


def _string_only(schema: dict[str, Any]) -> bool:
    """Whether a schema admits only strings (GLM writes those raw, not as JSON)."""
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def _glm_value(g: _Lark, schema: Any) -> str:
    """The value of one argument, its closing tag included."""
    if not isinstance(schema, dict) or not _string_only(schema):
        return f"{_json(schema if isinstance(schema, dict) else {})} {g.tag(VALUE_CLOSE)}"
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "(" + " | ".join(_literal(v) for v in values) + f") {g.tag(VALUE_CLOSE)}"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") and len(pattern) > 2:
        return g.pattern_until(pattern[1:-1].replace("/", "\\/"), VALUE_CLOSE)
    longest = schema.get("maxLength")
    if isinstance(longest, int) and not isinstance(longest, bool) and 0 <= longest <= 10_000:
        # A raw value of at most maxLength characters, none of them starting the closing tag.
        return g.pattern_until(f"[^<]{{{min(schema.get('minLength') or 0, longest)},{longest}}}", VALUE_CLOSE)
    return g.until(VALUE_CLOSE)


def _glm_call(g: _Lark, index: int, tool: dict[str, Any]) -> str:
    name = tool["function"]["name"]
    params = _parameters(tool)
    props = params.get("properties")
    key_open = f'{g.tag(KEY_OPEN)}'
    arg_head = f'{g.tag(KEY_CLOSE)} "\\n" {g.tag(VALUE_OPEN)}'
    if isinstance(props, dict) and props:
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"t{index}_arg{j}"
            g.rule(rule, f'{key_open} {_literal(key)} {arg_head} {_glm_value(g, schema)} "\\n"')
            parts.append(rule if key in required else f"{rule}?")
        args = " ".join(parts)
    else:  # free-form parameters: any keys, raw values
        g.rule(f"t{index}_arg", f'{key_open} /[^<\\n]+/ {arg_head} {g.until(VALUE_CLOSE)} "\\n"')
        args = f"t{index}_arg*"
    g.rule(f"call_{index}", f'{g.tag(CALL_OPEN)} {_literal(name)} "\\n" {args} {g.tag(CALL_CLOSE)}')
    return f"call_{index}"


def tool_call_grammar(tools: list[dict[str, Any]] | None, choice: ToolChoice, tool_format: str,
                      tokenizer: Any = None, *, parallel: bool = True, reasoning: Reasoning = "none",
                      ) -> GrammarSpec | None:
    """The grammar that `choice` demands of the output, or None when it demands nothing (`none`,
    `auto`). `tools` are the request's (checked by `tools_for_template`); `tool_format` is the model's
    `ToolParser.format` (`tool_parser_for`); `tokenizer` (a strata Tokenizer) tells which tags are
    special tokens. `parallel` false allows a single call under "required"."""
    if choice.mode not in ("required", "function"):
        return None
    if tool_format not in TOOL_FORMATS:
        raise ToolRequestError("tool_choice", f"tool_choice {choice.mode!r} is not available for tool-call format "
                                              f"{tool_format!r}")
    chosen = [t for t in tools or [] if choice.mode == "required" or t["function"]["name"] == choice.name]
    if not chosen:
        raise ToolRequestError("tool_choice", f"tool_choice {choice.mode!r} needs tools")
    g = _Lark(tokenizer)
    if tool_format == "hermes":
        g.rule("call", _hermes_call(g, chosen))
    else:
        g.rule("call", " | ".join(_glm_call(g, i, t) for i, t in enumerate(chosen)))
    calls = 'call ("\\n" call)*' if parallel and choice.mode == "required" else "call"
    if reasoning == "none":
        g.rule("start", calls)
    else:
        g.lines.append("BLANK: /[ \\t\\r\\n]+/")
        think = g.until(THINK_CLOSE)
        if reasoning == "open":
            g.rule("start", f"{think} BLANK? {calls}")
        else:
            g.rule("start", f"(BLANK? {g.tag(THINK_OPEN)} {think} BLANK?)? {calls}")
    return GrammarSpec("tool_call", g.text())
