"""The packed (grouped-matmul, sync-free) MoE path against the per-expert loop it replaces."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from strata.config import ModelConfig
from strata.loaders import load_model
from strata.attention import CausalBatch
from strata.models.moe import MoE
from strata.models.registry import build_model

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32)
ROUTERS = {
    "softmax": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "softmax_k4": dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
    "sigmoid": dict(model_type="glm4_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    scoring="sigmoid", n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def random_moe(router: str, seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(ModelConfig(**BASE, **ROUTERS[router]))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe.requires_grad_(False).eval()


def storage_bytes(module: torch.nn.Module) -> int:
    seen = {}
    for t in list(module.parameters()) + list(module.buffers()):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("router", list(ROUTERS))
def test_packed_equals_loop(router):
    loop = random_moe(router, seed=0)
    packed = copy.deepcopy(loop)
    assert packed.pack_experts() == "grouped" and packed.path == "grouped"
    assert loop.path == "loop"
    worst = 0.0
    empty_seen = False
    for t in (1, 3, 37):
        for trial in range(3):
            x = torch.randn(t, BASE["hidden_size"])
            ids = loop.gate(x)[1]
            empty_seen |= bool((torch.bincount(ids.flatten(), minlength=loop.num_experts) == 0).any())
            with torch.no_grad():
                ref, got = loop(x), packed(x)
            assert got.dtype == ref.dtype == x.dtype and got.shape == ref.shape
            worst = max(worst, rel_err(got, ref))
    print(f"{router}: max relative difference packed vs loop {worst:.2e}")
    assert empty_seen
    assert worst < 1e-6


def test_no_tokens():
    moe = random_moe("sigmoid", seed=1)
    moe.pack_experts()
    with torch.no_grad():
        out = moe(torch.randn(0, BASE["hidden_size"]))
    assert out.shape == (0, BASE["hidden_size"])


def test_bf16_packed_close_to_loop():
    loop = random_moe("softmax", seed=2).to(torch.bfloat16)
    packed = copy.deepcopy(loop)
    assert packed.pack_experts() == "grouped"
    x = torch.randn(37, BASE["hidden_size"], dtype=torch.bfloat16)
    with torch.no_grad():
        ref, got = loop(x), packed(x)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), ref.float()) < 2e-2


def test_packing_keeps_weights_and_memory():
    moe = random_moe("sigmoid", seed=3)
    before = {n: p.clone() for n, p in moe.named_parameters()}
    bytes_before = storage_bytes(moe)
    moe.pack_experts()
    for n, p in moe.named_parameters():
        assert torch.equal(p, before[n]), n
    w13_ptr, w2_ptr = moe.w13.untyped_storage().data_ptr(), moe.w2.untyped_storage().data_ptr()
    for m in moe.experts:
        assert m.gate_proj.weight.untyped_storage().data_ptr() == w13_ptr
        assert m.up_proj.weight.untyped_storage().data_ptr() == w13_ptr
        assert m.down_proj.weight.untyped_storage().data_ptr() == w2_ptr
    # The stacks replace the per-expert tensors; a copy beside them would add ~all expert bytes.
    assert storage_bytes(moe) <= bytes_before * 1.01
    # The checkpoint names are unchanged: the stacks are not saved.
    assert set(moe.state_dict()) == set(before) | {"gate.e_score_correction_bias"}


def test_trainable_experts_stay_on_loop():
    moe = random_moe("softmax", seed=4).requires_grad_(True)
    assert moe.pack_experts() == "loop" and moe.w13 is None


def _count_host_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            calls.append(_name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return calls


@pytest.mark.parametrize("router", list(ROUTERS))
def test_grouped_path_reads_nothing_on_host(router, monkeypatch):
    """On CPU a device sync cannot be observed, but a host read of a tensor value can: the loop path
    makes one (the detector works), the packed path none."""
    loop = random_moe(router, seed=5)
    packed = copy.deepcopy(loop)
    packed.pack_experts()
    x = torch.randn(37, BASE["hidden_size"])
    calls = _count_host_reads(monkeypatch)
    with torch.no_grad():
        loop(x)
        assert "tolist" in calls
        calls.clear()
        packed(x)
    assert packed.path == "grouped" and calls == []


def test_loader_packs_every_moe_including_mtp(tiny_model_dirs, tmp_path):
    src, _ = tiny_model_dirs["glm4_moe"]
    cfg = ModelConfig.from_file(f"{src}/config.json")
    torch.manual_seed(6)
    donor = build_model(cfg, with_mtp=True)
    sd = donor.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            if k.endswith("norm.weight"):
                v.add_(0.1 * torch.randn_like(v))
            else:
                v.normal_(0, 0.05)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes(open(f"{src}/{f}", "rb").read())

    packed, plain = load_model(str(tmp_path)), load_model(str(tmp_path), pack_experts=False)
    assert packed.has_mtp
    moes = [m for m in packed.model.modules() if isinstance(m, MoE)]
    assert len(moes) == 3 and isinstance(packed.model.mtp_layers[0].mlp, MoE)
    assert all(m.path == "grouped" for m in moes)
    assert all(m.path == "loop" for m in plain.model.modules() if isinstance(m, MoE))

    ids = torch.randint(0, cfg.vocab_size, (40,))
    pos = torch.arange(40)
    with torch.no_grad():
        outs = []
        for lm in (packed.model, plain.model):
            h = lm(ids, pos, CausalBatch(1, 40))
            outs.append((lm.compute_logits(h), lm.mtp_forward(h, ids, pos, CausalBatch(1, 40))[1]))
    for got, ref in zip(outs[0], outs[1]):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_packed_forward_does_not_sync():
    """bf16 is what the grouped CUDA kernels are built for. (fp32 on CUDA may fall back to a kernel
    that reads the offsets on the host; the probe then keeps the loop path.)"""
    loop = random_moe("sigmoid", seed=7).to("cuda", torch.bfloat16)
    packed = copy.deepcopy(loop)
    assert packed.pack_experts() == "grouped"
    x = torch.randn(37, BASE["hidden_size"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        packed(x)  # warm up: first calls may load kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = packed(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rel_err(got.float(), loop(x).float()) < 3e-2


@pytest.mark.parametrize("router", list(ROUTERS))
def test_masked_path_equals_loop(router):
    """The sync-free fallback CUDA uses where grouped_mm cannot serve (fp32): every expert over every
    token with zero weights where not routed gives the loop's result."""
    loop = random_moe(router, seed=3)
    masked = copy.deepcopy(loop)
    masked.pack_experts()
    masked.path = "masked"
    for t in (1, 5, 29):
        x = torch.randn(t, BASE["hidden_size"])
        with torch.no_grad():
            assert rel_err(masked(x), loop(x)) < 1e-6
