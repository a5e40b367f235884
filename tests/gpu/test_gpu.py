"""The model comparisons on CUDA: fp32 must match HF as on the CPU; bf16 is held to tolerances
measured on the H200 (docs/ARCHITECTURE.md, "Numerics"). Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from strata.loaders import load_model
from strata.attention import CausalBatch
from strata.runner.generator import Generator
from strata.sampling import SamplingParams
from tiny_models import ARCH_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# bf16 logits vs HF fp32, max relative error over seeds 0-3, measured on the H200: qwen3 8.5e-3,
# qwen3_moe 2.6e-2, glm4_moe 7.3e-2 (bf16 rounding flips near-tied expert choices, most often under
# GLM's sigmoid routing with a 2.5x routed scale). Limits are about twice the measurement.
# qwen3_next: not measured yet (its first GPU run prints it); the qwen3_moe limit until then.
BF16_REL_TOL = {"qwen3": 2e-2, "qwen3_moe": 5e-2, "glm4_moe": 1.5e-1, "qwen3_next": 5e-2}
# bf16 greedy decoding may flip near-tied argmaxes; fraction of the 32 tokens before the first flip.
BF16_MIN_PREFIX_AGREEMENT = 0.25


def _logits(lm, ids, device):
    ids = ids.to(device)
    with torch.no_grad():
        h = lm.model(ids, torch.arange(len(ids), device=device), CausalBatch(1, len(ids)))
        return lm.model.compute_logits(h).cpu()


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_cuda_fp32_matches_hf(arch, tiny_model_dirs):
    path, hf = tiny_model_dirs[arch]
    lm = load_model(path, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, 320, (40,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # TF32 is off by default for matmuls in torch; allow for cuBLAS vs CPU summation order.
    err = ((_logits(lm, ids, "cuda") - ref).abs().max() / ref.abs().max()).item()
    print(f"{arch} cuda fp32 rel err {err:.2e}")
    assert err < 1e-4
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator(lm.model, lm.tokenizer, 128, torch.device("cuda"), torch.float32)
    assert gen.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True)).token_ids == want


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_cuda_bf16_within_measured_tolerance(arch, tiny_model_dirs):
    path, hf = tiny_model_dirs[arch]
    lm = load_model(path, device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    for seed in range(4):
        torch.manual_seed(seed)
        ids = torch.randint(0, 320, (40,))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        worst = max(worst, ((_logits(lm, ids, "cuda") - ref).abs().max() / ref.abs().max()).item())
    print(f"{arch} cuda bf16 max rel err {worst:.2e}")
    assert worst < BF16_REL_TOL[arch]
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator(lm.model, lm.tokenizer, 128, torch.device("cuda"), torch.bfloat16)
    got = gen.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True)).token_ids
    prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), 32)
    print(f"{arch} cuda bf16 greedy: first {prefix}/32 tokens equal HF fp32")
    assert prefix / 32 >= BF16_MIN_PREFIX_AGREEMENT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_embedding_rows_in_a_cuda_graph(dtype):
    """`QuantizedEmbedding` on CUDA for every kept format: a step's rows (its index_select and the
    format's dequantization) captured in a CUDA graph and replayed over new ids give the rows of the
    table dequantized whole."""
    from strata.kernels.quant import FORMATS, QWeight, random_blocks
    from strata.models.layers import QuantizedEmbedding

    gen = torch.Generator("cuda").manual_seed(0)
    for fmt in FORMATS:
        n, k = 1000, 512
        emb = QuantizedEmbedding(QWeight.from_raw(fmt, random_blocks(fmt, n, k, gen, "cuda"), n, k), dtype)
        table = emb.q.dequantize().to(dtype)
        ids = torch.randint(0, n, (24,), device="cuda", generator=gen)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            emb(ids)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = emb(ids)
        ids.copy_(torch.randint(0, n, (24,), device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table[ids]), fmt
