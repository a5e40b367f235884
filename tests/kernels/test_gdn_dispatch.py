"""Which delta-rule kernel a Qwen3-Next read takes (the kernel choice `linear_attention_kernel`): fla-core
on CUDA when asked, or by default when it is installed; the torch reference on the CPU and for 'ref'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strata.kernels import choices, gated_delta

CUDA_LIKE = SimpleNamespace(is_cuda=True)


@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize("choice, on_cuda", [("auto", None), ("fla", True), ("ref", False)])
def test_choice_and_installation(monkeypatch, installed, choice, on_cuda):
    monkeypatch.setattr(gated_delta, "fla_installed", lambda: installed)
    with choices.using(linear_attention_kernel=choice):
        assert gated_delta.use_fla(CUDA_LIKE) is (installed if on_cuda is None else on_cuda)
        assert gated_delta.use_fla(torch.zeros(1)) is False  # the CPU always runs the reference


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto"), choices.using(linear_attention_kernel="triton"):
        pass
