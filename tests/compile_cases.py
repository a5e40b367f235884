"""Kernels of the decode and read paths at the configurations the engine launches on a device, compiled
for its target without a GPU (`scripts/sass_loops.py`). Run as a script in a process of its own
(`tests/kernels/test_compile_sm90.py` and `test_compile_consumer.py` do): the test process interprets
every kernel (TRITON_INTERPRET=1), and an interpreted kernel cannot be compiled.

    python tests/compile_cases.py sm_86 [NAME ... | --set consumer] [--configs sm_90]

The target names a `strata.kernels.device.PRESETS` entry: its capability is the compile target, and
every configuration is the one the engine computes for that spec (SM count, shared memory per block,
capability; PDL only where the spec has it). `--configs` takes the configurations of another spec
instead (to see what the reference's tiles would need on this target). Prints {case: {"error",
"spills", "ops", "global_loads", "shared", "limit", "lacks", ...}} as JSON: `shared` is the compiled
kernel's shared memory per block, `limit` the target's, `lacks` why the target cannot run the kernel
(`NEEDS`; None where it can)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import torch
import triton

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from sass_loops import compile_kernel, disassemble  # noqa: E402

from strata.kernels import (activation, attention, causal_conv, gated_delta_decode, gemv, kv_dequant,  # noqa: E402
                            kv_store, moe_decode, moe_routing, moe_sort, norm, rope, token_mask)
from strata.kernels.device import PRESETS, DeviceSpec  # noqa: E402
from strata.kernels.quant import (dequant, dp4a, fp8, fp8_rows, iq3_s, iq3_s_dp4a, moe_decode_q, moe_q,  # noqa: E402
                                  q4_k, q4_k_dp4a, q6_k, q6_k_dp4a, q8_0, streamk)

OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
SPLIT_K_ARGS = dict(out_ptr="*bf16", out_stride="i32", partial_ptr="*fp32", counter_ptr="*i32", m="i32", n="i32",
                    k="i32")
QKV = (6144, 4096)
DOWN = (4096, 12288)

# The device compiled for (`main` sets it: its capability, PDL and shared memory limit), and the one
# whose configurations the cases take (the same unless --configs).
TARGET: DeviceSpec = PRESETS["sm_90"]
SPEC: DeviceSpec = TARGET


def pdl() -> bool:
    return TARGET.pdl


# ---- decode ------------------------------------------------------------------------------------------


def bf16_gemv(n: int, k: int, silu_mul: bool = False):
    cfg = gemv.gemv_config(n, k, SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*bf16", scale_ptr="*bf16", bias_ptr="*bf16", **SPLIT_K_ARGS)
    const = dict(BLOCK_M=gemv.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                 EVEN_N=n % cfg.block_n == 0, HAS_BIAS=False, SILU_MUL=silu_mul, IEEE_DOT=False, USE_LIBDEVICE=True,
                 USE_PDL=pdl(), W8="")
    return gemv._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def fp8_gemv(n: int, k: int):
    """The decode GEMV over e4m3 weights with a column scale (W8, the hardware conversion)."""
    cfg = fp8.gemv_config(n, k, SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*i32", scale_ptr="*fp32", bias_ptr="*bf16", **SPLIT_K_ARGS)
    const = dict(BLOCK_M=gemv.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                 EVEN_N=n % cfg.block_n == 0, HAS_BIAS=False, SILU_MUL=False, IEEE_DOT=False, USE_LIBDEVICE=True,
                 USE_PDL=pdl(), W8=gemv.W8_CONVERSIONS[0])
    return gemv._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def fp8_rows_quantize(silu_mul: bool = False):
    sig = dict(x_ptr="*bf16", x_stride="i32", q_ptr="*fp8e4nv", s_ptr="*fp32", m="i32", k="i32")
    const = dict(FP8_MAX=fp8_rows.E4M3_MAX, BLOCK_K=fp8_rows.BLOCK_K, SILU_MUL=silu_mul, USE_LIBDEVICE=True,
                 USE_PDL=pdl())
    return fp8_rows._quantize_rows_kernel, sig, const, 4, 3, True


def fused_add_rms_norm(hidden: int = 4096, zero_centred: bool = False, residual: bool = True):
    block = min(triton.next_power_of_2(hidden), norm.MAX_ROW_BLOCK)
    sig = dict(x_ptr="*bf16", x_stride="i32", res_ptr="*bf16", res_stride="i32", w_ptr="*bf16", out_ptr="*bf16",
               out_stride="i32", n_cols="i32", n_cols_f="fp32", eps="fp32")
    const = dict(HAS_RESIDUAL=residual, ZERO_CENTRED=zero_centred, BLOCK=block, NUM_CHUNKS=-(-hidden // block),
                 USE_PDL=pdl())
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
                 ROUND_NORMED=True, ZERO_CENTRED=False, USE_LIBDEVICE=True, USE_PDL=pdl())
    return rope._qk_norm_rope_kernel, sig, const, min(4, max(1, block_heads * block_dim // 512)), 3, True


def moe_gate_up(hidden: int, inter: int):
    cfg = moe_decode.moe_decode_config(hidden, inter)
    sig = dict(x_ptr="*bf16", x_stride="i32", ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32", w13_ptr="*bf16",
               act_ptr="*bf16", hidden="i32", inter="i32", top_k="i32")
    const = dict(BLOCK_I=cfg.gate_up_block_i, BLOCK_H=cfg.gate_up_block_h,
                 EVEN=inter % cfg.gate_up_block_i == 0 and hidden % cfg.gate_up_block_h == 0,
                 NUM_STAGES=cfg.gate_up_stages, USE_LIBDEVICE=True, USE_PDL=pdl())
    return moe_decode._gate_up_kernel, sig, const, cfg.gate_up_warps, cfg.gate_up_stages, True


def moe_down_combine(hidden: int, inter: int):
    cfg = moe_decode.moe_decode_config(hidden, inter)
    sig = dict(act_ptr="*bf16", ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32", wts_ptr="*fp32",
               wts_stride_t="i32", wts_stride_j="i32", w2_ptr="*bf16", out_ptr="*bf16", out_stride="i32",
               hidden="i32", inter="i32", top_k="i32")
    const = dict(BLOCK_H=cfg.down_block_h, BLOCK_K=cfg.down_block_k, K_CHUNKS=-(-inter // cfg.down_block_k),
                 EVEN=inter % cfg.down_block_k == 0 and hidden % cfg.down_block_h == 0,
                 NUM_STAGES=cfg.down_stages, USE_PDL=pdl())
    return moe_decode._down_combine_kernel, sig, const, cfg.down_warps, cfg.down_stages, True


# The quantized MoE decode kernels' plane arguments by format (as moe_q._kernel_planes passes them).
QMOE_PLANES = {"Q8_0": ("*i8", "*fp16", "*i8", "*i8", "*i8", "*i8"), "Q4_K": ("*u8", "*i32", "*i32", "*u8", "*u8", "*u8"),
               "IQ3_S": ("*u8", "*i32", "*u8", "*u8", "*fp16", "*i32"),
               "Q6_K": ("*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32"),
               "FP8": ("*fp8e4nv", "*fp32", "*fp8e4nv", "*fp8e4nv", "*fp8e4nv", "*fp32")}


def qmoe_decode(fmt: str, kernel: str, hidden: int = 2048, inter: int = 768, dp4a: bool | None = None,
                pcie: bool = False):
    """strata.kernels.quant.moe_decode_q at the Qwen3-30B-A3B shape, `decode_config`'s configuration
    (`dp4a` overrides its choice of Q8_0 tiles, 128 values a step without it; `pcie`: the last of
    `pcie_configs`, the tiles the start-up probe may choose for reads over PCIe)."""
    cfg = moe_decode_q.pcie_configs(fmt, hidden, inter)[-1] if pcie else moe_decode_q.decode_config(fmt, hidden, inter)
    if dp4a is not None:
        cfg = dataclasses.replace(cfg, dp4a=dp4a, gate_up_block_k=256 if dp4a else 128, down_block_k=256 if dp4a else 128)
    dp4a = cfg.dp4a
    planes = dict(zip(("p0", "p1", "p2", "p3", "p4", "grid_ptr"), QMOE_PLANES[fmt]))
    if dp4a and fmt == "Q8_0":
        planes["p2"] = "*i32"  # the qs plane as words
    ids = dict(ids_ptr="*i64", ids_stride_t="i32", ids_stride_j="i32")
    common = dict(FORMAT=moe_decode_q.FORMAT_IDS[fmt], INTERPRETED=False, SHARED_GRID=fmt == "IQ3_S", DP4A=dp4a,
                  USE_PDL=pdl())
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
        const = dict(BLOCK=block, USE_LIBDEVICE=True, USE_PDL=pdl())
        return activation._sigmoid_gated_add_kernel, sig, const, warps, 3, True
    sig = dict(x_ptr="*bf16", x_stride="i32", g_ptr="*bf16", w_ptr="*fp32", ids_ptr="*i64", w_out_ptr="*fp32",
               ids_out_ptr="*i64", h="i32", top_k="i32", slot="i32")
    const = dict(BLOCK=block, BLOCK_K=triton.next_power_of_2(top_k), USE_LIBDEVICE=True, USE_PDL=pdl())
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
    cfg = module.gemv_config(n, k, SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", **weights, **SPLIT_K_ARGS)
    const = dict(BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EMULATE=False,
                 USE_PDL=pdl())
    return kernel, sig, const, cfg.num_warps, cfg.num_stages, False  # launched without FMA contraction


def dequant_gemv(fmt: str, n: int = QKV[0], k: int = QKV[1]):
    """The dequantizing decode GEMVs (quant_decode=auto above each format's DP4A_MAX_ROWS rows)."""
    if fmt == "Q8_0":
        cfg = q8_0.gemv_config(n, k, SPEC)
        sig = dict(x_ptr="*bf16", x_stride="i32", qs_ptr="*i8", d_ptr="*fp16", **SPLIT_K_ARGS, k_groups="i32")
        const = dict(BLOCK_M=q8_0.GEMV_MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                     FP32_DOT=False, USE_PDL=pdl())
        return q8_0._q8_gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True
    if fmt == "IQ3_S":
        cfg = iq3_s.gemv_config(n, k, SPEC)
        sig = dict(x_ptr="*bf16", x_stride="i32", qs_ptr="*u8", signs_ptr="*i32", qh_ptr="*u8", scales_ptr="*u8",
                   d_ptr="*fp16", grid_ptr="*i32", **SPLIT_K_ARGS)
        const = dict(BLOCK_M=iq3_s.GEMV_MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                     IEEE_DOT=False, INTERPRETED=False, USE_PDL=pdl())
        return iq3_s._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True
    module, weights = {"Q4_K": (q4_k, dict(qs_ptr="*u8", scales_ptr="*i32", d_dmin_ptr="*i32")),
                       "Q6_K": (q6_k, dict(ql_ptr="*i32", qh_ptr="*i32", scales_ptr="*i32", d_ptr="*fp16"))}[fmt]
    cfg = module.gemv_config(n, k, SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", **weights, **SPLIT_K_ARGS)
    const = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, IEEE_DOT=False,
                 USE_PDL=pdl())
    if fmt == "Q6_K":
        const["INTERPRETED"] = False
    return module._gemv_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


ATTN_SIG = dict(zip(
    ("q_ptr k_ptr v_ptr ks_ptr vs_ptr out_ptr table_ptr q_start_ptr q_len_ptr ctx_len_ptr ws_acc_ptr ws_m_ptr "
     "ws_l_ptr ws_count_ptr lse_ptr").split(),
    ["*bf16", "KV", "KV", "*fp32", "*fp32", "*bf16", "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32", "*i32",
     "*fp32"]))
ATTN_STRIDES = ("stride_qn stride_qh stride_k_slot stride_kh stride_v_slot stride_vh stride_ks_slot stride_ksh "
                "stride_vs_slot stride_vsh stride_on stride_oh stride_table stride_wa_n stride_wa_h stride_wa_s "
                "stride_wm_n stride_wm_h stride_wc_n stride_ln stride_lh").split()


def paged_attention(head_dim: int, group: int, int8: bool, q_len: int = 1, split: bool = True,
                    host_prefix: bool = False):
    """Decode (q_len 1, split keys) and prompt chunks (q_len > 1, one program a query tile) at the tiles
    `select_config` picks for the device; `host_prefix`: a chunk over a streamed host prefix (every row
    sees the whole context, LSE written)."""
    cfg = attention.select_config(q_len, group, int8, False, head_dim, False, SPEC)
    kv = "*i8" if int8 else "*bf16"
    sig = {name: kv if t == "KV" else t for name, t in ATTN_SIG.items()}
    sig.update({s: "i32" for s in ATTN_STRIDES})
    sig.update(qk_scale="fp32", num_q_tiles="i32", num_splits="i32", min_split_keys="i32")
    const = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=max(1, cfg.block_m // group), BLOCK_N=cfg.kv_tile,
                 HEAD_DIM=head_dim, BLOCK_SIZE=16, IS_INT8=int8, SPLIT=split, DOT_PREC="tf32", INVARIANT=False,
                 USE_PDL=pdl(), FEW_SPLITS=attention.FEW_SPLITS, LONG_SPLIT_KEYS=attention.LONG_SPLIT_KEYS,
                 WRITE_LSE=host_prefix, WHOLE_CONTEXT=host_prefix)
    return attention._paged_attention_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def router(e: int = 512, h: int = 2048, top_k: int = 10):
    cfg = moe_routing.router_decode_config(e, h)
    sig = dict(x_ptr="*bf16", x_stride="i32", weight_ptr="*fp32", logits_ptr="*fp32", counter_ptr="*i32",
               bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", n_tokens="i32", hidden="i32", n_experts="i32",
               top_k="i32", group_size="i32", n_group="i32", topk_group="i32", scale="fp32")
    const = dict(BLOCK_T=moe_routing.DECODE_BLOCK_T, BLOCK_EP=cfg.block_e, BLOCK_H=cfg.block_h, BLOCK_E=e,
                 BLOCK_K=1 << (top_k - 1).bit_length(), BLOCK_G=1, SIGMOID=False, NORM=True, HAS_BIAS=False,
                 GROUPED=False, USE_LIBDEVICE=True, NUM_STAGES=cfg.num_stages, USE_PDL=pdl())
    return moe_routing._router_decode_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def kv_store_case(int8: bool, heads: int = 8, head_dim: int = 128):
    cache = "*i8" if int8 else "*bf16"
    sig = dict(k_ptr="*bf16", k_tok_stride="i32", k_head_stride="i32", v_ptr="*bf16", v_tok_stride="i32",
               v_head_stride="i32", k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr="*fp32", v_scale_ptr="*fp32",
               slots_ptr="*i64")
    block_d = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(heads), max(1, 1024 // block_d))
    const = dict(NUM_KV_HEADS=heads, HEAD_DIM=head_dim, BLOCK_HEADS=block_heads, BLOCK_D=block_d, QUANTIZE=int8,
                 RECIPROCAL_SCALE=int8, USE_LIBDEVICE=True, USE_PDL=pdl())
    return kv_store._store_kv_kernel, sig, const, min(4, max(1, block_heads * block_d // 256)), 3, True


def conv_decode(channels: int = 8192, width: int = 4):
    """Qwen3-Next's conv step (q|k|v channels, kernel 4)."""
    sig = dict(x_ptr="*bf16", x_stride="i32", w_ptr="*bf16", w_stride="i32", pool_ptr="*bf16", idx_ptr="*i32",
               out_ptr="*bf16", out_stride="i32", c_dim="i32")
    const = dict(K=width, W_POW2=triton.next_power_of_2(width - 1), BLOCK_C=gated_delta_decode.CONV_BLOCK_C,
                 USE_PDL=pdl())
    return gated_delta_decode._conv_decode_kernel, sig, const, 4, 3, True


def delta_decode(hk: int = 16, hv: int = 32, dk: int = 128, dv: int = 128):
    """Qwen3-Next's gated delta step from raw gates, one sequence."""
    sig = {}
    for t in ("q", "k", "v"):
        sig.update({f"{t}_ptr": "*bf16", f"{t}_ss": "i32", f"{t}_sh": "i32"})
    for t in ("g", "b"):
        sig.update({f"{t}_ptr": "*bf16", f"{t}_ss": "i32", f"{t}_sk": "i32", f"{t}_sr": "i32"})
    sig.update(alog_ptr="*fp32", dtb_ptr="*fp32", st_ptr="*fp32", idx_ptr="*i32", o_ptr="*bf16", o_ss="i32",
               o_sh="i32", scale="fp32", eps="fp32")
    const = dict(HV=hv, RATIO=hv // hk, DK=dk, DV=dv, DK_POW2=triton.next_power_of_2(dk),
                 BLOCK_DV=gated_delta_decode._block_dv(1, hv, dv, SPEC), RAW_GATES=True, USE_LIBDEVICE=True,
                 USE_PDL=pdl())
    return gated_delta_decode._gated_delta_decode_kernel, sig, const, 4, 3, True


def token_mask_case():
    sig = dict(logits_ptr="*fp32", logits_stride="i32", mask_ptr="*i32", mask_stride="i32", active_ptr="*i32",
               vocab="i32")
    const = dict(HAS_ACTIVE=True, BLOCK=token_mask.BLOCK_TOKENS, USE_PDL=pdl())
    return token_mask._token_mask_kernel, sig, const, 4, 3, True


# ---- reads -------------------------------------------------------------------------------------------


def kv_gather_dequant(heads: int = 8, head_dim: int = 128):
    sig = dict(cache_ptr="*i8", scale_ptr="*fp32", slots_ptr="*i32", out_ptr="*bf16", stride_slot="i32",
               stride_scale="i32", stride_out="i32")
    const = dict(HEADS=heads, HEAD_DIM=head_dim, USE_PDL=pdl())
    return kv_dequant._gather_dequant_kernel, sig, const, 4, 3, True


def silu_mul(inter: int = 12288):
    block = min(triton.next_power_of_2(inter), activation.BLOCK_COLS)
    sig = dict(x_ptr="*bf16", x_stride="i32", out_ptr="*bf16", out_stride="i32", inter="i32")
    const = dict(BLOCK=block, USE_LIBDEVICE=True, USE_PDL=pdl())
    return activation._silu_mul_kernel, sig, const, max(1, min(4, block // 256)), 3, True


def gated_rms_norm(d: int = 128):
    block = triton.next_power_of_2(d)
    sig = dict(x_ptr="*bf16", z_ptr="*bf16", z_stride0="i32", z_stride1="i32", z_stride2="i32", w_ptr="*fp32",
               out_ptr="*bf16", heads="i32", group="i32", d="i32", d_f="fp32", eps="fp32")
    const = dict(BLOCK=block, ROUND_PRODUCT=False, USE_LIBDEVICE=True, USE_PDL=pdl())
    return norm._gated_rms_norm_kernel, sig, const, max(1, min(4, block // 256)), 3, True


def route(e: int = 128, top_k: int = 8):
    """The router's top-k over a read's logits (softmax, one program a token)."""
    args, meta = moe_routing._route_meta(e, "softmax", top_k, True, 1, 1, None, 1.0, torch.device("cuda"))
    sig = dict(logits_ptr="*fp32", logits_stride="i32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64",
               n_experts="i32", top_k="i32", group_size="i32", n_group="i32", topk_group="i32", scale="fp32")
    const = dict(meta, USE_PDL=pdl())
    return moe_routing._route_kernel, sig, const, max(1, min(4, meta["BLOCK_E"] // 256)), 3, True


def sort_tokens(kernel: str, e: int = 128):
    cfg = moe_sort.SortConfig()
    block_e = triton.next_power_of_2(e)
    if kernel == "histogram":
        sig = dict(ids_ptr="*i64", n_pairs="i32", n_experts="i32", n_blocks="i32", table_ptr="*i32",
                   counter_ptr="*i32", offs_ptr="*i32")
        const = dict(HIST_BLOCK=cfg.hist_block, BLOCK_E=block_e, SCAN_ROWS=cfg.scan_rows, USE_PDL=pdl())
        return moe_sort._sort_histogram_kernel, sig, const, 4, 3, True
    sig = dict(ids_ptr="*i64", n_pairs="i32", n_blocks="i32", table_ptr="*i32", order_ptr="*i64")
    const = dict(HIST_BLOCK=cfg.hist_block, RANK_BLOCK=cfg.rank_block, BLOCK_E=block_e, USE_PDL=pdl())
    return moe_sort._sort_scatter_kernel, sig, const, 4, 3, True


GEMM_ARGS = dict(out_ptr="*bf16", out_stride="i32", m="i32", n="i32", k="i32")


def quant_gemm(fmt: str, m: int, n: int = QKV[0], k: int = QKV[1]):
    """The formats' prompt-read GEMMs (M > 16) at the device's tiles."""
    if fmt == "Q8_0":
        cfg = q8_0.gemm_config(m, n, k, spec=SPEC)
        sig = dict(x_ptr="*bf16", x_stride="i32", qs_ptr="*i8", d_ptr="*fp16", **GEMM_ARGS, k_groups="i32")
        const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     FP32_DOT=False, USE_PDL=pdl())
        return q8_0._q8_gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages, True
    if fmt == "IQ3_S":
        cfg = iq3_s.gemm_config(n, k, m=m, spec=SPEC)
        sig = dict(x_ptr="*bf16", x_stride="i32", qs_ptr="*u8", signs_ptr="*i32", qh_ptr="*u8", scales_ptr="*u8",
                   d_ptr="*fp16", grid_ptr="*i32", **GEMM_ARGS)
        const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, IEEE_DOT=False,
                     INTERPRETED=False, USE_PDL=pdl())
        return iq3_s._gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages, True
    module, weights = {"Q4_K": (q4_k, dict(qs_ptr="*u8", scales_ptr="*i32", d_dmin_ptr="*i32")),
                       "Q6_K": (q6_k, dict(ql_ptr="*i32", qh_ptr="*i32", scales_ptr="*i32", d_ptr="*fp16"))}[fmt]
    cfg = module.gemm_config(m, n, k, spec=SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", **weights, **GEMM_ARGS)
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, IEEE_DOT=False,
                 USE_PDL=pdl())
    if fmt == "Q6_K":
        const["INTERPRETED"] = False
    return module._gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def q8_streamk(m: int, n: int = QKV[0], k: int = QKV[1]):
    cfg = streamk.streamk_config(m, n, k, spec=SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", qs_ptr="*i8", d_ptr="*fp16", out_ptr="*bf16", out_stride="i32",
               flags_ptr="*i32", partials_ptr="*fp32", m="i32", n="i32", k="i32", k_groups="i32",
               num_programs="i32", has_fixup="i32")
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FP32_DOT=False,
                 USE_PDL=pdl())
    return streamk._q8_streamk_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


DEQUANT_PLANES = {"Q8_0": dict(qs_ptr="*i8", d_ptr="*fp16"),
                  "Q4_K": dict(qs_ptr="*u8", scales_ptr="*i32", d_dmin_ptr="*i32"),
                  "IQ3_S": dict(qs_ptr="*u8", signs_ptr="*i32", qh_ptr="*u8", scales_ptr="*u8", d_ptr="*fp16",
                                grid_ptr="*i32"),
                  "Q6_K": dict(ql_ptr="*i32", qh_ptr="*i32", scales_ptr="*i32", d_ptr="*fp16")}


def dequantize_into(fmt: str, k: int = 4096):
    """A long read's weight dequantized into the shared bf16 buffer (`dequant_read_rows`)."""
    cfg = dequant.CONFIGS[fmt]
    kernel = {"Q8_0": dequant._q8_0_kernel, "Q4_K": dequant._q4_k_kernel, "IQ3_S": dequant._iq3_s_kernel,
              "Q6_K": dequant._q6_k_kernel}[fmt]
    sig = dict(DEQUANT_PLANES[fmt], out_ptr="*bf16", n="i32", k="i32")
    const = dict(BLOCK_N=cfg.block_n, BLOCK_K=dequant.block_k_for(fmt, k, cfg.block_k), USE_PDL=pdl())
    if fmt in ("IQ3_S", "Q6_K"):
        const["INTERPRETED"] = False
    return kernel, sig, const, cfg.num_warps, 3, True


GROUPED_PLANES = {"Q8_0": ("*i8", "*fp16", "*i8", "*i8", "*i8", "*i8"),
                  "Q4_K": ("*u8", "*i32", "*i32", "*u8", "*u8", "*u8"),
                  "IQ3_S": ("*u8", "*i32", "*u8", "*u8", "*fp16", "*i32"),
                  "Q6_K": ("*i32", "*i32", "*i32", "*fp16", "*fp16", "*fp16")}


def qmoe_grouped(fmt: str, t: int, experts: int = 128, n: int = 1536, k: int = 2048):
    """The quantized experts' grouped GEMM of a read (`moe_q`): T sorted rows over 128 experts."""
    cfg = moe_q.grouped_config(fmt, t, experts, n, k, spec=SPEC)
    sig = dict(x_ptr="*bf16", x_stride="i32", offs_ptr="*i32", out_ptr="*bf16", out_stride="i32",
               **dict(zip(("p0", "p1", "p2", "p3", "p4", "grid_ptr"), GROUPED_PLANES[fmt])), tiles_m="i32",
               n="i32", k="i32", num_experts="i32")
    const = dict(FORMAT=moe_q._FORMAT_IDS[fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 BLOCK_E=max(16, triton.next_power_of_2(experts)), GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
                 IEEE_DOT=False, INTERPRETED=False, USE_PDL=pdl(), SHARED_GRID=fmt == "IQ3_S")
    return moe_q._grouped_kernel, sig, const, cfg.num_warps, cfg.num_stages, True


def conv_varlen(kernel: str, width: int = 4):
    """Qwen3-Next's conv over a read's rows, and its window update."""
    if kernel == "conv":
        sig = dict(x_ptr="*bf16", w_ptr="*bf16", st_ptr="*bf16", out_ptr="*bf16", row_span_ptr="*i32",
                   span_start_ptr="*i32", span_slot_ptr="*i32", span_fresh_ptr="*i32", t_rows="i32", c_dim="i32")
        const = dict(K=width, BLOCK_T=16, BLOCK_C=128, USE_PDL=pdl())
        return causal_conv._conv_kernel, sig, const, 4, 3, True
    sig = dict(x_ptr="*bf16", st_ptr="*bf16", span_start_ptr="*i32", span_len_ptr="*i32", span_slot_ptr="*i32",
               span_fresh_ptr="*i32", c_dim="i32")
    const = dict(K=width, W_POW2=triton.next_power_of_2(width - 1), BLOCK_C=128, USE_PDL=pdl())
    return causal_conv._window_kernel, sig, const, 4, 3, True


# Kernels that need a capability (a `DeviceSpec` property) some targets lack, and why. There the
# compile refuses them, and the engine never launches them: FP8 weights are refused at load on such a
# device (`quant.fp8._quantize_rows`).
NEEDS = {
    "fp8_rows_quantize": ("fp8", "writes e4m3 (Triton's fp8e4nv, cvt to e4m3 needs sm_89)"),
    "fp8_rows_silu_mul_quantize": ("fp8", "writes e4m3 (Triton's fp8e4nv)"),
    "qmoe_gate_up_FP8": ("fp8", "reads e4m3 expert planes (Triton's fp8e4nv)"),
    "qmoe_down_FP8": ("fp8", "reads e4m3 expert planes (Triton's fp8e4nv)"),
}

# The decode path at the sm_90 test's shapes (`tests/kernels/test_compile_sm90.py`, `--set sm90`).
DECODE = {
    "gemv_bf16_qkv": lambda: bf16_gemv(*QKV),
    "gemv_bf16_down": lambda: bf16_gemv(*DOWN),
    **{f"dp4a_{fmt}_m{rows}": (lambda fmt=fmt, rows=rows: dp4a_gemv(fmt, rows))
       for fmt in ("Q8_0", "Q4_K", "Q6_K") for rows in (1, 4)},
    **{f"dp4a_IQ3_S_{n}_m{rows}": (lambda n=n, rows=rows: dp4a_gemv("IQ3_S", rows, n, 4096))
       for n in (6144, 4096) for rows in (1, 4, 8)},  # split 8 over 48 and 32 row tiles
    "attention_decode_h128": lambda: paged_attention(128, 4, False),
    "attention_decode_h256": lambda: paged_attention(256, 8, False),
    "attention_decode_h256_int8": lambda: paged_attention(256, 8, True),
    "router_e512": router,
    "gemv_fp8_qkv": lambda: fp8_gemv(*QKV),
    "gemv_fp8_down": lambda: fp8_gemv(*DOWN),
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
    # The 80B-A3B's experts read over PCIe (H 2048, I 512), K steps of two super-blocks.
    **{f"qmoe_pcie_{kernel}_IQ3_S": (lambda kernel=kernel: qmoe_decode("IQ3_S", kernel, 2048, 512, pcie=True))
       for kernel in ("gate_up", "down")},
}
# Decode kernels the sm_90 cases did not cover: the dequantizing GEMVs (auto above DP4A_MAX_ROWS rows),
# the K/V store, Qwen3-Next's conv and delta steps, a grammar's token mask.
DECODE_MORE = {
    "gemv_bf16_down_silu": lambda: bf16_gemv(*DOWN, silu_mul=True),
    "gemv_bf16_lm_head": lambda: bf16_gemv(151936, 4096),
    "attention_verify_h128": lambda: paged_attention(128, 4, False, q_len=16),  # 64 rows: 15 drafts
    "attention_verify_h256": lambda: paged_attention(256, 8, False, q_len=4),  # 32 rows: 3 drafts
    **{f"gemv_{fmt}_qkv": (lambda fmt=fmt: dequant_gemv(fmt)) for fmt in ("Q8_0", "Q4_K", "Q6_K", "IQ3_S")},
    **{f"gemv_{fmt}_down": (lambda fmt=fmt: dequant_gemv(fmt, *DOWN)) for fmt in ("Q8_0", "Q4_K")},
    "attention_decode_h128_int8": lambda: paged_attention(128, 4, True),
    "kv_store": lambda: kv_store_case(False),
    "kv_store_int8": lambda: kv_store_case(True),
    "conv_decode": conv_decode,
    "gated_delta_decode": delta_decode,
    "token_mask": token_mask_case,
}
READ = {
    "attention_prefill_wide": lambda: paged_attention(128, 4, False, q_len=2048, split=False),
    "attention_prefill_narrow": lambda: paged_attention(128, 4, False, q_len=512, split=False),
    "attention_prefill_int8": lambda: paged_attention(128, 4, True, q_len=2048, split=False),
    "attention_host_prefix_int8": lambda: paged_attention(128, 4, True, q_len=2048, split=False, host_prefix=True),
    "attention_host_prefix_h256_int8": lambda: paged_attention(256, 8, True, q_len=2048, split=False,
                                                               host_prefix=True),
    "attention_prefill_h256": lambda: paged_attention(256, 8, False, q_len=2048, split=False),
    "kv_gather_dequant": kv_gather_dequant,
    "rms_norm": lambda: fused_add_rms_norm(residual=False),
    "silu_mul": silu_mul,
    "gated_rms_norm": gated_rms_norm,
    "route_e128": route,
    "sort_histogram": lambda: sort_tokens("histogram"),
    "sort_scatter": lambda: sort_tokens("scatter"),
    **{f"gemm_{fmt}_m{m}": (lambda fmt=fmt, m=m: quant_gemm(fmt, m))
       for fmt in ("Q8_0", "Q4_K", "Q6_K", "IQ3_S") for m in (32, 512)},
    **{f"streamk_Q8_0_m{m}": (lambda m=m: q8_streamk(m)) for m in (64, 512)},
    **{f"dequant_{fmt}": (lambda fmt=fmt: dequantize_into(fmt)) for fmt in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K")},
    **{f"qmoe_grouped_{fmt}_t{t}": (lambda fmt=fmt, t=t: qmoe_grouped(fmt, t))
       for fmt in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K") for t in (2048, 16384)},
    "conv_varlen": lambda: conv_varlen("conv"),
    "conv_window": lambda: conv_varlen("window"),
}
CASES = {**DECODE, **DECODE_MORE, **READ}
# What `tests/kernels/test_compile_consumer.py` compiles for each of sm_80, sm_86 and sm_89: every kernel
# of both paths once per configuration the engine picks there (the decode GEMVs at the largest M the
# default kernel choice gives them; the sm_90 list's repeats at other shapes left out).
CONSUMER = [
    "gemv_bf16_qkv", "gemv_bf16_down_silu", "gemv_bf16_lm_head", "gemv_fp8_qkv",
    "dp4a_Q8_0_m4", "dp4a_Q4_K_m4", "dp4a_Q6_K_m4", "dp4a_IQ3_S_6144_m4",
    "gemv_Q8_0_qkv", "gemv_Q4_K_qkv", "gemv_Q6_K_qkv", "gemv_IQ3_S_qkv",
    "attention_decode_h128", "attention_decode_h128_int8", "attention_decode_h256", "attention_decode_h256_int8",
    "attention_verify_h128", "attention_verify_h256",
    "router_e512", "moe_gate_up_30b", "moe_down_30b", "shared_expert_add", "shared_expert_append",
    *(f"qmoe_{kernel}_{fmt}" for fmt in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "FP8") for kernel in ("gate_up", "down")),
    "qmoe_pcie_gate_up_IQ3_S", "qmoe_pcie_down_IQ3_S",
    "fp8_rows_quantize", "fp8_rows_silu_mul_quantize",
    "rms_norm_add", "qk_norm_rope",
    "kv_store", "kv_store_int8", "conv_decode", "gated_delta_decode", "token_mask",
    *READ,
]
SETS = {"sm90": list(DECODE), "consumer": CONSUMER}


def compile_case(name: str) -> dict:
    start = time.perf_counter()
    need = NEEDS.get(name)
    lacks = need is not None and not getattr(TARGET, need[0])
    try:
        kernel, sig, const, warps, stages, fusion = CASES[name]()
        compiled = compile_kernel(kernel, sig, const, warps, stages, fusion, arch=TARGET.arch)
        text = disassemble(compiled)
        ops = [m.group(1) for m in OPCODE.finditer(text)]
        return {"error": None, "spills": text.count("LDL") + text.count("STL"), "ops": sorted(set(ops)),
                "global_loads": ops.count("LDG"), "shared": compiled.metadata.shared, "warps": warps,
                "stages": stages, "limit": TARGET.smem_per_block, "lacks": need[1] if lacks else None,
                "seconds": round(time.perf_counter() - start, 2)}
    except Exception as exc:  # reported per case: the test names the one that failed and why
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "spills": None, "ops": [], "shared": None,
                "limit": TARGET.smem_per_block, "lacks": need[1] if lacks else None}


def main(argv: list[str]) -> None:
    global SPEC, TARGET
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", choices=sorted(PRESETS))
    p.add_argument("names", nargs="*", help="cases (default: all, or --set's)")
    p.add_argument("--set", choices=sorted(SETS), help="a named list of cases")
    p.add_argument("--configs", choices=sorted(PRESETS), help="another spec's configurations")
    args = p.parse_args(argv)
    TARGET = PRESETS[args.target]
    SPEC = PRESETS[args.configs or args.target]
    names = args.names or (SETS[args.set] if args.set else list(CASES))
    print(json.dumps({name: compile_case(name) for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
