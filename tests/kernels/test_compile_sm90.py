"""The decode path's kernels compile for sm_90 (the H200) at the configurations the engine launches, on a
machine without a GPU (`tests/compile_cases.py sm_90 --set sm90`, in a process of its own: this one
interprets the kernels).
The interpreter checks the kernels' semantics but not their compile, which can refuse a kernel only on
the device (a plain float global). This machine's Triton may be newer than the device's, so a pass here
is a strong hint, not proof.

Spill counts are recorded (`spills`) but asserted only where a kernel had none and its speed was
measured that way. Two ways of avoiding spills are slower on the H200: the IQ3_S dp4a GEMV written to
spill less (1.22-1.38x slower at M = 1), and 32-key decode tiles for heads of 256 (64-key tiles, which
spill in this compile, run 12-15% faster at 4K and 32K keys). So for those kernels the tests assert
what they compile to, and the tiles follow the device's sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not all(os.path.exists(os.path.join(TOOLS, t)) for t in ("ptxas", "nvdisasm")),
                                reason="Triton's NVIDIA backend tools are not installed")


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "compile_cases.py")
    run = subprocess.run([sys.executable, script, "sm_90", "--set", "sm90"], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _case(compiled: dict, name: str) -> dict:
    case = compiled[name]
    assert case["error"] is None, case["error"]
    return case


@pytest.mark.parametrize("name", ["gemv_bf16_qkv", "gemv_bf16_down"])
def test_bf16_gemv_on_tensor_cores(compiled, name):
    ops = _case(compiled, name)["ops"]
    assert "HGMMA" in ops or "HMMA" in ops  # the swap-AB product


@pytest.mark.parametrize("name", [f"dp4a_{f}_m{m}" for f in ("Q8_0", "Q4_K", "Q6_K") for m in (1, 4)])
def test_dp4a_gemvs_use_packed_dots(compiled, name):
    assert "IDP" in _case(compiled, name)["ops"]


@pytest.mark.parametrize("name", [f"dp4a_IQ3_S_{n}_m{m}" for n in (6144, 4096) for m in (1, 4, 8)])
def test_iq3s_dp4a_gemv_uses_packed_dots_and_gathers_the_grid_from_shared_memory(compiled, name):
    """The grid words come from the table in shared memory (tl.gather lowers to shared loads)."""
    ops = _case(compiled, name)["ops"]
    assert "IDP" in ops and "LDS" in ops


@pytest.mark.parametrize("name", ["attention_decode_h256", "attention_decode_h256_int8"])
def test_decode_attention_on_heads_of_256_uses_mma_tiles(compiled, name):
    ops = _case(compiled, name)["ops"]
    assert "HMMA" in ops and "ATOMG" in ops  # MMA tiles, split tickets


def test_decode_attention_on_heads_of_128(compiled):
    case = _case(compiled, "attention_decode_h128")
    assert "HMMA" in case["ops"] and "ATOMG" in case["ops"] and case["spills"] == 0  # MMA tiles, split tickets


def test_router_of_512_experts(compiled):
    assert "ATOMG" in _case(compiled, "router_e512")["ops"]  # the last program's ticket


@pytest.mark.parametrize("name", ["gemv_fp8_qkv", "gemv_fp8_down"])
def test_fp8_gemv_converts_in_registers(compiled, name):
    case = _case(compiled, name)
    assert ("HGMMA" in case["ops"] or "HMMA" in case["ops"]) and case["spills"] == 0


@pytest.mark.parametrize("name", ["fp8_rows_quantize", "fp8_rows_silu_mul_quantize", "rms_norm_add", "rms_norm_add_zero_centred",
                                  "qk_norm_rope", "qk_norm_rope_partial"])
def test_row_kernels_compile(compiled, name):
    """One program a row, no spills."""
    assert _case(compiled, name)["spills"] == 0


@pytest.mark.parametrize("name", ["moe_gate_up_30b", "moe_down_30b", "moe_gate_up_next", "moe_down_next",
                                  "shared_expert_add", "shared_expert_append"])
def test_fused_moe_decode_kernels_compile(compiled, name):
    """Qwen3-30B-A3B's (I = 768) and Qwen3-Next's (I = 512) expert sizes; Qwen3-Next's gated shared expert."""
    _case(compiled, name)


@pytest.mark.parametrize("name", [f"qmoe_{kernel}_{fmt}" for fmt in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "FP8")
                                  for kernel in ("gate_up", "down")])
def test_quantized_moe_decode_multiplies_on_cuda_cores(compiled, name):
    """One activation row a pair: the dequantized tiles meet it in FFMAs, with no MMA padding x to 16 rows."""
    ops = _case(compiled, name)["ops"]
    assert "FFMA" in ops and not any(op.startswith(("HMMA", "HGMMA")) for op in ops)


@pytest.mark.parametrize("name", ["qmoe_gate_up_Q8_0", "qmoe_down_Q8_0"])
def test_quantized_moe_decode_q8_takes_packed_dots(compiled, name):
    """Q8_0's default tiles are dp4a's; its dequantized ones stay FFMAs (`qmoe_*_Q8_0_fma`)."""
    assert "IDP" in _case(compiled, name)["ops"] and "IDP" not in _case(compiled, name + "_fma")["ops"]


@pytest.mark.parametrize("name", ["qmoe_gate_up_IQ3_S_dp4a", "qmoe_down_IQ3_S_dp4a"])
def test_quantized_moe_decode_iq3s_dp4a_tiles_use_packed_dots(compiled, name):
    assert "IDP" in _case(compiled, name)["ops"] and "IDP" not in _case(compiled, name[:-5])["ops"]
