"""`strata bench quant-kl`: how far each quantized format moves a model's next-token distributions.

The reference is the model as loaded (fp32 on the CPU). For each format, every linear weight whose
rows split into whole blocks of the format (attention, dense MLPs, MoE experts; not the router, not
an LM head tied to the embeddings) is replaced by `dequantize(quantize(W))` through the project's
writers (`strata.kernels.quant.writers`): the exact values the format's kernels multiply by. Then over
`--tokens` tokens of `--text` (or random ids for a random model), in windows of `--ctx`:

- `kld`: mean KL(p_ref ‖ p_quant) per token (natural log), as llama.cpp's `perplexity --kl-divergence`;
- `same_top`: how often both pick the same most likely token;
- `ppl_ratio`: the quantized model's perplexity over the reference's;
- `rms_dp`: root mean square change of the probability of the text's actual next token.

A format `host:F` instead loads the model with every MoE layer's routed experts in host RAM in the CPU
format F (`--host-experts`: float, int8, w8a8, fbgemm, int4; `strata.models.host_experts`), the rest as
the file holds it: how far the copy the CPU computes from is from the file's own weights (not with
`--shape`). A window's tokens reach the experts together, as a prompt step's do; `host:F@token` hands
them one token at a time, as decode steps do (it differs where a format rounds the rows of a call
together: fbgemm).

A format `T>host:F` quantizes every eligible linear weight to the GGUF type T as above, then keeps the
MoE layers' routed experts of that model in host RAM in the CPU format F, scored against the T model
itself: how far the CPU's copy is from a T file's own weights (compiled-int4 keeps the groups of IQ3_S,
Q4_K and Q4_0 on their own grid: zero).

Run on the embedded model and on a random one (`--shape`); docs/QUANTIZATION.md sets the results
beside llama.cpp's published KL table. The writers are simple searches without importance weights,
so these are upper bounds on what llama.cpp's own quantizer would give for the same model.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from strata.bench.results import print_tables, save, summary_table
from strata.kernels.quant import WRITTEN, QWeight, format_module
from strata.loaders import default_model_path, load_model
from strata.attention import CausalBatch
from strata.models.moe import MoE, Router
from strata.models.quantize import qweights_of, quantize_fp8


def quantize_linears(model: nn.Module, ggml_type: str) -> tuple[int, int]:
    """Replace, in place, each eligible linear weight by its quantize → dequantize round trip.
    Returns (quantized parameters, linear parameters left in float)."""
    from strata.kernels.quant.writers import quantize  # the gguf package, only when the bench runs

    mod = format_module(ggml_type)
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.model.embed_tokens.weight
    done = left = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear) or (tied and m is head):
            continue
        w = m.weight.detach()
        if w.shape[1] % mod.BLOCK_VALUES:
            left += w.numel()
            continue
        raw = torch.from_numpy(quantize(ggml_type, w.float().numpy()))
        q = QWeight.from_raw(ggml_type, raw, w.shape[0], w.shape[1]).dequantize().to(w.dtype)
        w.copy_(q)  # in place: stacked projections are views of one buffer
        done += w.numel()
    for m in model.modules():
        if isinstance(m, Router):
            left += m.weight.numel()
    return done, left


def fp8_linears(model: nn.Module) -> tuple[int, int]:
    """`--quantize fp8` itself (activations quantized per token too, not only the weights): returns
    (quantized parameters, linear parameters left in float), as `quantize_linears` counts them."""
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    total += sum(m.weight.numel() for m in model.modules() if isinstance(m, Router))
    quantize_fp8(model)
    done = sum(q.n * q.k for q in qweights_of(model))
    done += sum(m.fp8[0].numel() + m.fp8[2].numel() for m in model.modules() if getattr(m, "fp8", None))
    return done, total - done


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    t = ids.shape[0]
    hidden = model(ids, torch.arange(t), CausalBatch(1, t))
    return model.compute_logits(hidden).float()


def compare(ref_logits: list[torch.Tensor], model, windows: list[torch.Tensor]) -> dict:
    kl, same, nll_ref, nll_q, dp2, n = 0.0, 0, 0.0, 0.0, 0.0, 0
    for ref, ids in zip(ref_logits, windows):
        q = _logits(model, ids)
        lp_ref, lp_q = F.log_softmax(ref, -1), F.log_softmax(q, -1)
        kl += (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).sum().item()
        same += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        nxt = ids[1:]
        a, b = lp_ref[:-1].gather(1, nxt[:, None])[:, 0], lp_q[:-1].gather(1, nxt[:, None])[:, 0]
        nll_ref -= a.sum().item()
        nll_q -= b.sum().item()
        dp2 += ((b.exp() - a.exp()) ** 2).sum().item()
        n += ids.shape[0]
    m = n - len(windows)  # tokens with a next token
    return {"kld": kl / n, "same_top": same / n, "ppl_ratio": float(torch.tensor((nll_q - nll_ref) / m).exp()),
            "rms_dp": (dp2 / m) ** 0.5, "tokens": n}


def _windows(args, loaded) -> tuple[list[torch.Tensor], str]:
    vocab = loaded.config.vocab_size
    if args.shape or loaded.tokenizer is None:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab, (args.tokens,), generator=gen)
        source = "random token ids"
    else:
        text = open(args.text or f"{default_model_path()}/README.md").read()
        ids = torch.tensor(loaded.tokenizer.encode(text * (1 + args.tokens * 8 // max(len(text), 1)))[: args.tokens])
        source = args.text or "the embedded model's README.md"
    return [ids[i : i + args.ctx] for i in range(0, len(ids) - 1, args.ctx)], source


class _TokenByToken:
    """A layer's `HostExperts` as decode steps call it: one token's rows at a time."""

    def __init__(self, host) -> None:
        self.host = host

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out=None) -> torch.Tensor:
        return torch.cat([self.host.forward(x[i : i + 1], ids[i : i + 1], weights[i : i + 1]) for i in range(len(x))])

    def __getattr__(self, name: str):
        return getattr(self.host, name)


def _host_copy(loaded, fmt: str) -> tuple[nn.Module, int, int]:
    """The model loaded again with every MoE layer's routed experts in host RAM as `fmt` (`F@token`: each
    layer's experts called a token at a time): (model, the expert parameters held in that format, the
    linear parameters left as loaded)."""
    fmt, _, calls = fmt.partition("@")
    if calls not in ("", "token"):
        raise SystemExit(f"host:{fmt}@{calls}: the only way of calling is @token")
    cfg = loaded.config
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]
    model = load_model(loaded.path, device="cpu", dtype=torch.float32, progress=False, host_moe_layers=layers,
                       host_experts=fmt).model
    hosts = [m.host for m in model.modules() if isinstance(m, MoE) and m.host is not None]
    if calls:
        for m in model.modules():
            if isinstance(m, MoE) and m.host is not None:
                m.host = _TokenByToken(m.host)
    done = sum(h.num_experts * (h.gate_up.n * h.gate_up.k + h.down.n * h.down.k) for h in hosts)
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Router)))
    return model, done, total - done


def _experts_in_ram(model: nn.Module, fmt: str) -> tuple[int, int]:
    """Every MoE layer's routed experts of `model` moved, in place, to host RAM in the CPU format `fmt`:
    (the expert parameters held in it, the linear parameters left as they were)."""
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Router)))
    done = 0
    for m in model.modules():
        if isinstance(m, MoE):
            done += sum(p.numel() for e in m.experts for p in e.parameters())
            m.host_format = fmt
            m._pack_host()
    return done, total - done


def run(args) -> int:
    def fresh():
        # A new load for each format, never a deep copy: copying a module clones each parameter, and the
        # MoE layers' expert weights would no longer be views of the stacks their forward reads.
        if args.shape:
            from strata.bench.random_model import random_model

            return random_model(args.shape, "cpu", torch.float32, seed=args.seed)
        return load_model(args.model, device="cpu", dtype=torch.float32, progress=False)

    loaded = fresh()
    windows, source = _windows(args, loaded)
    ref = [_logits(loaded.model, w) for w in windows]
    rows = []
    for fmt in args.formats:
        against = ref
        if ">" in fmt:
            stored, host = fmt.split(">", 1)
            if not host.startswith("host:"):
                raise SystemExit(f"{fmt}: the format after > is a host:F one")
            model = fresh().model
            quantize_linears(model, stored)
            against = [_logits(model, w) for w in windows]
            done, left = _experts_in_ram(model, host.removeprefix("host:"))
        elif fmt.startswith("host:"):
            if args.shape:
                raise SystemExit("host: formats load the model's file: not with --shape")
            model, done, left = _host_copy(loaded, fmt.removeprefix("host:"))
        else:
            model = fresh().model
            done, left = fp8_linears(model) if fmt == "FP8" else quantize_linears(model, fmt)
        row = {"format": fmt, **compare(against, model, windows), "quantized_share": done / max(done + left, 1)}
        rows.append(row)
        print(f"{fmt:6s}: KLD {row['kld']:.6f}, same top {row['same_top']:.4f}, PPL ratio {row['ppl_ratio']:.4f}, "
              f"RMS dp {row['rms_dp']:.4f} ({row['quantized_share']:.0%} of linear weights quantized)", flush=True)
        del model
    name = args.shape or "default"
    info = {"bench": "quant-kl", "model": name, "text": source, "ctx": args.ctx, "seed": args.seed, "rows": rows,
            "summary": {r["format"]: {k: r[k] for k in ("kld", "same_top", "ppl_ratio")} for r in rows}}
    out = args.out or f"bench/results/quant_kl_{name}_cpu.json"

    def draw(plt, info):
        plt.bar([r["format"] for r in info["rows"]], [r["kld"] for r in info["rows"]])
        plt.yscale("log")
        plt.ylabel("mean KL divergence vs the unquantized model")

    save(info, out, draw)
    print_tables([summary_table(f"quantization fidelity: {name} model, {rows[0]['tokens'] if rows else 0} tokens",
                                [("format", "format", ""), ("KLD", "kld", ".6f"), ("same top", "same_top", ".4f"),
                                 ("PPL ratio", "ppl_ratio", ".4f"), ("RMS Δp", "rms_dp", ".4f"),
                                 ("quantized", "quantized_share", ".2f")], rows)])
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quant-kl", help="next-token KL of quantized formats against the unquantized model (CPU)")
    _add_args(p)


def _add_args(p) -> None:
    from strata.bench.random_model import SHAPES

    p.add_argument("--model", default=None, help="model path (default: the embedded model)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a random model at this shape instead")
    p.add_argument("--formats", type=lambda s: [f for f in s.split(",") if f], default=[*WRITTEN, "FP8"],
                   help=f"comma-separated, of {', '.join(WRITTEN)}, FP8 (the formats the project's writers make), "
                        "host:float, host:int8, host:w8a8, host:fbgemm, host:compiled, host:compiled-int4, host:int4 (MoE experts in host RAM in "
                        "that CPU format; host:F@token: called a token at a time, as decode steps call them), "
                        "T>host:F (the model in the GGUF type T, its experts then in RAM in F, against the T model)")
    p.add_argument("--text", default=None, help="text to score (default: the embedded model's README)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="strata bench quant-kl")
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
