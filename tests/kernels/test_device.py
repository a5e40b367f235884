"""Launch configurations as functions of the device (`strata.kernels.device`): the reference's (sm_90,
132 SMs) are the tuned ones, others follow the same rules on their own SM count, shared memory and
capability. Host arithmetic only; tests/kernels/test_compile_consumer.py compiles the results."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.kernels import attention, device, gemv
from strata.kernels.device import PRESETS, REFERENCE, SM80, SM86, SM89, SM90
from strata.kernels.quant import dp4a, fp8, iq3_s_dp4a, q4_k, q8_0

CONSUMER = (SM80, SM86, SM89)


def test_presets():
    assert [(s.arch, s.sm_count, s.smem_per_block >> 10) for s in (SM80, SM86, SM89, SM90)] == [
        (80, 108, 163), (86, 82, 99), (89, 128, 99), (90, 132, 227)]
    assert [(s.wgmma, s.fp8, s.pdl) for s in (SM80, SM86, SM89, SM90)] == [
        (False, False, False), (False, False, False), (False, True, False), (True, True, True)]
    assert REFERENCE is SM90 and device.tuned(SM90)
    assert not any(device.tuned(s) for s in CONSUMER)
    assert not device.tuned(dataclasses.replace(SM90, sm_count=114))  # an H100 PCIe: the rules, not the tables


def test_current_off_cuda_is_the_reference_unless_chosen():
    if not torch.cuda.is_available():
        assert device.current() is REFERENCE
    assert device.current(torch.zeros(1)) is REFERENCE and device.current("cpu") is REFERENCE
    with device.using(SM86):
        assert device.current() is SM86
        assert device.current(torch.zeros(1)) is REFERENCE  # a tensor's own device wins
        assert gemv.gemv_config(6144, 4096) == gemv.gemv_config(6144, 4096, SM86)
    assert device.current() is not SM86


def test_fit_stages_counts_the_buffers_triton_keeps():
    """num_stages - 1 stages' loads sit in shared memory (the compiled kernels' `shared`)."""
    assert device.fit_stages(SM86, 4, 20 << 10) == 4  # 60 KiB
    assert device.fit_stages(SM86, 6, 40 << 10) == 3  # 80 KiB
    assert device.fit_stages(SM86, 6, 120 << 10) == 2  # never fewer than 2


def test_the_reference_keeps_the_tuned_tables():
    for (n, k), cfg in gemv.GEMV_CONFIGS.items():
        assert gemv.gemv_config(n, k, SM90) == cfg
    for (n, k), cfg in fp8.GEMV_CONFIGS.items():
        assert fp8.gemv_config(n, k, SM90) == cfg
    for (n, k), cfg in q4_k.GEMV_CONFIGS.items():
        assert q4_k.gemv_config(n, k, SM90) == cfg
    for (n, k), cfg in q8_0.GEMV_CONFIGS.items():
        assert q8_0.gemv_config(n, k, SM90) == cfg
    assert attention.select_config(1, 4, spec=SM90) == dataclasses.replace(attention.DECODE_CONFIG, kv_tile=64)
    assert attention.select_config(2048, 4, spec=SM90) == dataclasses.replace(attention.PREFILL_CONFIG, kv_tile=128)
    assert iq3_s_dp4a.gemv_config(6144, 4096, SM90).num_warps == 4


@pytest.mark.parametrize("spec", CONSUMER, ids=lambda s: f"sm_{s.arch}")
def test_splits_follow_the_sm_count(spec):
    """The sm_90 rules on the device's SMs: the dp4a GEMVs about 4 programs an SM, the bf16 GEMV's
    heuristic no more than 2."""
    for n, k in ((4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)):
        cfg = dp4a.gemv_config(n, k, spec)
        limit = max(1, min(dp4a.PROGRAMS_PER_SM * spec.sm_count // -(-n // 64), k // 256 // 2, dp4a.MAX_SPLIT))
        assert cfg.split_k == 1 << (limit.bit_length() - 1)
        g = gemv.gemv_config(n, k, spec)
        assert g.split_k == 1 or -(-n // g.block_n) * g.split_k <= 2 * spec.sm_count
    # Q4_K's rule (its table is the reference's): 64-row tiles, about 3 programs an SM.
    assert q4_k.gemv_config(4096, 4096, spec).split_k == max(1, min(3 * spec.sm_count // 64, 4096 // 128 // 2))


@pytest.mark.parametrize("spec", CONSUMER, ids=lambda s: f"sm_{s.arch}")
def test_mma_sync_devices_take_their_own_attention_tiles(spec):
    for q_len, group, int8, head_dim in ((1, 4, False, 128), (2048, 4, False, 128), (2048, 4, True, 128),
                                         (1, 8, False, 256), (2048, 8, False, 256)):
        cfg = attention.select_config(q_len, group, int8, False, head_dim, False, spec)
        assert cfg.block_m <= 128 and cfg.kv_tile <= 128 and cfg != attention.select_config(
            q_len, group, int8, False, head_dim, False, SM90), (q_len, group, int8, head_dim)


@pytest.mark.parametrize("spec", (SM80, SM86), ids=("sm_80", "sm_86"))
def test_fp8_weights_refused_without_e4m3(monkeypatch, spec):
    """Before sm_89 the FP8 kernels do not compile (tests/kernels/test_compile_consumer.py): the weights
    are refused at load, with the reason, instead of failing in Triton's compiler."""

    class OnCuda(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(device, "current", lambda d=None: spec)
    with pytest.raises(RuntimeError, match="sm_89"):
        fp8._quantize_rows(torch.zeros(2, 64).as_subclass(OnCuda))
