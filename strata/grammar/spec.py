"""What a request's output must match: a `GrammarSpec`, plain hashable data (no engine, no torch).

Kinds:
- `json_object`: any JSON object;
- `json_schema`: a JSON schema (`text` is the schema as JSON text). `strict` (OpenAI's flag) makes
  every object schema that lists `properties` and says nothing of `additionalProperties` closed to other
  keys, and turns a keyword the engine does not implement into an error; not strict, such keywords are
  ignored and JSON Schema's defaults hold;
- `regex`: the whole output matches the regular expression (Rust `regex` syntax);
- `grammar`: a context-free grammar, either llama.cpp's GBNF (`root ::= ...`) or llguidance's Lark
  dialect (`start: ...`), told apart by its syntax;
- `tool_call`: a grammar built by `strata.server.tool_grammar` for `tool_choice` "required" or a named
  function (Lark, with JSON schemas embedded through `%json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "grammar", "tool_call"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "grammar", "tool_call")


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""  # the schema (JSON text), regex or grammar source; empty for json_object
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind == "json_object":
            if self.text:
                raise GrammarError("a json_object grammar takes no text")
        elif not isinstance(self.text, str) or not self.text.strip():
            raise GrammarError(f"a {self.kind} grammar needs a non-empty {_WHAT[self.kind]}")

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, strict: bool = True) -> "GrammarSpec":
        """`schema` as parsed JSON. Key order is kept: it is the order properties are generated in."""
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, not {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        return cls("json_schema", text, strict)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, source: str) -> "GrammarSpec":
        return cls("grammar", source)

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        """Exactly one of `options` (vLLM's `choice`), as a Lark grammar."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return cls("grammar", "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))

    def schema(self) -> Any:
        """The parsed schema of a json_schema spec; `{"type": "object"}` for json_object."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} grammar has no schema")
        return json.loads(self.text)


_WHAT = {"json_schema": "schema", "regex": "pattern", "grammar": "grammar source", "tool_call": "grammar source"}


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists `properties` and says nothing of
    `additionalProperties` (nor `unevaluatedProperties` / `patternProperties`) allows no other keys.
    `allOf` branches are left as they are (closing each would forbid the other branches' keys), and so are
    `not` and `if`, whose schemas are conditions rather than shapes."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: close_objects(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "additionalProperties", "additionalItems", "then", "else", "contains",
                     "prefixItems", "anyOf", "oneOf"):
            out[key] = close_objects(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "unevaluatedProperties",
                                                         "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


MAX_FINITE_CHECK_STEPS = 100_000


def has_finite_value(schema: Any) -> bool:
    """Whether some finite JSON value can satisfy `schema` as far as its structure decides: a required
    property, a non-empty array's items or every `allOf` part must have one, `anyOf` / `oneOf` one
    part. A `$ref` back to a schema it is already inside cannot end the value on that path, so
    `{"$ref": "#"}` and an object requiring a property of its own type have none. Constraints on
    values (ranges, patterns) are the grammar engine's to check."""
    steps = [0]

    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            return True  # a remote schema: not ours to follow
        node: Any = schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True  # an unresolved reference is the compiler's error to report
        return node

    def finite(node: Any, inside: tuple[int, ...]) -> bool:
        steps[0] += 1
        if steps[0] > MAX_FINITE_CHECK_STEPS or not isinstance(node, dict):
            return node is not False
        if id(node) in inside:
            return False
        inside = (*inside, id(node))
        if isinstance(node.get("$ref"), str) and not finite(resolve(node["$ref"]), inside):
            return False
        if any(not finite(part, inside) for part in node.get("allOf") or ()):
            return False
        for key in ("anyOf", "oneOf"):
            parts = node.get(key)
            if isinstance(parts, list) and parts and not any(finite(part, inside) for part in parts):
                return False
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types and any(t not in ("object", "array") for t in types):
            return True  # a scalar type ends the value
        if (types is None or "object" in types) and "properties" in node or types == ["object"]:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            for name in node.get("required") or ():
                if name in props and not finite(props[name], inside):
                    return False
        if types == ["array"] or (types is None and ("items" in node or "prefixItems" in node)):
            least = node.get("minItems", 0) if isinstance(node.get("minItems", 0), int) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if any(not finite(p, inside) for p in prefix[:least]):
                return False
            if least > len(prefix) and "items" in node and not finite(node["items"], inside):
                return False
        return True

    return finite(schema, ())


JSON_SAFE_INTEGER = 2**53 - 1  # the largest integer every JSON reader holds exactly


def bounded_integers(schema: Any) -> Any:
    """`schema` with each integer type not bounded on a side bounded there by ±JSON_SAFE_INTEGER, so
    that generated integers end (a small model would otherwise write digits until max_tokens); larger
    integers would not survive most JSON readers anyway. The caller's schema is not changed."""
    if isinstance(schema, list):
        return [bounded_integers(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_integers(v) for k, v in schema.items()}
    kind = out.get("type")
    if kind == "integer" or isinstance(kind, list) and "integer" in kind and "number" not in kind:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -JSON_SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = JSON_SAFE_INTEGER
    return out
