"""`strata bench kv`: what int8 KV storage costs in accuracy, against the model-dtype (or bf16) pool.

For each model, a held-out text is split into windows; each window is read in chunks through the paged
attention path twice, once per pool, so later chunks attend to K/V read back from the pool (quantized
ones for int8). Reported per model: top-1 agreement of the next-token argmax and the mean / max KL
divergence KL(reference || int8) of the next-token distributions, over every position.
"""

from __future__ import annotations

import os
import time

import torch

from strata.bench.results import print_tables, save, summary_table
from strata.config import ModelConfig
from strata.kvcache.allocator import BlockAllocator
from strata.kvcache.pool import make_pool
from strata.loaders import default_model_path, load_model
from strata.models.registry import build_model
from strata.attention.reference import PagedAttention

HELD_OUT = os.path.join(default_model_path(), "README.md")  # English text the default model never saw

RANDOM_MODELS = {
    "random-qwen3": dict(model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "random-glm4_moe": dict(model_type="glm4_moe", vocab_size=8192, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                            n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
                            use_qk_norm=True, attention_bias=True),
}


@torch.inference_mode()
def window_logits(model, ids: torch.Tensor, kind: str, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    cfg, n = model.config, len(ids)
    bs = 16
    blocks = (n + bs - 1) // bs
    pool = make_pool(kind, model.num_attention_layers, blocks + 1, bs, cfg.num_key_value_heads, cfg.head_dim,
                     ids.device, dtype)
    table = torch.tensor(BlockAllocator(blocks + 1, bs).allocate(blocks), device=ids.device)[None]
    attn = PagedAttention(pool)
    out = []
    for s in range(0, n, chunk):
        pos = torch.arange(s, min(s + chunk, n), device=ids.device)
        slots = table[0, pos // bs] * bs + pos % bs
        attn.prepare(slots, [s], [len(pos)], table.int())
        out.append(model.compute_logits(model(ids[pos], pos, attn)))
    return torch.cat(out)


def compare(model, ids: torch.Tensor, window: int, chunk: int, reference: str, dtype) -> dict:
    agree = total = 0
    kl_sum, kl_max = 0.0, 0.0
    for s in range(0, len(ids) - window + 1, window):
        w = ids[s : s + window]
        ref = window_logits(model, w, reference, chunk, dtype).log_softmax(-1)
        q = window_logits(model, w, "int8", chunk, dtype).log_softmax(-1)
        kl = (ref.exp() * (ref - q)).sum(-1)
        agree += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        total += len(w)
        kl_sum += kl.sum().item()
        kl_max = max(kl_max, kl.max().item())
    return {"positions": total, "top1_agreement": agree / total, "kl_mean": kl_sum / total, "kl_max": kl_max}


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = "bf16" if device.type == "cuda" else "auto"
    results = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "reference_pool": reference,
               "window": args.window, "chunk": args.chunk, "models": {}}
    lm = load_model(None, device=device, dtype=dtype, progress=False)
    ids = torch.tensor(lm.tokenizer.encode(open(HELD_OUT).read()), device=device)[: args.max_tokens]
    results["text_tokens"] = len(ids)
    todo = [("default", lm.model)]
    for name, d in RANDOM_MODELS.items():
        torch.manual_seed(0)
        with torch.device(device):
            m = build_model(ModelConfig.from_hf(d))
            for pname, t in m.named_parameters():
                if pname.endswith("gate.weight") and t.dim() == 2:  # routers start at zero: break the ties
                    torch.nn.init.normal_(t, 0, 0.1)
            m = m.to(dtype).eval()
        todo.append((name, m))
    for name, model in todo:
        t0 = time.perf_counter()
        r = compare(model, ids, args.window, args.chunk, reference, dtype)
        r["seconds"] = time.perf_counter() - t0
        results["models"][name] = r
        print(f"{name:18s} top-1 agreement {r['top1_agreement']:.4f}  KL mean {r['kl_mean']:.2e}  max {r['kl_max']:.2e}")
    save(results, args.out, _draw)
    print_tables(summary_tables(results))
    return 0


def summary_tables(info: dict) -> list:
    """One row per model, as a rich table (the JSON holds the same numbers)."""
    columns = [("model", "model", ""), ("positions", "positions", "d"), ("top-1 agreement", "top1_agreement", ".4f"),
               ("KL mean", "kl_mean", ".2e"), ("KL max", "kl_max", ".2e"), ("seconds", "seconds", ".1f")]
    rows = [{"model": name, **r} for name, r in info["models"].items()]
    title = f"int8 KV against the {info['reference_pool']} pool on {info['device']} ({info['dtype']})"
    return [summary_table(title, columns, rows)]


def _draw(plt, info: dict) -> None:
    names = list(info["models"])
    _, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(range(len(names)), [100 * info["models"][n]["top1_agreement"] for n in names])
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(95, 100)
    ax.set_ylabel("top-1 agreement, int8 vs reference (%)")
    ax.set_title(f"int8 KV cache on {info['device']} ({info['dtype']})")


def add_parser(sub) -> None:
    p = sub.add_parser("kv", help="int8 KV cache accuracy against the unquantized pool")
    p.add_argument("--device", default=None)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--out", default="bench/results/kv_int8_cpu.json")
    p.set_defaults(func=run)
