"""Whether a MoE layer's routed experts held in RAM as 4-bit groups beat the compiled int8 rows on a
one-token decode step: the same layer computed by kernels torch.compile generates (as
`strata.kernels.host_moe` does for int8), on fresh random weights at the 80B-A3B and 30B-A3B expert
shapes, with every expert of the layer in memory (E experts; each step picks k of them at random).

Formats (gate|up [E * 2I, H] and down [E * H, I], the groups along the input dimension):
- int8: int8 rows with an fp32 scale per row (the `compiled` format);
- int4-f16: two 4-bit levels per byte (value j of a 32-group in the low nibble, j + 16 in the high),
  w = q * scale + offset with an fp16 scale and offset per group: 4.5 + 0.5 bits a weight;
- int4-f32: the same with fp32 scale and offset: 6 bits a weight;
- int4-words: 4-bit levels packed eight to an int32 word (value 128 b + 16 n + l of a row is nibble n of
  word 16 b + l: a vector of 16 words shifted by 4 n holds 16 consecutive levels), fp32 scale and
  offset per group: 6 bits a weight (the `compiled-int4` format: `strata.kernels.host_moe`'s planes and
  kernel);
- int4-wsym: the same words with one fp32 scale per group and no offset, w = (q - 7.5) * scale: 5 bits.

Prints milliseconds per layer step, the bytes read per second, and the host's read bandwidth.

    python benchmarks/kernels/host_int4_compiled.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from strata.kernels.host_moe import int4_words, one_token_moe, one_token_moe_int4
from strata.models.host_experts import int8_rows

G = 32


def int4_groups_packed(w: torch.Tensor, dtype: torch.dtype):
    r, k = w.shape
    g = w.view(r, k // G, G)
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo).clamp(min=1e-12) / 15
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(r, k // 2).contiguous(), s.to(dtype), lo.to(dtype)


def _proj_flat(x, p, s, m, rows):
    n, k = rows.shape[0], x.shape[1]
    pg = p[rows].view(n, k // G, 16)
    sg, mg = s[rows].float()[..., None], m[rows].float()[..., None]
    xg = x.view(n, k // G, 2, 16)
    return (((pg & 15).float() * sg + mg) * xg[:, :, 0] + ((pg >> 4).float() * sg + mg) * xg[:, :, 1]).sum((-1, -2))


def words_symmetric(w: torch.Tensor, dtype: torch.dtype):
    """`int4_words`' layout with one scale per group and no offset: w = (q - 7.5) * scale, the group's largest
    magnitude at level 0 or 15 (exact for IQ3_S blocks, whose levels are the odd multiples of a step)."""
    r, k = w.shape
    g = w.view(r, k // G, G)
    s = g.abs().amax(-1).clamp(min=1e-12) / 7.5
    q = torch.round(g / s[..., None] + 7.5).clamp(0, 15).to(torch.int32).view(r, k // 128, 8, 16)
    words = torch.zeros(r, k // 128, 16, dtype=torch.int32)
    for n in range(8):
        words |= q[:, :, n] << (4 * n)
    return words.view(r, k // 8), s.to(dtype), torch.zeros(r, 0)


def _proj_words_symmetric(x, p, s, m, rows):
    n, k = rows.shape[0], x.shape[1]
    pw = p[rows].view(n, k // 128, 1, 16)
    shifts = (torch.arange(8, dtype=torch.int32) * 4).view(1, 1, 8, 1)
    q = ((pw >> shifts) & 15).float() - 7.5
    sg = s[rows].float().view(n, k // 128, 4, 1).repeat_interleave(2, dim=2)
    return (q * sg * x.view(n, k // 128, 8, 16)).sum((-1, -2, -3))


def _one_token(proj):
    def fn(x, ids, weights, w13, s13, m13, w2, s2, m2):
        k, hidden, inter = ids.shape[0], x.shape[1], s2.shape[1] * G
        rows = (ids[:, None] * (2 * inter) + torch.arange(2 * inter)).reshape(-1)
        gu = proj(x.expand(rows.shape[0], hidden), w13, s13, m13, rows).view(k, 2 * inter)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        rows = (ids[:, None] * hidden + torch.arange(hidden)).reshape(-1)
        y = proj(act[:, None, :].expand(k, hidden, inter).reshape(k * hidden, inter), w2, s2, m2, rows)
        return (y.view(k, hidden) * weights[:, None]).sum(0, keepdim=True)
    return torch.compile(fn, fullgraph=True, dynamic=False)


def host_read_gbs() -> float:
    a = torch.ones(2 << 28, dtype=torch.float32)  # 2 GiB
    a.sum()
    t0 = time.perf_counter()
    a.sum()
    return a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def layer(name: str, e: int, inter: int, hidden: int, k: int, steps: int = 100) -> None:
    torch.manual_seed(0)
    w13 = torch.randn(e * 2 * inter, hidden) * 0.02
    w2 = torch.randn(e * hidden, inter) * 0.02
    x = torch.randn(1, hidden)
    weights = torch.softmax(torch.randn(k), 0)
    q13, c13 = int8_rows(w13)
    q2, c2 = int8_rows(w2)
    ids0 = torch.randperm(e)[:k]
    exact = None
    formats = {"int8": (one_token_moe(), (q13, c13, q2, c2), q13.numel() + c13.numel() * 4 + q2.numel() + c2.numel() * 4)}
    for fmt, proj, dtype in (("int4-f16", _proj_flat, torch.float16), ("int4-f32", _proj_flat, torch.float32),
                             ("int4-wsym", _proj_words_symmetric, torch.float32)):
        pack = words_symmetric if proj is _proj_words_symmetric else int4_groups_packed
        planes = pack(w13, dtype) + pack(w2, dtype)
        formats[fmt] = (_one_token(proj), planes, sum(t.numel() * t.element_size() for t in planes))
    planes = int4_words(w13) + int4_words(w2)  # the compiled-int4 format's planes and kernel
    formats["int4-words"] = (one_token_moe_int4(), planes, sum(t.numel() * t.element_size() for t in planes))
    del w13, w2
    for fmt, (fn, planes, nbytes) in formats.items():
        y = fn(x, ids0, weights, *planes)
        exact = y if exact is None else exact
        err = ((y - exact).norm() / exact.norm()).item()
        times = []
        for _ in range(steps):
            ids = torch.randperm(e)[:k]
            t0 = time.perf_counter()
            fn(x, ids, weights, *planes)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        read = nbytes * k / e
        print(f"{name} {fmt:9s} T=1: {med * 1e3:6.3f} ms, {read / med / 1e9:6.1f} GB/s of experts "
              f"({read / 1e6:.1f} MB a step; relative difference from int8 {err:.3f})", flush=True)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # one step function, compiled for every format and shape
    print(f"torch {torch.__version__} threads {torch.get_num_threads()}; host read (a sum over 2 GiB): "
          f"{host_read_gbs():.1f} GB/s", flush=True)
    small = "--small" in sys.argv  # fewer experts, for a quick look on a small machine
    layer("80B-A3B", 64 if small else 512, 512, 2048, 10)
    layer("30B-A3B", 32 if small else 128, 768, 2048, 8)


if __name__ == "__main__":
    main()
