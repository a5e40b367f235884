"""`--chat-template NAME|FILE|TEXT` and `--chat-template-file FILE`: a chat template to use instead of
the model's. The names are llama.cpp's for the common layouts, written as Jinja templates (each message's
content trimmed, as llama.cpp's built-ins do)."""

from __future__ import annotations

import os

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama2": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[INST] <<SYS>>\n{{ m['content'] | trim }}"
        "\n<</SYS>>\n\n{% elif m['role'] == 'user' %}{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] "
        "!= 'system' %}[INST] {% endif %}{{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] | trim }} "
        "{{ eos_token }}{% endif %}{% endfor %}"),
    "llama3": (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"),
    "command-r": (
        "{% for m in messages %}<|START_OF_TURN_TOKEN|>{% if m['role'] == 'system' %}<|SYSTEM_TOKEN|>"
        "{% elif m['role'] == 'user' %}<|USER_TOKEN|>{% else %}<|CHATBOT_TOKEN|>{% endif %}{{ m['content'] | trim }}"
        "<|END_OF_TURN_TOKEN|>{% endfor %}{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        "{% endif %}"),
    "gemma": (
        "{% set sys = namespace(text='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% set sys.text = sys.text + (m['content'] | trim) + '\n\n' %}{% else %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ sys.text }}{{ m['content'] | trim }}"
        "<end_of_turn>\n{% set sys.text = '' %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "zephyr": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "mistral-v7": (
        "{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT] {{ m['content'] | trim }}"
        "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST] {{ m['content'] | trim }}[/INST]"
        "{% else %} {{ m['content'] | trim }}</s>{% endif %}{% endfor %}"),
    "vicuna": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] | trim }}\n\n"
        "{% elif m['role'] == 'user' %}USER: {{ m['content'] | trim }}\n{% else %}ASSISTANT: "
        "{{ m['content'] | trim }}</s>\n{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
}


def resolve_chat_template(name_or_text: str | None, path: str | None) -> str | None:
    """The template text `--chat-template` / `--chat-template-file` ask for, or None for the model's
    own; ValueError naming the problem."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"chat_template_file: cannot read {path!r}: {e.strerror}") from None
    if name_or_text is None:
        return None
    if name_or_text in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name_or_text]
    if os.path.isfile(name_or_text):
        return resolve_chat_template(None, name_or_text)
    if "{{" in name_or_text or "{%" in name_or_text:
        return name_or_text
    raise ValueError(f"chat_template: {name_or_text[:80]!r} is neither a built-in name "
                     f"({', '.join(BUILTIN_TEMPLATES)}), a file, nor a Jinja template")
