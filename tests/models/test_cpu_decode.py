"""The CPU decode path's shortcuts give the floats of the steps they replace: q and k normed and rotated
as one stack, the norm as torch's op, a decode step's MoE pairs on views of the stacked experts, the
attention layout of a step whose sequences end together, whole-block K/V gathers, and one thread for
short steps."""

from __future__ import annotations

import copy

import pytest
import torch

from strata import LLM, SamplingParams
from strata.attention.reference import PagedAttention, sdpa
from strata.config import ModelConfig
from strata.kvcache.pool import DensePool, Int8Pool
from strata.models.layers import Attention, RopeInputs, Rotary, apply_rotary, rms_norm
from strata.models.moe import MoE
from strata.runner import model_runner

GLM = dict(model_type="glm4_moe", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, scoring="sigmoid", n_shared_experts=1)


def _reference_norm(x, w, eps):
    dtype = x.dtype
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_norm_and_rotation_give_the_same_floats(rows):
    torch.manual_seed(rows)
    qk = torch.randn(rows, 512)[:, :384].view(rows, 6, 64) * 3  # q|k heads, a view of a wider qkv row
    w = torch.randn(64)
    assert torch.equal(rms_norm(qk, w, 1e-6), _reference_norm(qk, w, 1e-6))
    stacked = torch.randn(6, 64)
    assert torch.equal(rms_norm(qk, stacked, 1e-6), _reference_norm(qk, stacked, 1e-6))
    for partial in (0.5, 1.0):
        rotary = Rotary(ModelConfig(**{**GLM, "head_dim": 64}, partial_rotary_factor=partial))
        rope = RopeInputs(torch.randint(0, 4000, (rows,)), rotary, torch.float32)
        assert torch.equal(rope.rotate(qk), apply_rotary(qk, *rope.cos_sin()))


def test_attention_stack_equals_separate_heads():
    """q and k normed and rotated as one stack: the floats of normalising and rotating each by itself."""
    torch.manual_seed(0)
    cfg = ModelConfig(**GLM, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)
    attn = Attention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    attn.requires_grad_(False).pack()
    got = []

    class Capture:
        def attend(self, layer, q, k, v):
            got.extend((q, k, v))
            return q

    x = torch.randn(7, 64)
    rope = RopeInputs(torch.arange(7) + 100, Rotary(cfg), torch.float32)
    with torch.inference_mode():
        attn(x, rope, Capture())
        q, k, v = torch.nn.functional.linear(x, attn.qkv_weight, attn.qkv_bias).split([64, 32, 32], dim=-1)
        q, k, v = q.reshape(7, 4, 16), k.reshape(7, 2, 16), v.reshape(7, 2, 16)
        cos, sin = rope.cos_sin()
        want = (apply_rotary(_reference_norm(q, attn.q_norm.weight, cfg.rms_norm_eps), cos, sin),
                apply_rotary(_reference_norm(k, attn.k_norm.weight, cfg.rms_norm_eps), cos, sin), v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_decode_pairs_equal_the_grouped_path():
    torch.manual_seed(1)
    moe = MoE(ModelConfig(**GLM))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    moe.requires_grad_(False).pack_experts()
    for t in (1, 3):
        x = torch.randn(t, 64)
        w, ids, _ = moe.gate(x)
        with torch.inference_mode():
            got, ref = moe._picked(x, w, ids), moe._grouped(x, w, ids)
        # One token: each expert's product is the grouped path's one-row product, the same floats.
        assert torch.equal(got, ref) if t == 1 else torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def _dense_attention(q, keys, values, qpos):
    """SDPA of each query over the keys at positions 0..qpos, one sequence."""
    mask = torch.arange(keys.shape[0])[None] <= qpos[:, None]
    return sdpa(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], causal=False,
                mask=mask[None, None])[0].transpose(0, 1)


@pytest.mark.parametrize("int8", [False, True])
def test_paged_layouts_match_dense_attention(int8):
    """Decodes of sequences as long as each other (no row maps, no mask), one sequence's chunk (a
    causal mask only) and a mixed step (the general layout), over shuffled blocks whose slots past each
    context hold other data: every path reads the same keys."""
    torch.manual_seed(2)
    bs, hkv, hq, d = 4, 2, 4, 8
    pool = Int8Pool(1, 40, bs, hkv, d, "cpu") if int8 else DensePool(1, 40, bs, hkv, d, "cpu", torch.float32)
    for store in (pool.k, pool.v):  # other data everywhere a step does not write
        store.copy_(torch.randint(-127, 128, store.shape) if int8 else torch.randn(store.shape))
    if int8:
        pool.k_scale.uniform_(0.01, 0.1), pool.v_scale.uniform_(0.01, 0.1)
    tables = torch.randperm(39).add(1).view(3, 13).int()  # three sequences, blocks shuffled, never block 0
    ctx = [23, 23, 9]
    full_k = [torch.randn(c, hkv, d) for c in ctx]
    full_v = [torch.randn(c, hkv, d) for c in ctx]
    attn = PagedAttention(pool)

    def slots(r, positions):
        return torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in positions])

    def step(seqs):  # [(sequence, first new position, new tokens)]
        # The cache holds every position before the step; the step writes its own.
        for r, s, n in seqs:
            pool.write(0, slots(r, range(s)), full_k[r][:s], full_v[r][:s])
        q = torch.randn(sum(n for _, _, n in seqs), hq, d)
        k = torch.cat([full_k[r][s : s + n] for r, s, n in seqs])
        v = torch.cat([full_v[r][s : s + n] for r, s, n in seqs])
        new_slots = torch.cat([slots(r, range(s, s + n)) for r, s, n in seqs])
        attn.prepare(new_slots, [s for _, s, _ in seqs], [n for _, _, n in seqs], tables[[r for r, _, _ in seqs]])
        out = attn.attend(0, q, k, v)
        rows = 0
        for r, s, n in seqs:
            keys, values = pool.gather(0, slots(r, range(s + n))[None], torch.float32)
            want = _dense_attention(q[rows : rows + n], keys[0], values[0], torch.arange(s, s + n))
            assert torch.allclose(out[rows : rows + n], want, atol=1e-5), (seqs, r)
            rows += n
        return attn

    assert step([(0, 22, 1), (1, 22, 1)]).mask is None and attn.q_rows is None  # decodes ending together
    assert step([(2, 4, 5)]).mask is not None and attn.q_rows is None  # one sequence's chunk
    assert step([(0, 20, 3), (2, 8, 1), (1, 22, 1)]).q_rows is not None  # mixed: the general layout


def test_short_cpu_steps_run_on_one_thread(monkeypatch):
    """Decode steps set one intra-op thread and a long prompt read gives the runner's count back; the
    tokens are those of a run on torch's threads."""
    threads = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.append(n), real(n)))
    before = torch.get_num_threads()
    try:
        llm = LLM(device="cpu", ctx=512, parallel=1)
        llm.engine.runner.cpu_threads = 2
        real(1)
        prompt = list(range(1, 2 + model_runner.CPU_ONE_THREAD_ROWS))  # longer than a one-thread step
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
        assert threads == [2, 1]  # the read on the runner's threads, then the decodes on one
        llm.engine.runner.cpu_threads = None  # the thread count left as it is
        again = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
        assert again == out
    finally:
        real(before)


def _glm_model(**overrides):
    from strata.models.registry import build_model

    torch.manual_seed(4)
    cfg = ModelConfig(**{**GLM, **overrides}, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.requires_grad_(False).eval()
    model.pack()
    return model


def _forward_and_logits(model, n: int, plans, head):
    """Hidden states and logits of n tokens with the blocks' `plans(layers)` and the LM head `head`."""
    from strata.attention.reference import CausalBatch
    from strata.models.decoder import DecoderLayer

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    saved, saved_head = [m.cpu_plan for m in layers], model.cpu_head
    for m, p in zip(layers, plans(layers)):
        m.cpu_plan = p
    model.cpu_head = head
    try:
        torch.manual_seed(n)
        ids, positions = torch.randint(0, 320, (n,)), torch.arange(n)
        with torch.inference_mode():
            hidden = model(ids, positions, CausalBatch(1, n))
            return hidden, model.compute_logits(hidden)
    finally:
        for m, p in zip(layers, saved):
            m.cpu_plan = p
        model.cpu_head = saved_head


@pytest.mark.parametrize("n", [1, 3])
def test_cpu_plan_without_kernels_gives_the_module_floats(n):
    """Without the C kernels a few-row CPU step's plan runs the modules' ops on the same operands: the
    same floats, whether the MoE takes the pairs (one token) or the module's path (three)."""
    from strata.models.decoder import CpuDecodePlan, cpu_product

    model = _glm_model()
    torch_plans = lambda layers: [CpuDecodePlan(m, None) for m in layers]  # noqa: E731
    got = _forward_and_logits(model, n, torch_plans, cpu_product(None, model.lm_head.weight))
    want = _forward_and_logits(model, n, lambda layers: [None] * len(layers), None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("n", [1, 3])
def test_cpu_plan_with_kernels_agrees_to_rounding(n):
    from strata.models.decoder import cpu_kernels

    model = _glm_model()
    if cpu_kernels() is None:
        pytest.skip("no C compiler to build the CPU decode kernels")
    assert all(m.cpu_plan is not None and m.cpu_plan.kernels is not None for m in model.model.layers)
    assert model.cpu_head is not None
    got = _forward_and_logits(model, n, lambda layers: [m.cpu_plan for m in layers], model.cpu_head)
    want = _forward_and_logits(model, n, lambda layers: [None] * len(layers), None)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_embedded_model_greedy_tokens_with_and_without_the_kernels():
    """The C kernels change the floats at fp32 rounding, not the embedded model's greedy tokens."""
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], list(range(100, 132))]
    outs = []
    for on in (True, False):
        llm = LLM(device="cpu", ctx=512, parallel=2, cpu_kernels=on)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True))])
    assert outs[0] == outs[1]


def test_a_copied_or_pickled_model_drops_the_plans():
    """The plans hold copies of the weights as packed: a copy of the model (which may change its weights)
    gets none until it is packed again."""
    import io

    model = _glm_model()
    for clone in (copy.deepcopy(model), torch.load(_saved(model, io.BytesIO()), weights_only=False)):
        assert clone.cpu_head is None and all(m.cpu_plan is None for m in clone.model.layers)
        clone.pack()
        assert clone.cpu_head is not None and all(m.cpu_plan is not None for m in clone.model.layers)


def _saved(model, buf):
    torch.save(model, buf)
    buf.seek(0)
    return buf
