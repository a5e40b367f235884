"""The decode and read paths' kernels compile for the cards most users run (sm_80 A100, sm_86 RTX 3090,
sm_89 RTX 4090) at the configurations the engine computes for each (`strata.kernels.device.PRESETS`:
SM count, shared memory per block, capability), on a machine without a GPU: `tests/compile_cases.py
TARGET --set consumer`, one process a target, the three at once (this process interprets the kernels).

Each case must compile for its target, ask for no more shared memory per block than the card has, and
spill no registers. A kernel that needs a capability the card lacks (`compile_cases.NEEDS`: FP8's e4m3
conversions before sm_89) must be refused by the compile, and the engine refuses FP8 weights there
(`quant.fp8._quantize_rows`, tests/kernels/test_device.py), so it never launches. As in
test_compile_sm90.py, this machine's Triton may differ from the one a device runs: a pass is a strong
hint, not proof."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from strata.kernels.device import PRESETS  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not all(os.path.exists(os.path.join(TOOLS, t)) for t in ("ptxas", "nvdisasm")),
                                reason="Triton's NVIDIA backend tools are not installed")

TARGETS = ("sm_80", "sm_86", "sm_89")
HOPPER_ONLY = ("HGMMA", "UTMA", "WARPGROUP", "SYNCS")  # wgmma, TMA, warp-group and mbarrier instructions


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "compile_cases.py")
    runs = {t: subprocess.Popen([sys.executable, script, t, "--set", "consumer"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for t in TARGETS}
    out = {}
    for target, run in runs.items():
        stdout, stderr = run.communicate(timeout=900)
        assert run.returncode == 0, f"{target}: {stderr[-4000:]}"
        out[target] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_fits_the_card(compiled, target):
    """Compiles, within the card's shared memory per block, without spills, and with no Hopper-only
    instruction; or, for a kernel the card cannot run, refused by the compile."""
    bad = []
    for name, case in compiled[target].items():
        if case["lacks"]:
            if case["error"] is None or "fp8e4nv" not in case["error"]:
                bad.append(f"{name}: expected the compile to refuse it ({case['lacks']}), got {case['error']!r}")
        elif case["error"] is not None:
            bad.append(f"{name}: {case['error'][:300]}")
        elif case["shared"] > case["limit"]:
            bad.append(f"{name}: {case['shared']} bytes of shared memory > the card's {case['limit']}")
        elif case["spills"]:
            bad.append(f"{name}: {case['spills']} local-memory (spill) instructions")
        elif any(op.startswith(HOPPER_ONLY) for op in case["ops"]):
            bad.append(f"{name}: Hopper-only instructions {[op for op in case['ops'] if op.startswith(HOPPER_ONLY)]}")
    assert not bad, f"{target} ({PRESETS[target].name}):\n" + "\n".join(bad)


@pytest.mark.parametrize("target", TARGETS)
def test_tensor_core_kernels_use_mma(compiled, target):
    """The GEMVs, attention and the read GEMMs stay on the tensor cores (mma.sync: HMMA)."""
    cases = compiled[target]
    names = [n for n in cases if n.startswith(("gemv_bf16", "gemv_Q", "gemv_IQ", "attention_", "gemm_", "streamk_",
                                               "qmoe_grouped_"))]
    assert names and all("HMMA" in cases[n]["ops"] for n in names), [n for n in names if "HMMA" not in cases[n]["ops"]]


@pytest.mark.parametrize("target", TARGETS)
def test_dp4a_gemvs_use_packed_dots(compiled, target):
    cases = compiled[target]
    names = [n for n in cases if n.startswith("dp4a_")]
    assert names and all("IDP" in cases[n]["ops"] for n in names)


@pytest.mark.parametrize("target", TARGETS)
def test_quantized_moe_decode_multiplies_on_cuda_cores(compiled, target):
    cases = compiled[target]
    names = [n for n in cases if n.startswith("qmoe_") and not n.startswith("qmoe_grouped") and not cases[n]["lacks"]]
    assert names
    for name in names:
        assert "FFMA" in cases[name]["ops"] and "HMMA" not in cases[name]["ops"], name
