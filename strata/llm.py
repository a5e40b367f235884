"""The offline Python API, in the shape vLLM users know:

    from strata import LLM, SamplingParams
    llm = LLM()                       # the embedded default model
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    out[0].outputs[0].text, out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from strata.config import EngineConfig
from strata.loaders import load_model
from strata.runner.generator import Completion, Generator
from strata.runner.sampling import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(_DTYPES)})") from None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                 ctx: int = EngineConfig.ctx, progress: bool = False):
        self.engine_config = EngineConfig(model=model, device=device, dtype=dtype, ctx=ctx)
        dev = torch.device(self.engine_config.resolved_device)
        dt = torch_dtype(self.engine_config.resolved_dtype)
        loaded = load_model(model, device=dev, dtype=dt, progress=progress)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{loaded.path}: the model has no tokenizer; pass token ids instead of text")
        self.generator = Generator(self.model, self.tokenizer, min(ctx, self.config.max_position_embeddings), dev, dt)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results = []
        for prompt in prompts:
            text, ids = self._prompt_ids(prompt)  # type: ignore[arg-type]
            c: Completion = self.generator.generate(ids, params)
            results.append(RequestOutput(text, ids, [CompletionOutput(0, c.text, c.token_ids, c.finish_reason)]))
        return results

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special=False)
        return self.generate([ids], sampling_params)[0]
