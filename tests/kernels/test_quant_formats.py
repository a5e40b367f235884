"""The GGUF formats kept quantized with a dequantizing GEMV and a tiled GEMM (Q4_K, Q3_K, Q4_0, Q5_K,
Q6_K, IQ4_XS; strata/kernels/quant/<format>.py): the checks every such format passes, each test
parametrized over the formats it applies to (a table per test where the formats' cases differ).

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit, on random blocks and on extreme fields;
`repack`'s planes (shapes, dtypes, size, the file's bytes they keep); bad planes and arguments refused;
the registry and `QWeight`; the kernels in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at K = 256/512/768, N ≤ 96, M in {1, 3, 16, 40}, fp32, fp16 and bf16 x: `matmul`,
split-K GEMVs, batch invariance, small GEMM tiles, one-hot x giving the dequantized weights; the
dequantize-into-buffer kernel; the grouped and the fused-decode MoE kernels on the formats' expert
stacks. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, the kernels' weights bit for bit, batch
invariance and CUDA-graph replay (timings: benchmarks/kernels/quant_formats.py).

Tolerances, relative Frobenius error of the product:
- against `matmul_ref` (the stated semantics: weights rounded to x's dtype, fp32 sums, one final
  rounding): fp32 1e-5 (summation order only); fp16/bf16 one output rounding, ≤ 2^-9 per value:
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2 (the weights'
  rounding to bf16 adds ~2^-9 relative per weight).
The MoE decode kernels: tests/kernels/test_quant_moe_decode.py's tolerances.

What one format alone has (a bit layout against a hand-written reference, a writer, the GGUF loader
path, K that 256 does not divide, Q4_K's GPU tests) is in tests/kernels/test_quant_<format>.py, which
take the formats and helpers from here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import pytest
import torch
from test_quant_moe_decode import FRO_TOL, MAX_TOL, fro_err, looping, max_err, routing, stacks, wide

from strata.kernels import choices
from strata.kernels.quant import DEQUANT_READ_FORMATS, FORMATS, WRITTEN, QWeight, format_module, random_blocks
from strata.kernels.quant import iq4_xs, q3_k, q4_0, q4_k, q5_k, q6_k
from strata.kernels.quant import moe_decode_q as mdq
from strata.kernels.quant.dequant import DequantConfig, dequantize_into, dequantize_into_triton
from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton
from strata.kernels.quant.q4_k import GemmConfig, GemvConfig

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL_SEMANTICS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}
TOL_FP32_REF = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rel_frobenius(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@dataclass(frozen=True)
class QFormat:
    """A format under test: its GGML type name, its kernel module and what the tests call."""

    name: str
    module: ModuleType
    gemv: Callable  # the dequantizing GEMV (`gemv_q4k`, ...)
    gemm: Callable
    gemm_block_k: int  # values per K step of `test_gemm_small_tiles_match_reference`'s tiles

    @property
    def qtype(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name]

    def weight(self, n, k, seed, device=DEV):
        raw = self.module.random_raw(n, k, seed)
        return raw, self.module.repack(torch.from_numpy(raw).to(device))

    def gguf_bits(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, self.qtype))).view(torch.int32)

    def check_product(self, out, x, planes, n, k):
        dtype = x.dtype
        err = rel_frobenius(out, self.module.matmul_ref(x, planes, n, k))
        assert err <= TOL_SEMANTICS[dtype], f"vs matmul_ref: {err:.3g} > {TOL_SEMANTICS[dtype]}"
        err = rel_frobenius(out, x.float() @ self.module.dequantize(planes, n, k).t())
        assert err <= TOL_FP32_REF[dtype], f"vs fp32 reference: {err:.3g} > {TOL_FP32_REF[dtype]}"


Q4K = QFormat("Q4_K", q4_k, q4_k.gemv_q4k, q4_k.gemm_q4k, gemm_block_k=128)
Q3K = QFormat("Q3_K", q3_k, q3_k.gemv_q3k, q3_k.gemm_q3k, gemm_block_k=256)
Q40 = QFormat("Q4_0", q4_0, q4_0.gemv_q4_0, q4_0.gemm_q4_0, gemm_block_k=64)
Q5K = QFormat("Q5_K", q5_k, q5_k.gemv_q5k, q5_k.gemm_q5k, gemm_block_k=128)
Q6K = QFormat("Q6_K", q6_k, q6_k.gemv_q6k, q6_k.gemm_q6k, gemm_block_k=256)
IQ4XS = QFormat("IQ4_XS", iq4_xs, iq4_xs.gemv_iq4xs, iq4_xs.gemm_iq4xs, gemm_block_k=128)
ALL_FORMATS = [Q4K, Q3K, Q40, Q5K, Q6K, IQ4XS]


def each_format(formats=ALL_FORMATS):
    """Parametrizes `fmt` over `formats` (a list, or a table's keys), its ids the formats' names."""
    return pytest.mark.parametrize("fmt", list(formats), ids=lambda f: f.name)


def cases(table: dict, name: Callable = str) -> list:
    """pytest params (format, case) for every case of every format of `table` ({format: [case, ...]}),
    each id the format's name and `name(case)`."""
    return [pytest.param(fmt, case, id=f"{fmt.name}-{name(case)}") for fmt, fmt_cases in table.items()
            for case in fmt_cases]


@pytest.fixture(autouse=True)
def dequantizing_decode():
    """These are the dequantizing GEMV's tests: the kernel choice quant_decode's default ('auto') takes
    the dp4a GEMV at a few rows (tested in tests/kernels/test_quant_dp4a.py and test_quant_q6k_dp4a.py)."""
    with choices.using(quant_decode="dequant"):
        yield


@pytest.fixture(autouse=True)
def _interpreter_dot_reads_bf16(monkeypatch):
    """Triton 3.6's interpreter stores bf16 as uint16 and np.matmul's them as integers: widen bf16
    operands to fp32 (exact) before its dot, as the GPU's tensor cores multiply them (Q4_K's kernels
    hand bf16 to tl.dot; the other formats' kernels widen under the interpreter themselves)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = (t.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)


def repacked(fmt: QFormat, n, k):
    """A random weight's raw blocks and planes, checked for what every format's planes share: at most
    10% over the file's bytes, contiguous, on DEV."""
    raw, planes = fmt.weight(n, k, seed_of("planes"))
    total = sum(t.numel() * t.element_size() for t in planes.values())
    assert raw.nbytes <= total <= 1.1 * raw.nbytes
    assert all(t.is_contiguous() and t.device.type == DEV for t in planes.values())
    return raw, planes


def run_poisoned(fn, x, n, *args, **kwargs):
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    got = fn(x, *args, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all(), "unwritten NaN poison"
    return out


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition

BLOCK_SIZES = {Q4K: (256, 144), Q3K: (256, 110), Q40: (32, 18), Q5K: (256, 176), Q6K: (256, 210), IQ4XS: (256, 136)}


@each_format()
def test_block_sizes_match_gguf(fmt):
    mod = fmt.module
    assert (mod.GGML_TYPE, mod.BLOCK_VALUES, mod.BLOCK_BYTES) == (fmt.name, *BLOCK_SIZES[fmt])
    assert gguf.GGML_QUANT_SIZES[fmt.qtype] == (mod.BLOCK_VALUES, mod.BLOCK_BYTES)


DEQUANT_SHAPES = {fmt: [(1, 256), (7, 512), (33, 1024)] for fmt in ALL_FORMATS}
DEQUANT_SHAPES[Q40] = [(1, 32), (7, 96), (9, 512), (33, 1024)]


@pytest.mark.parametrize("fmt,shape", cases(DEQUANT_SHAPES, lambda s: f"{s[0]}x{s[1]}"))
def test_dequantize_matches_gguf_bit_for_bit(fmt, shape):
    n, k = shape
    mod = fmt.module
    raw, planes = fmt.weight(n, k, seed_of("deq", n, k), device="cpu")
    assert raw.dtype == np.uint8 and raw.shape == (n, k // mod.BLOCK_VALUES * mod.BLOCK_BYTES)
    got = mod.dequantize(planes, n, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), fmt.gguf_bits(raw))
    ref = gguf.quants.dequantize(raw, fmt.qtype)
    assert np.isfinite(ref).all() and 0.005 < ref.std() < 0.05, "random_raw magnitudes"


# {format: (N, K, [(row, bytes of each of its blocks, value)], byte offset of the fp16 fields,
#           {row: its fp16 fields, one list per block or one for every block})}
EXTREME_FIELDS = {
    # every scale/min/quant bit set or clear, and large/tiny/negative d and dmin
    Q4K: (4, 512, [(0, np.s_[4:], 0xFF), (1, np.s_[4:], 0x00), (2, np.s_[4:16], [0xC0, 0x3F] * 6)],
          0, {3: [[60000.0, -1e-7], [-0.5, 6e-8]]}),
    # every quant, mask and scale bit set or clear (scales 31 and −32), alternating scale bits
    Q3K: (6, 512, [(0, np.s_[:108], 0xFF), (1, np.s_[:108], 0x00), (2, np.s_[96:108], [0x5A, 0xA5, 0x0F, 0xF0] * 3)],
          108, {3: [[60000.0], [-0.5]], 4: [[6e-8], [-6e-8]], 5: [[0.0], [-0.0]]}),
    # every quant 0, 8 (a zero of d's sign) and 15; row 5 is −0 · 0
    Q40: (7, 256, [(0, np.s_[2:], 0xFF), (1, np.s_[2:], 0x00), (2, np.s_[2:], 0x88), (5, np.s_[2:], 0x88)],
          0, {3: [[60000.0]], 4: [[-6e-8]], 5: [[-0.0]], 6: [[0.0]]}),
    # every low quant bit and every high bit set or clear (apart and together), every scale/min bit set
    Q5K: (8, 512, [(0, np.s_[16:], 0xFF), (1, np.s_[16:], 0x00), (2, np.s_[16:48], 0xFF), (2, np.s_[48:], 0x00),
                   (3, np.s_[4:16], 0xFF)],
          0, {4: [[60000.0, -1e-7]], 5: [[-0.5, 6e-8]], 6: [[6e-8, -60000.0]], 7: [[0.0, -0.0]]}),
    # every quant bit set or clear, scales ±127 / −128 / 0
    Q6K: (6, 512, [(0, np.s_[:192], 0xFF), (1, np.s_[:192], 0x00), (2, np.s_[192:208], [0x80, 0x7F, 0x00, 0x81] * 4)],
          208, {3: [[60000.0], [-0.5]], 4: [[6e-8], [-6e-8]], 5: [[0.0], [-0.0]]}),
    # every quant and scale bit set or clear (scales −32 and 31), alternating scale bits
    IQ4XS: (6, 512, [(0, np.s_[2:], 0xFF), (1, np.s_[2:], 0x00), (2, np.s_[2:8], [0x55, 0xAA, 0x0F, 0xF0, 0x00, 0xFF])],
            0, {3: [[60000.0], [-0.5]], 4: [[6e-8], [-6e-8]], 5: [[0.0], [-0.0]]}),
}


@each_format(EXTREME_FIELDS)
def test_dequantize_extreme_fields_matches_gguf_bit_for_bit(fmt):
    """Quant and scale bits all set, all clear or alternating, and huge, tiny (subnormal), negative and
    signed-zero fp16 scales (EXTREME_FIELDS): still gguf's bits, signs of zeros included."""
    n, k, fills, fp16_at, fp16_rows = EXTREME_FIELDS[fmt]
    mod = fmt.module
    raw = mod.random_raw(n, k, 5).reshape(n, -1, mod.BLOCK_BYTES)
    for row, where, value in fills:
        raw[row, :, where] = value
    for row, fields in fp16_rows.items():
        fields = np.array(fields, dtype=np.float16).view(np.uint8)
        raw[row, :, fp16_at:fp16_at + fields.shape[-1]] = fields
    raw = raw.reshape(n, -1)
    got = mod.dequantize(mod.repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), fmt.gguf_bits(raw))


# {format: {plane: (K values per element of a row, dtype)}}
PLANES = {
    Q4K: {"qs": (2, torch.uint8), "scales": (16, torch.uint8), "d_dmin": (128, torch.float16)},
    Q3K: {"qs": (4, torch.uint8), "hmask": (8, torch.uint8), "scales": (16, torch.int8), "d": (256, torch.float32)},
    Q40: {"qs": (2, torch.uint8), "d": (32, torch.float16)},
    Q5K: {"qs": (2, torch.uint8), "scales": (16, torch.uint8), "d_dmin": (128, torch.float16), "qh": (8, torch.uint8)},
    Q6K: {"ql": (2, torch.uint8), "qh": (4, torch.uint8), "scales": (16, torch.int8), "d": (256, torch.float32)},
    IQ4XS: {"qs": (2, torch.uint8), "scales": (32, torch.int8), "d": (256, torch.float32)},
}
# The planes' bytes per 256 values (Q4_0: the file's own, 8 blocks of 18)
PLANE_BYTES = {Q4K: 148, Q3K: 116, Q40: 144, Q5K: 180, Q6K: 212, IQ4XS: 140}
# {format: {plane: the bytes of each block it keeps as they are}}
FILE_BYTES = {Q3K: {"hmask": np.s_[0:32], "qs": np.s_[32:96]}, Q40: {"d": np.s_[:2], "qs": np.s_[2:]},
              Q5K: {"qh": np.s_[16:48]}, Q6K: {"qh": np.s_[128:192]}, IQ4XS: {"qs": np.s_[8:]}}
# {format: {plane: the byte offset in each block of the fp16 value it holds as fp32}}
WIDENED_FP16 = {Q3K: {"d": 108}, Q6K: {"d": 208}, IQ4XS: {"d": 0}}


@each_format()
def test_repack_planes_shapes_dtypes_and_file_bytes(fmt):
    n, k = 10, 768
    raw, planes = repacked(fmt, n, k)
    want = {name: ((n, k // per), dtype) for name, (per, dtype) in PLANES[fmt].items()}
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == want
    assert sum(t.numel() * t.element_size() for t in planes.values()) == n * k // 256 * PLANE_BYTES[fmt]
    blocks = raw.reshape(n, -1, fmt.module.BLOCK_BYTES)
    for name, where in FILE_BYTES.get(fmt, {}).items():
        assert np.array_equal(planes[name].cpu().numpy().view(np.uint8), blocks[:, :, where].reshape(n, -1)), name
    for name, at in WIDENED_FP16.get(fmt, {}).items():
        assert np.array_equal(planes[name].cpu().numpy(), blocks[:, :, at:at + 2].copy().view(np.float16)[..., 0])


# The shapes the argument checks run at: (N, K, device, seed)
CHECKED_SHAPES = [(16, 256, DEV, 1), (8, 512, "cpu", 4)]


def malformed(planes: dict) -> list[dict]:
    """Each plane missing, of another dtype, cut to each narrower width, and strided."""
    other = {torch.uint8: torch.int8, torch.int8: torch.uint8, torch.float16: torch.float32,
             torch.float32: torch.float16}
    bad = []
    for name, t in planes.items():
        bad += [{key: p for key, p in planes.items() if key != name}, {**planes, name: t.to(other[t.dtype])},
                {**planes, name: torch.cat([t, t], dim=1)[:, ::2]}]
        bad += [{**planes, name: t[:, :width]} for width in range(t.shape[1])]
    return bad


@pytest.mark.parametrize("n,k,device,seed", CHECKED_SHAPES, ids=["16x256", "8x512-cpu"])
@each_format()
def test_malformed_planes_are_refused(fmt, n, k, device, seed):
    """`dequantize` and `matmul` refuse planes missing, mistyped, narrower than the weight's or strided
    (ValueError)."""
    _, planes = fmt.weight(n, k, seed, device=device)
    x = torch.randn(2, k, device=device)
    for bad in malformed(planes):
        with pytest.raises(ValueError):
            fmt.module.dequantize(bad, n, k)
        with pytest.raises(ValueError):
            fmt.module.matmul(x, bad, n, k)


@pytest.mark.parametrize("n,k,device,seed", CHECKED_SHAPES, ids=["16x256", "8x512-cpu"])
@each_format()
def test_arguments_that_do_not_fit_are_refused(fmt, n, k, device, seed):
    """x, out, N or K not the weight's, a GEMV K step under one block, a GEMM K step not a power of two,
    K not whole blocks, raw blocks of another dtype or width (20 or 200 bytes, a row short, or another
    format's block) and a QWeight of another K: ValueError."""
    mod = fmt.module
    raw, planes = fmt.weight(n, k, seed, device=device)
    x = torch.randn(2, k, device=device)
    other_blocks = [f.module.BLOCK_BYTES for f in ALL_FORMATS if f.module.BLOCK_BYTES % mod.BLOCK_BYTES]
    refused = [
        lambda: mod.matmul(x[:, :128], planes, n, k),
        lambda: mod.matmul(x, planes, n + 1, k),
        lambda: mod.matmul(x, planes, n, k, out=torch.empty(2, n, dtype=torch.float16, device=device)),
        lambda: fmt.gemv(x, planes, n, k, config=GemvConfig(16, 16)),
        lambda: fmt.gemm(x, planes, n, k, config=GemmConfig(32, 32, 96)),
        lambda: mod.dequantize(planes, n, k - 128),
        lambda: mod.dequantize(planes, n, 48),
        lambda: mod.random_raw(4, 48, 0),
        lambda: mod.random_raw(4, mod.BLOCK_VALUES // 2, 0),
        lambda: mod.repack(torch.from_numpy(raw).view(torch.int8)),
        lambda: mod.repack(torch.from_numpy(raw)[:, :-1]),
    ] + [lambda width=width: mod.repack(torch.zeros(2, width, dtype=torch.uint8)) for width in (20, 200, *other_blocks)]
    for call in refused:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError, match="expected raw blocks"):
        QWeight.from_raw(fmt.name, torch.from_numpy(raw), n, k // 2)


RANDOM_BLOCKS_STD_MAX = {Q4K: 0.1, Q3K: 0.05, Q40: 0.05, Q5K: 0.1, Q6K: 0.05, IQ4XS: 0.05}


@each_format()
def test_registered_and_kept_quantized(fmt):
    """The format is kept quantized (FORMATS, DEQUANT_READ_FORMATS; in WRITTEN as the writers have it),
    a QWeight holds its planes (their bytes; at the 8B shape a split-K workspace) and refuses a row a
    byte short, and `random_blocks` are valid blocks of weight-like magnitudes."""
    assert fmt.name in FORMATS and fmt.name in DEQUANT_READ_FORMATS
    assert (fmt.name in WRITTEN) == (fmt in (Q4K, Q40, Q6K))
    assert format_module(fmt.name) is fmt.module
    assert fmt.module.gemv_workspace_numel(4096, 4096) > 0  # the default 8B configuration splits K
    raw = torch.from_numpy(fmt.module.random_raw(8, 256, 3))
    w = QWeight.from_raw(fmt.name, raw, 8, 256)
    assert w.nbytes == 8 * PLANE_BYTES[fmt]
    assert torch.equal(w.dequantize().view(torch.int32), fmt.gguf_bits(raw.numpy()))
    with pytest.raises(ValueError):
        QWeight.from_raw(fmt.name, raw[:, :-1], 8, 256)
    blocks = random_blocks(fmt.name, 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), fmt.qtype)
    assert np.isfinite(values).all() and 0.005 < values.std() < RANDOM_BLOCKS_STD_MAX[fmt]


# ----------------------------------------------------------------------------------------------
# Kernels (interpreted on the CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 96, 512), (3, 40, 256), (16, 64, 512), (40, 72, 256)])
@each_format()
def test_matmul_matches_reference(fmt, m, n, k, dtype):
    """Through `matmul` (GEMV for M ≤ 16, GEMM above), N that the tiles do not fill."""
    _, planes = fmt.weight(n, k, seed_of("mm", m, n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed_of("x", m, n, k))).to(DEV, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    assert fmt.module.matmul(x, planes, n, k, out).data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()
    fmt.check_product(out, x, planes, n, k)


# (m, n, k, config): split-K even and uneven, wider tiles, 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
]
GEMV_SPLIT_K = {
    Q4K: GEMV_CASES + [(16, 48, 256, GemvConfig(16, 128, split_k=2))],  # and 128-value steps
    Q3K: GEMV_CASES,
    # 32-value steps
    Q40: GEMV_CASES[:2] + [(2, 70, 512, GemvConfig(64, 32, split_k=5)), (16, 48, 256, GemvConfig(16, 64, split_k=2))],
    Q5K: GEMV_CASES,
    Q6K: GEMV_CASES,
    IQ4XS: GEMV_CASES,
}


def gemv_case_id(case) -> str:
    return f"m{case[0]}-n{case[1]}-k{case[2]}-s{case[3].split_k}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,case", cases(GEMV_SPLIT_K, gemv_case_id))
def test_gemv_split_k_matches_reference(fmt, case, dtype):
    """The GEMV with forced configurations into a NaN-poisoned out, x with a row stride wider than K;
    the split counters are back at zero after it."""
    m, n, k, cfg = case
    _, planes = fmt.weight(n, k, seed_of("gemv", case))
    wide_x = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(seed_of("gx", case))).to(DEV, dtype)
    x = wide_x[:, 16:k + 16]
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device=DEV)
    out = run_poisoned(fmt.gemv, x, n, planes, n, k, workspace=ws, config=cfg)
    assert (ws[:-(-n // cfg.block_n)] == 0).all(), "split counters not reset"
    fmt.check_product(out, x, planes, n, k)


def prefix_cases(split2: GemvConfig, auto_ms=(1, 6, 15)) -> list:
    """W [32, 256], x [16, 256] bf16; the batch's first m rows alone, with the default configuration and
    with `split2`."""
    return [("auto", None, 32, 256, 16, torch.bfloat16, [np.s_[:m] for m in auto_ms]),
            ("split2", split2, 32, 256, 16, torch.bfloat16, [np.s_[:m] for m in (1, 6, 15)])]


# {format: [(id, config, N, K, rows of x, x's dtype, the row ranges run alone)]}
BATCH_INVARIANCE = {
    Q4K: [(cfg_id, cfg, 64, 512, 5, torch.float16, [np.s_[0:1], np.s_[3:4]])
          for cfg_id, cfg in (("auto", None), ("split2", GemvConfig(32, 128, split_k=2)))],
    Q3K: prefix_cases(GemvConfig(16, 128, split_k=2)),
    Q40: prefix_cases(GemvConfig(16, 64, split_k=2)),
    Q5K: prefix_cases(GemvConfig(16, 128, split_k=2)),
    Q6K: prefix_cases(GemvConfig(16, 128, split_k=2), auto_ms=range(1, 16)),
    IQ4XS: prefix_cases(GemvConfig(16, 128, split_k=2)),
}


@pytest.mark.parametrize("fmt,case", cases(BATCH_INVARIANCE, lambda case: case[0]))
def test_gemv_rows_have_their_bits_in_the_batch(fmt, case):
    """Rows of x run alone have the bits they have in the whole batch (one binary for every M ≤ 16)."""
    _, config, n, k, rows, dtype, parts = case
    _, planes = fmt.weight(n, k, seed_of("inv"))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    ws = torch.zeros(max(1, fmt.module.gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = fmt.gemv(x, planes, n, k, workspace=ws, config=config)
    for part in parts:
        assert torch.equal(fmt.gemv(x[part], planes, n, k, workspace=ws, config=config), full[part]), part


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [16, 40], ids=["gemv", "gemm"])
@each_format()
def test_kernels_dequantize_exactly(fmt, m, dtype):
    """One-hot rows of x pick single weight columns (every sub-block, several blocks): the product is
    then the kernel's own dequantized weight in x's dtype, which must equal `dequantize` rounded to
    that dtype bit for bit."""
    n, k = 48, 512
    _, planes = fmt.weight(n, k, seed_of("onehot", m))
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(m))[:m]
    x = torch.zeros(m, k, dtype=dtype, device=DEV)
    x[torch.arange(m), cols.to(DEV)] = 1
    out = fmt.module.matmul(x, planes, n, k)
    expect = fmt.module.dequantize(planes, n, k)[:, cols.to(DEV)].t().to(dtype)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@each_format()
def test_gemm_small_tiles_match_reference(fmt, dtype):
    """The GEMM with small tiles: row and column tiles cut by M and N, several K steps, a row stride
    wider than K (x a column slice)."""
    m, n, k = 40, 72, 512
    _, planes = fmt.weight(n, k, seed_of("gemm"))
    wide_x = torch.randn(m, k + 16, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    x = wide_x[:, :k]
    cfg = GemmConfig(32, 32, fmt.gemm_block_k, group_m=2, num_warps=4)
    out = run_poisoned(fmt.gemm, x, n, planes, n, k, config=cfg)
    fmt.check_product(out, x, planes, n, k)


@pytest.mark.parametrize("choice", ["auto", "dp4a", "dequant"])
@each_format()
def test_an_empty_batch_under_every_decode_kernel(fmt, choice):
    """No rows give an empty product, whichever decode kernel quant_decode picks."""
    n, k = 16, 256
    _, planes = fmt.weight(n, k, 2)
    with choices.using(quant_decode=choice):
        out = fmt.module.matmul(torch.empty(0, k, dtype=torch.bfloat16, device=DEV), planes, n, k)
    assert out.shape == (0, n) and out.dtype == torch.bfloat16


@each_format()
def test_reference_path_off_the_kernels(fmt, monkeypatch):
    """Where the kernels do not run (CPU without the interpreter), `matmul` is `matmul_ref`."""
    n, k = 24, 256
    _, planes = fmt.weight(n, k, 2, device="cpu")
    x = torch.randn(3, k).to(torch.bfloat16)
    monkeypatch.setattr(fmt.module, "kernels_run", lambda t, kernel: False)
    assert torch.equal(fmt.module.matmul(x, planes, n, k), fmt.module.matmul_ref(x, planes, n, k))


# {format: [(K, a tile configuration, or None: the shipped one through `dequantize_into`)]}
DEQUANT_INTO = {
    Q3K: [(512, None), (768, None), (768, DequantConfig(16, 128, num_warps=4))],
    Q40: [(512, None), (768, DequantConfig(16, 256, num_warps=4)), (160, None)],  # 160: 32-value K tiles
    Q5K: [(512, None), (768, DequantConfig(16, 256, num_warps=4))],
    IQ4XS: [(512, None), (768, None), (768, DequantConfig(16, 128, num_warps=4))],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@each_format(DEQUANT_INTO)
def test_dequantize_into_buffer(fmt, dtype):
    """dequant.py's kernel: `dequantize` rounded to the buffer's dtype bit for bit, two and three K
    tiles, a ragged row tile, only the first N·K elements written; then a QWeight read of
    `dequant_read_rows` rows goes through it."""
    n = 40
    for k, config in DEQUANT_INTO[fmt]:
        _, planes = fmt.weight(n, k, seed_of("deq-into", k))
        out = torch.full((n * k + 9,), 7.0, dtype=dtype, device=DEV)
        if config is None:
            got = dequantize_into(fmt.name, planes, n, k, out)
        else:
            got = dequantize_into_triton(fmt.name, planes, n, k, out, config=config)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, fmt.module.dequantize(planes, n, k).to(dtype)), k
        assert torch.all(out[n * k:] == 7.0)
    raw = torch.from_numpy(fmt.module.random_raw(n, 256, 4)).to(DEV)
    w = QWeight.from_raw(fmt.name, raw, n, 256)
    w.dequant_buf = torch.zeros(n * 256, dtype=dtype, device=DEV)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    with choices.using(dequant_read_rows=8):
        got = w.matmul(x)
    want_w = w.dequantize().to(dtype)
    assert torch.equal(w.dequant_buf.view(n, 256), want_w) and torch.equal(got, x @ want_w.t())


# ----------------------------------------------------------------------------------------------
# MoE kernels on the formats' expert stacks (interpreted on the CPU)

# fp32: the FMA dot's tiles (`grouped_config`); bf16: decode (swap AB) and 64-row tiles
SUPER_BLOCK_TILES = {
    torch.float32: (GroupedConfig(16, 32, 128), GroupedConfig(32, 32, 256, num_warps=8)),
    torch.bfloat16: (GroupedConfig(16, 64, 128, swap_ab=True), GroupedConfig(64, 32, 256, num_warps=8)),
}
GROUPED_TILES = {
    Q3K: SUPER_BLOCK_TILES,
    Q40: {torch.float32: (GroupedConfig(16, 32, 32), GroupedConfig(32, 32, 128, num_warps=8)),  # 32-value K steps
          torch.bfloat16: (GroupedConfig(16, 64, 128, swap_ab=True), GroupedConfig(64, 32, 32, num_warps=8))},
    Q5K: SUPER_BLOCK_TILES,
    Q6K: SUPER_BLOCK_TILES,
    IQ4XS: SUPER_BLOCK_TILES,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@each_format(GROUPED_TILES)
def test_moe_grouped_kernel_matches_reference(fmt, dtype):
    """moe_q's grouped kernel takes the format's stacks (their dequantization gguf's bits): decode (swap
    AB) and 64-row tiles, empty experts, uneven groups, against the reference."""
    e, n, k = 4, 48, 256
    raw = torch.from_numpy(fmt.module.random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw(fmt.name, raw)
    assert torch.equal(stack.dequantize().view(e * n, k).view(torch.int32), fmt.gguf_bits(raw.view(e * n, -1).numpy()))
    offs = torch.tensor([0, 5, 5, 21], dtype=torch.int32)  # each expert's end row: experts 0 and 2 empty
    xs = torch.randn(21, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grouped_matmul_ref(xs, stack, offs)
    for cfg in GROUPED_TILES[fmt][dtype]:
        got = grouped_matmul_triton(xs, stack, offs, config=cfg)
        assert rel_frobenius(got, ref) <= TOL_FP32_REF[dtype], cfg


# (format, top-k, I, K steps: "wide" the shipped ones in 64-row blocks, "loop" the least; stacks' seed,
# routing's seed)
MOE_DECODE_CASES = [
    (Q40, 3, 96, "wide", 21, 3),  # I = 96: 32-value K steps in the down kernel
    (Q5K, 2, 256, "wide", 21, 3),
] + [(fmt, 2, 256, steps, seed_of("mdq", steps) % 10_000, seed_of("mdq-route", steps))
     for fmt in (Q3K, IQ4XS) for steps in ("wide", "loop")]


@pytest.mark.parametrize("fmt,top_k,inter,steps,stacks_seed,routing_seed", MOE_DECODE_CASES,
                         ids=[f"{case[0].name}-{case[3]}" for case in MOE_DECODE_CASES])
def test_moe_decode_kernels_match_reference(fmt, top_k, inter, steps, stacks_seed, routing_seed):
    """moe_decode_q's fused decode kernels on the format's stacks (E = 6, H = 256, T = 2, bf16) into a
    NaN-poisoned out, against the exact-weight reference; a token alone has its bits in the batch."""
    w13, w2 = stacks(fmt.name, 6, 256, inter, stacks_seed)
    x, ids, w = routing(routing_seed, 2, top_k, 6, 256, torch.bfloat16)
    assert mdq.supported(2, top_k, fmt.name, 256, inter, torch.bfloat16)
    cfg = looping(fmt.name) if steps == "loop" else wide(mdq.decode_config(fmt.name, 256, inter))
    out = torch.full((2, 256), float("nan"), dtype=torch.bfloat16)
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, out, config=cfg)
    assert got is out and torch.isfinite(out).all()
    ref = mdq.reference(x, ids, w, w13, w2, cfg)
    assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= FRO_TOL
    alone = mdq.moe_decode_q_triton(x[-1:].clone(), ids[-1:].clone(), w[-1:].clone(), w13, w2, config=cfg)
    assert torch.equal(alone, got[-1:])


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu); Q4_K's own in tests/kernels/test_quant_q4_k.py

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
GPU_REAL_SHAPES = {Q3K: GPU_SHAPES, Q40: GPU_SHAPES + [(4096, 2880)], Q5K: GPU_SHAPES, Q6K: GPU_SHAPES,
                   IQ4XS: GPU_SHAPES}


def check_real_shape(fmt: QFormat, n, k, m):
    """16-bit x at a real shape: the product, run to run and with and without a workspace. Returns the
    planes and the workspace."""
    _, planes = fmt.weight(n, k, seed_of("gpu", n, k), device="cuda")
    ws = torch.zeros(max(1, fmt.module.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    matmul = fmt.module.matmul
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
        out = matmul(x, planes, n, k, workspace=ws)
        fmt.check_product(out, x, planes, n, k)
        assert torch.equal(matmul(x, planes, n, k, workspace=ws), out), "run to run"
        assert torch.equal(matmul(x, planes, n, k), out), "with and without a workspace"
    return planes, ws


def check_split_gemv_graph(fmt: QFormat, x, planes, n, k):
    """A split-K GEMV of x [16, K] at a real shape: the product, and its CUDA-graph replay's bits."""
    out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(64, 128, split_k=5)
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device="cuda")
    expect = fmt.gemv(x, planes, n, k, workspace=ws, config=cfg)
    fmt.check_product(expect, x, planes, n, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fmt.gemv(x, planes, n, k, out, workspace=ws, config=cfg)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("fmt,shape", cases(GPU_REAL_SHAPES, lambda s: f"{s[0]}-{s[1]}"))
def test_gpu_real_shapes(fmt, shape, m):
    n, k = shape
    planes, ws = check_real_shape(fmt, n, k, m)
    x = torch.randn(m, k, device="cuda") * 0.5
    fmt.check_product(fmt.module.matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x: the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
@each_format(GPU_REAL_SHAPES)
def test_gpu_kernels_dequantize_exactly(fmt, m):
    """One-hot x at a real shape: the kernels' weights are `dequantize` rounded to bf16, bit for bit."""
    n, k = 4096, 4096
    _, planes = fmt.weight(n, k, 12, device="cuda")
    cols = torch.randperm(k, device="cuda")[:m]
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(m, device="cuda"), cols] = 1
    want = fmt.module.dequantize(planes, n, k)[:, cols].t().to(torch.bfloat16)
    assert torch.equal(fmt.module.matmul(x, planes, n, k), want)


@needs_cuda
@pytest.mark.gpu
@each_format(GPU_REAL_SHAPES)
def test_gpu_batch_invariant_and_graph(fmt):
    """Rows 1..15 of a 16-row x give the bits they have in the whole batch; then the split GEMV's graph."""
    n, k = 4096, 4096
    _, planes = fmt.weight(n, k, 11, device="cuda")
    matmul = fmt.module.matmul
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k), dtype=torch.int32, device="cuda")
    full = matmul(x, planes, n, k, workspace=ws)
    for m in range(1, 16):
        assert torch.equal(matmul(x[:m].clone(), planes, n, k, workspace=ws), full[:m]), m
    check_split_gemv_graph(fmt, x, planes, n, k)


@needs_cuda
@pytest.mark.gpu
@each_format([Q3K, IQ4XS])
def test_gpu_dequantize_into_ragged_real_shape(fmt):
    n, k = 4100, 4096  # a ragged last row tile
    _, planes = fmt.weight(n, k, 13, device="cuda")
    out = torch.full((n * k + 64,), 7.0, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_into(fmt.name, planes, n, k, out),
                       fmt.module.dequantize(planes, n, k).to(torch.bfloat16))
    assert torch.all(out[n * k:] == 7.0)


@needs_cuda
@pytest.mark.gpu
@each_format([Q40, Q5K])
def test_gpu_dequantize_into_and_moe_decode(fmt):
    """The dequantize-into kernel at 24576 x 4096 bit for bit; the MoE decode kernels at Qwen3-30B-A3B
    sizes against their reference (the shipped configuration)."""
    n, k = 24576, 4096
    _, planes = fmt.weight(n, k, 13, device="cuda")
    out = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_into(fmt.name, planes, n, k, out),
                       fmt.module.dequantize(planes, n, k).to(torch.bfloat16))
    e, h, inter = 128, 2048, 768
    raw13 = torch.from_numpy(fmt.module.random_raw(e * 2 * inter, h, 1)).cuda().view(e, 2 * inter, -1)
    raw2 = torch.from_numpy(fmt.module.random_raw(e * h, inter, 2)).cuda().view(e, h, -1)
    w13, w2 = QExpertStack.from_raw(fmt.name, raw13), QExpertStack.from_raw(fmt.name, raw2)
    x = torch.randn(4, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(4)])
    w = torch.softmax(torch.randn(4, 8, device="cuda"), -1)
    got, ref = mdq.moe_decode_q_triton(x, ids, w, w13, w2), mdq.reference(x, ids, w, w13, w2)
    assert rel_frobenius(got, ref) <= 5e-3
