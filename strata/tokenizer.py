"""Tokenizers and chat templates.

Every tokenizer is a `tokenizers.Tokenizer` (built from `tokenizer.json`, or from a GGUF vocabulary by
`strata.loaders.gguf_vocab`) plus the few facts the engine needs: BOS/EOS ids, whether BOS is
prepended, and the chat template. Chat templates come from model files, which are untrusted input, so
they are rendered in jinja2's `SandboxedEnvironment`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: the ChatML layout most open models use.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Template variables the renderer sets itself, which `chat_template_kwargs` may not replace.
TEMPLATE_RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    pass


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> Any:
    """`source` compiled in the sandbox (a jinja2 TemplateSyntaxError when it does not parse)."""
    # loopcontrols: {% break %} / {% continue %}, which transformers' renderer allows and templates use.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    # Llama 3.x templates write today's date into the system turn (transformers gives them the same).
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
    return env.from_string(source)


def render_chat_template(source: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         add_generation_prompt: bool, bos_token: str, eos_token: str,
                         template_kwargs: dict[str, Any], max_chars: int | None = None) -> str:
    """The prompt text for `messages` under the template `source` (None: DEFAULT_CHAT_TEMPLATE); a
    ChatTemplateError once the output passes `max_chars` characters (checked as it is written)."""
    clash = TEMPLATE_RESERVED_NAMES & template_kwargs.keys()
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
    template = compile_chat_template(source or DEFAULT_CHAT_TEMPLATE)
    pieces, size = [], 0
    for piece in template.generate(**template_kwargs, messages=messages_for_template(messages), tools=tools or None,
                                   add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                                   eos_token=eos_token):
        size += len(piece)
        if max_chars is not None and size > max_chars:
            raise ChatTemplateError(f"the rendered prompt is longer than {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: an assistant message's `tool_calls` carry their
    `function.arguments` as an object (OpenAI sends a JSON string; templates iterate or re-serialize
    it). Arguments that are not a JSON object stay as sent. The caller's messages are not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


@dataclass
class Tokenizer:
    tk: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    extra_stop_ids: tuple[int, ...] = field(default=())

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.eos_ids) | frozenset(self.extra_stop_ids)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-shaped dicts). `tools` (OpenAI's list of
        `{"type": "function", "function": {...}}`) reaches the template as `tools`; `template_kwargs`
        (a request's `chat_template_kwargs`, e.g. `enable_thinking=False`) as variables of their own."""
        return render_chat_template(self.chat_template, messages, tools, add_generation_prompt, self.bos_token,
                                    self.eos_token, template_kwargs)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, eos_ids_from_config: Sequence[int] = ()) -> "Tokenizer":
        path = os.fspath(path)
        tk = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)

        def tok_str(v: Any) -> str:
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        bos_token, eos_token = tok_str(cfg.get("bos_token")), tok_str(cfg.get("eos_token"))
        bos_id = tk.token_to_id(bos_token) if bos_token else None
        eos = list(eos_ids_from_config)
        if eos_token and tk.token_to_id(eos_token) is not None and tk.token_to_id(eos_token) not in eos:
            eos.append(tk.token_to_id(eos_token))
        template = cfg.get("chat_template")
        tpl_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(tpl_file):
            with open(tpl_file) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # The chat end-of-turn token stops generation even when the config names another EOS; GLM ends
        # a turn that calls tools with <|observation|>.
        turn_ends = ("<|im_end|>", "<|endoftext|>", "<|user|>", "<|observation|>")
        extra = tuple(i for t in turn_ends if (i := tk.token_to_id(t)) is not None)
        return cls(
            tk=tk,
            bos_id=bos_id,
            eos_ids=tuple(eos),
            add_bos=bool(cfg.get("add_bos_token", False)) and bos_id is not None,
            chat_template=template,
            bos_token=bos_token,
            eos_token=eos_token,
            extra_stop_ids=extra,
        )
