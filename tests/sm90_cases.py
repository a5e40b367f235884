"""Kernels of the decode path at the configurations the engine launches, compiled for sm_90 without a GPU
(`scripts/sass_loops.py`). Run as a script in a process of its own (`tests/kernels/test_compile_sm90.py`
does): the test process interprets every kernel (TRITON_INTERPRET=1), and an interpreted kernel cannot
be compiled. Prints {case: {"error", "spills", "ops", "global_loads"}} as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import triton

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from sass_loops import sass  # noqa: E402

from strata.kernels import activation, attention, gemv, moe_decode, moe_routing, norm, rope  # noqa: E402
from strata.kernels.quant import dp4a, fp8, fp8_rows, iq3_s_dp4a, moe_decode_q, q4_k_dp4a, q6_k_dp4a  # noqa: E402

OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
SPLIT_K_ARGS = dict(out_ptr="*bf16", out_stride="i32", partial_ptr="*fp32", counter_ptr="*i32", m="i32", n="i32",
                    k="i32")
QKV = (6144, 4096)


def bf16_gemv(n: int, k: int):
    cfg = gemv.gemv_config(n, k)
    sig = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*bf16", scale_ptr="*bf16", bias_ptr="*bf16", **SPLIT_K_ARGS)
    const = dict(BLOCK_M=gemv.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                 EVEN_N=n % cfg.block_n == 0, HAS_BIAS=False, SILU_MUL=False, IEEE_DOT=False, USE_LIBDEVICE=True,
                 USE_PDL=True, W8="")
    return gemv._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def fp8_gemv(n: int, k: int):
    """The decode GEMV over e4m3 weights with a column scale (W8, the hardware conversion)."""
    cfg = fp8.gemv_config(n, k)
    sig = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*i32", scale_ptr="*fp32", bias_ptr="*bf16", **SPLIT_K_ARGS)
    const = dict(BLOCK_M=gemv.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                 EVEN_N=n % cfg.block_n == 0, HAS_BIAS=False, SILU_MUL=False, IEEE_DOT=False, USE_LIBDEVICE=True,
                 USE_PDL=True, W8=gemv.W8_CONVERSIONS[0])
    return gemv._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def fp8_rows_quantize(silu_mul: bool = False):
    sig = dict(x_ptr="*bf16", x_stride="i32", q_ptr="*fp8e4nv", s_ptr="*fp32", m="i32", k="i32")
    const = dict(FP8_MAX=fp8_rows.E4M3_MAX, BLOCK_K=fp8_rows.BLOCK_K, SILU_MUL=silu_mul, USE_LIBDEVICE=True,
                 USE_PDL=True)
    return fp8_rows._quantize_rows_kernel, sig, const, 4, 3, True


def fused_add_rms_norm(hidden: int = 4096, zero_centred: bool = False):
    block = min(triton.next_power_of_2(hidden), norm.MAX_ROW_BLOCK)
    sig = dict(x_ptr="*bf16", x_stride="i32", res_ptr="*bf16", res_stride="i32", w_ptr="*bf16", out_ptr="*bf16",
               out_stride="i32", n_cols="i32", n_cols_f="fp32", eps="fp32")
    const = dict(HAS_RESIDUAL=True, ZERO_CENTRED=zero_centred, BLOCK=block, NUM_CHUNKS=-(-hidden // block),
                 USE_PDL=True)
    return norm._rms_norm_kernel, sig, const, min(16, max(1, block // 512)), 3, True


def qk_norm_rope(head_dim: int = 128, num_q: int = 32, num_kv: int = 8, rotary: int = 128):
    """The 8B shape's q/k norm + RoPE."""
    sig = dict(qkv_ptr="*bf16", row_stride="i32", pos_ptr="*i64", inv_freq_ptr="*fp32", q_w_ptr="*bf16",
               k_w_ptr="*bf16", attn_scale="fp32", eps="fp32", head_dim_f="fp32")
    block_dim, half = triton.next_power_of_2(head_dim), rotary // 2
    block_heads = min(triton.next_power_of_2(num_q + num_kv), max(1, 1024 // block_dim))
    const = dict(NUM_Q_HEADS=num_q, NUM_HEADS=num_q + num_kv, HEAD_DIM=head_dim, HALF=half, PASS_DIM=head_dim - rotary,
                 BLOCK_HEADS=block_heads, BLOCK_HALF=triton.next_power_of_2(half),
                 BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary, 1)), HAS_NORM=True,
                 ROUND_NORMED=True, ZERO_CENTRED=False, USE_LIBDEVICE=True, USE_PDL=True)
    return rope._qk_norm_rope_kernel, sig, const, min(4, max(1, block_heads * block_dim // 512)), 3, True


def moe_gate_up(hidden: int, inter: int):
    cfg = moe_decode.moe_decode_config(hidden, inter)
    sig = dict(x_ptr="*bf16", x_stride="i32", ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32", w13_ptr="*bf16",
               act_ptr="*bf16", hidden="i32", inter="i32", top_k="i32")
    const = dict(BLOCK_I=cfg.gate_up_block_i, BLOCK_H=cfg.gate_up_block_h,
                 EVEN=inter % cfg.gate_up_block_i == 0 and hidden % cfg.gate_up_block_h == 0,
                 NUM_STAGES=cfg.gate_up_stages, USE_LIBDEVICE=True, USE_PDL=True)
    return moe_decode._gate_up_kernel, sig, const, cfg.gate_up_warps, cfg.gate_up_stages, True


def moe_down_combine(hidden: int, inter: int):
    cfg = moe_decode.moe_decode_config(hidden, inter)
    sig = dict(act_ptr="*bf16", ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32", wts_ptr="*fp32",
               wts_stride_t="i32", wts_stride_j="i32", w2_ptr="*bf16", out_ptr="*bf16", out_stride="i32",
               hidden="i32", inter="i32", top_k="i32")
    const = dict(BLOCK_H=cfg.down_block_h, BLOCK_K=cfg.down_block_k, K_CHUNKS=-(-inter // cfg.down_block_k),
                 EVEN=inter % cfg.down_block_k == 0 and hidden % cfg.down_block_h == 0,
                 NUM_STAGES=cfg.down_stages, USE_PDL=True)
    return moe_decode._down_combine_kernel, sig, const, cfg.down_warps, cfg.down_stages, True


# The quantized MoE decode kernels' plane arguments by format (as moe_q._kernel_planes passes them).
QMOE_PLANES = {"Q8_0": ("*i8", "*fp16", "*i8", "*i8", "*i8", "*i8"), "Q4_K": ("*u8", "*i32", "*i32", "*u8", "*u8", "*u8"),
               "IQ3_S": ("*u8", "*i32", "*u8", "*u8", "*fp16", "*i32"),
               "Q6_K": ("*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32"),
               "FP8": ("*fp8e4nv", "*fp32", "*fp8e4nv", "*fp8e4nv", "*fp8e4nv", "*fp32")}


def qmoe_decode(fmt: str, kernel: str, hidden: int = 2048, inter: int = 768, dp4a: bool | None = None):
    """strata.kernels.quant.moe_decode_q at the Qwen3-30B-A3B shape, `decode_config`'s configuration
    (`dp4a` overrides its choice of Q8_0 tiles, 128 values a step without it)."""
    cfg = moe_decode_q.decode_config(fmt, hidden, inter)
    if dp4a is not None:
        cfg = dataclasses.replace(cfg, dp4a=dp4a, gate_up_block_k=256 if dp4a else 128, down_block_k=256 if dp4a else 128)
    dp4a = cfg.dp4a
    planes = dict(zip(("p0", "p1", "p2", "p3", "p4", "grid_ptr"), QMOE_PLANES[fmt]))
    if dp4a and fmt == "Q8_0":
        planes["p2"] = "*i32"  # the qs plane as words
    ids = dict(ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32")
    common = dict(FORMAT=moe_decode_q.FORMAT_IDS[fmt], INTERPRETED=False, SHARED_GRID=fmt == "IQ3_S", DP4A=dp4a,
                  USE_PDL=True)
    if kernel == "gate_up":
        sig = dict(x_ptr="*bf16", x_stride="i32", **ids, **planes, act_ptr="*bf16", hidden="i32", inter="i32",
                   top_k="i32")
        const = dict(BLOCK_I=cfg.gate_up_block_i, BLOCK_K=cfg.gate_up_block_k,
                     ACC_K=moe_decode_q._acc_k(fmt, cfg.gate_up_block_k, dp4a), NUM_STAGES=cfg.gate_up_stages,
                     USE_LIBDEVICE=True, **common)
        return moe_decode_q._gate_up_kernel, sig, const, cfg.gate_up_warps, cfg.gate_up_stages, True
    sig = dict(act_ptr="*bf16", **ids, wts_ptr="*fp32", wts_stride_t="i32", wts_stride_j="i32", **planes,
               out_ptr="*bf16", out_stride="i32", hidden="i32", inter="i32", top_k="i32")
    const = dict(BLOCK_H=cfg.down_block_h, BLOCK_K=cfg.down_block_k, ACC_K=moe_decode_q._acc_k(fmt, cfg.down_block_k, dp4a),
                 NUM_STAGES=cfg.down_stages, **common)
    return moe_decode_q._down_kernel, sig, const, cfg.down_warps, cfg.down_stages, True


def shared_expert_gate(kind: str, hidden: int = 2048, top_k: int = 10):
    """Qwen3-Next's gated shared expert: added to the routed output, or appended as one more expert."""
    block = min(triton.next_power_of_2(hidden), activation.BLOCK_COLS)
    warps = max(1, min(4, block // 256))
    if kind == "add":
        sig = dict(routed_ptr="*bf16", shared_ptr="*bf16", x_ptr="*bf16", g_ptr="*bf16", out_ptr="*bf16",
                   routed_stride="i32", shared_stride="i32", x_stride="i32", h="i32")
        const = dict(BLOCK=block, USE_LIBDEVICE=True, USE_PDL=True)
        return activation._sigmoid_gated_add_kernel, sig, const, warps, 3, True
    sig = dict(x_ptr="*bf16", x_stride="i32", g_ptr="*bf16", w_ptr="*fp32", ids_ptr="*i64", w_out_ptr="*fp32",
               ids_out_ptr="*i64", h="i32", top_k="i32", slot="i32")
    const = dict(BLOCK=block, BLOCK_K=triton.next_power_of_2(top_k), USE_LIBDEVICE=True, USE_PDL=True)
    return activation._append_gated_expert_kernel, sig, const, warps, 3, True


def dp4a_gemv(fmt: str, rows: int, n: int = QKV[0], k: int = QKV[1]):
    kernel, weights, module = {
        "Q8_0": (dp4a._q8_gemv_dp4a_kernel, dict(qw_ptr="*i32", d_ptr="*fp16"), dp4a),
        "Q4_K": (q4_k_dp4a._q4k_gemv_dp4a_kernel, dict(qw_ptr="*i32", sw_ptr="*i32", dw_ptr="*i32"), q4_k_dp4a),
        "Q6_K": (q6_k_dp4a._q6k_gemv_dp4a_kernel, dict(ql_ptr="*i32", qh_ptr="*i32", sc_ptr="*i32", d_ptr="*fp16"),
                 q6_k_dp4a),
        "IQ3_S": (iq3_s_dp4a._iq3s_gemv_dp4a_kernel, dict(qs_ptr="*u8", qh_ptr="*u8", signs_ptr="*i32",
                                                          scales_ptr="*u8", d_ptr="*fp16", grid_ptr="*i32"), iq3_s_dp4a),
    }[fmt]
    cfg = module.gemv_config(n, k)
    sig = dict(x_ptr="*bf16", x_stride="i32", **weights, **SPLIT_K_ARGS)
    const = dict(BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EMULATE=False,
                 USE_PDL=True)
    return kernel, sig, const, cfg.num_warps, cfg.num_stages, False  # launched without FMA contraction


def decode_attention(head_dim: int, group: int, int8: bool):
    cfg = attention.select_config(1, group, int8, False, head_dim)
    kv = "*i8" if int8 else "*bf16"
    names = ("q_ptr k_ptr v_ptr ks_ptr vs_ptr out_ptr table_ptr q_start_ptr q_len_ptr ctx_len_ptr ws_acc_ptr ws_m_ptr "
             "ws_l_ptr ws_count_ptr").split()
    types = ["*bf16", kv, kv, "*fp32", "*fp32", "*bf16", "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32",
             "*i32"]
    sig = dict(zip(names, types))
    sig.update({s: "i32" for s in ("stride_qn stride_qh stride_k_slot stride_kh stride_v_slot stride_vh stride_ks_slot "
                                   "stride_ksh stride_vs_slot stride_vsh stride_on stride_oh stride_table stride_wa_n "
                                   "stride_wa_h stride_wa_s stride_wm_n stride_wm_h stride_wc_n").split()})
    sig.update(qk_scale="fp32", num_q_tiles="i32", num_splits="i32", min_split_keys="i32")
    const = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=max(1, cfg.block_m // group), BLOCK_N=cfg.kv_tile,
                 HEAD_DIM=head_dim, BLOCK_SIZE=16, IS_INT8=int8, SPLIT=True, DOT_PREC="tf32", INVARIANT=False,
                 USE_PDL=True, FEW_SPLITS=attention.FEW_SPLITS, LONG_SPLIT_KEYS=attention.LONG_SPLIT_KEYS)
    return attention._paged_attention_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def router(e: int = 512, h: int = 2048, top_k: int = 10):
    cfg = moe_routing.router_decode_config(e, h)
    sig = dict(x_ptr="*bf16", x_stride="i32", weight_ptr="*fp32", logits_ptr="*fp32", counter_ptr="*i32",
               bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", n_tokens="i32", hidden="i32", n_experts="i32",
               top_k="i32", group_size="i32", n_group="i32", topk_group="i32", scale="fp32")
    const = dict(BLOCK_T=moe_routing.DECODE_BLOCK_T, BLOCK_EP=cfg.block_e, BLOCK_H=cfg.block_h, BLOCK_E=e,
                 BLOCK_K=1 << (top_k - 1).bit_length(), BLOCK_G=1, SIGMOID=False, NORM=True, HAS_BIAS=False,
                 GROUPED=False, USE_LIBDEVICE=True, NUM_STAGES=cfg.num_stages, USE_PDL=True)
    return moe_routing._router_decode_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


CASES = {
    "gemv_bf16_qkv": lambda: bf16_gemv(*QKV),
    "gemv_bf16_down": lambda: bf16_gemv(4096, 12288),
    **{f"dp4a_{fmt}_m{rows}": (lambda fmt=fmt, rows=rows: dp4a_gemv(fmt, rows))
       for fmt in ("Q8_0", "Q4_K", "Q6_K") for rows in (1, 4)},
    **{f"dp4a_IQ3_S_{n}_m{rows}": (lambda n=n, rows=rows: dp4a_gemv("IQ3_S", rows, n, 4096))
       for n in (6144, 4096) for rows in (1, 4, 8)},  # split 8 over 48 and 32 row tiles
    "attention_decode_h128": lambda: decode_attention(128, 4, False),
    "attention_decode_h256": lambda: decode_attention(256, 8, False),
    "attention_decode_h256_int8": lambda: decode_attention(256, 8, True),
    "router_e512": router,
    "gemv_fp8_qkv": lambda: fp8_gemv(*QKV),
    "gemv_fp8_down": lambda: fp8_gemv(4096, 12288),
    "fp8_rows_quantize": fp8_rows_quantize,
    "fp8_rows_silu_mul_quantize": lambda: fp8_rows_quantize(silu_mul=True),
    "rms_norm_add": fused_add_rms_norm,
    "qk_norm_rope": qk_norm_rope,
    "qk_norm_rope_partial": lambda: qk_norm_rope(head_dim=256, num_q=16, num_kv=2, rotary=64),
    "rms_norm_add_zero_centred": lambda: fused_add_rms_norm(2048, True),
    "moe_gate_up_30b": lambda: moe_gate_up(2048, 768),
    "moe_down_30b": lambda: moe_down_combine(2048, 768),
    "moe_gate_up_next": lambda: moe_gate_up(2048, 512),
    "moe_down_next": lambda: moe_down_combine(2048, 512),
    "shared_expert_add": lambda: shared_expert_gate("add"),
    "shared_expert_append": lambda: shared_expert_gate("append"),
    **{f"qmoe_{kernel}_{fmt}": (lambda fmt=fmt, kernel=kernel: qmoe_decode(fmt, kernel))
       for fmt in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "FP8") for kernel in ("gate_up", "down")},
    **{f"qmoe_{kernel}_Q8_0_fma": (lambda kernel=kernel: qmoe_decode("Q8_0", kernel, dp4a=False))
       for kernel in ("gate_up", "down")},
    **{f"qmoe_{kernel}_IQ3_S_dp4a": (lambda kernel=kernel: qmoe_decode("IQ3_S", kernel, dp4a=True))
       for kernel in ("gate_up", "down")},
}


def main(names: list[str]) -> None:
    out = {}
    for name in names or CASES:
        try:
            kernel, sig, const, warps, stages, fusion = CASES[name]()
            text = sass(kernel, sig, const, warps, stages, fusion)
            ops = [m.group(1) for m in OPCODE.finditer(text)]
            out[name] = {"error": None, "spills": text.count("LDL") + text.count("STL"), "ops": sorted(set(ops)),
                         "global_loads": ops.count("LDG")}
        except Exception as exc:  # reported per case: the test names the one that failed and why
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "spills": None, "ops": []}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
