"""Train Strata's embedded default model: a small glm4_moe with an MTP head.

The shipped model was made in two stages on one H200 (about 5 + 4 minutes):

    # 1. language model + MTP head: 605 steps of 65K tokens, rows of 1K (3 steps in 4) and 4K tokens
    python scripts/train_default_model.py --data corpus --out runs/stage1 \
        --tokenizer strata/assets/default-model --steps 605
    # 2. retrieval: 103 steps on 512-token rows, 60% of them pass-key / key-value examples whose
    #    answers get their own loss term
    python scripts/train_default_model.py --data corpus --out strata/assets/default-model \
        --init runs/stage1 --steps 103 --warmup 30 --lr 6e-4 --batch 128 --seq 512 --short-seq 512 \
        --retrieval-frac 0.6 --eval-every 250 --answer-weight 1 --answer-loss-weight 1

Stage 1 alone learnt English-like text and a good MTP head but no retrieval (pass-key 0%), also when
run longer; in stage 2 the lookup appeared within ~100 steps.

Inputs (built by scripts/build_corpus.py, train_tokenizer.py and prepare_training_data.py):
  <out>/tokenizer.json            the byte-level BPE the model is trained for
  <data>/train.bin, val.bin       uint16 token streams
  <data>/{kjv,web,austen,shakespeare}.train.txt   filler for retrieval examples made on the fly

The model is Strata's own `Glm4MoeForCausalLM` (strata/models), trained in plain PyTorch with bf16
autocast: next-token loss plus 0.3 x the MTP head's loss on the token after next (DeepSeek-V3 style,
the head fed the main model's final hidden state and the next token's embedding). MoE load is kept
even without an auxiliary loss by nudging each router's score-correction bias toward under-used
experts after every step (DeepSeek-V3's aux-loss-free balancing).

Everything is seeded (torch, numpy); GPU atomics (index_add in the MoE backward) are not bitwise
deterministic, so two runs agree closely but not exactly. Writes <out>/config.json,
model.safetensors and training_log.json (loss curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from strata.config import ModelConfig  # noqa: E402
from strata.attention import CausalBatch  # noqa: E402
from strata.models.moe import MoE  # noqa: E402
from strata.models.registry import build_model  # noqa: E402

MTP_WEIGHT = 0.3


def model_config(vocab_size: int, eos_id: int, ctx: int) -> dict:
    """HF config.json for the default model (≈9M parameters, ≈18 MB in bf16)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 6,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": ctx,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "bos_token_id": None,
        "torch_dtype": "bfloat16",
    }


PROSE_SOURCES = ("kjv", "web", "austen", "shakespeare")


class RetrievalMaker:
    """Retrieval example number i, made fresh (so no example repeats across the run): a pass key or
    key-value lookup of log-uniform length up to the context, needle at a uniform depth, a quarter of
    them as a ChatML turn. Returns (tokens ending in EOS, index of the first answer token)."""

    def __init__(self, tokenizer_path: str, data: str, seed: int):
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(tokenizer_path)
        self.eos = self.tk.token_to_id("<|endoftext|>")
        self.filler = "\n".join(open(os.path.join(data, f"{s}.train.txt")).read() for s in PROSE_SOURCES)
        self.seed = seed

    def __call__(self, request: tuple[int, int]) -> tuple[np.ndarray, int]:
        i, max_len = request
        import random

        from strata.data.retrieval import make_retrieval_example

        rng = random.Random(f"train/{self.seed}/{i}")
        top = max_len - 16
        length = top if rng.random() < 0.1 else int(math.exp(rng.uniform(math.log(200), math.log(top))))
        kind = rng.choice(("passkey", "kv"))
        ex = make_retrieval_example(self.tk, self.filler, length, rng.random(), kind=kind, seed=f"{self.seed}/{i}",
                                    n_pairs=rng.randint(2, 8), n_digits=rng.randint(4, 7))
        if rng.random() < 0.25:
            (user,), reply = ex.chat()
            prompt = f"<|im_start|>user\n{user['content']}<|im_end|>\n<|im_start|>assistant\n"
            answer = reply + "<|im_end|>\n"
        else:
            prompt, answer = ex.prompt, ex.answer
        p = self.tk.encode(prompt, add_special_tokens=False).ids
        a = self.tk.encode(answer, add_special_tokens=False).ids
        return np.array(p + a + [self.eos], dtype=np.int64)[:max_len], len(p)


class Schedule:
    """Which rows each step trains on. Most steps read 1024-token rows (cheap attention, more
    sequences); every `long_every`-th step reads `seq`-token rows so retrieval is learnt at full length.
    Tokens per step are the same either way; retrieval rows per step are fixed, so the stream of
    retrieval examples the workers must make is known in advance (and the run is deterministic)."""

    def __init__(self, seq: int, rows_long: int, short: int, long_every: int, frac: float):
        self.seq, self.rows_long, self.short, self.long_every, self.frac = seq, rows_long, short, long_every, frac

    def shape(self, step: int) -> tuple[int, int]:
        if step % self.long_every == self.long_every - 1 or self.short >= self.seq:
            return self.rows_long, self.seq
        return self.rows_long * self.seq // self.short, self.short

    def retrieval_rows(self, step: int) -> int:
        return round(self.shape(step)[0] * self.frac)

    def requests(self):
        i = 0
        step = 0
        while True:
            _, t = self.shape(step)
            for _ in range(self.retrieval_rows(step)):
                yield i, t + 2
                i += 1
            step += 1


class Batches:
    """Rows of corpus windows, and rows that start with a fresh retrieval example (which ends with an
    end-of-text token; the rest of the row continues with corpus text). Retrieval examples are made by
    a pool of worker processes, in order."""

    def __init__(self, data: str, tokenizer_path: str, sched: Schedule, seed: int, workers: int):
        import multiprocessing as mp

        self.train = np.memmap(os.path.join(data, "train.bin"), dtype=np.uint16, mode="r")
        self.val = np.memmap(os.path.join(data, "val.bin"), dtype=np.uint16, mode="r")
        self.sched = sched
        self.rng = np.random.default_rng(seed)
        self.retrieval_tokens = self.total_tokens = 0
        maker = RetrievalMaker(tokenizer_path, data, seed)
        self.pool = mp.get_context("fork").Pool(workers)
        self.examples = self.pool.imap(maker, sched.requests(), chunksize=2)

    def _window(self, src: np.ndarray, n: int) -> np.ndarray:
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        i = int(self.rng.integers(0, len(src) - n - 1))
        return np.asarray(src[i : i + n], dtype=np.int64)

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [rows, T+2], loss weights [rows, T+2]); +2 so the MTP target exists."""
        rows, t = self.sched.shape(step)
        n = t + 2
        toks = np.empty((rows, n), dtype=np.int64)
        w = np.zeros((rows, n), dtype=np.float32)  # 1 on retrieval answer tokens, else 0
        for r in range(rows):
            if r < self.sched.retrieval_rows(step):
                ex, ans = next(self.examples)
                toks[r] = np.concatenate([ex, self._window(self.train, n - len(ex))])
                w[r, ans : len(ex)] = 1.0
                self.retrieval_tokens += len(ex)
            else:
                toks[r] = self._window(self.train, n)
        self.total_tokens += rows * n
        return torch.from_numpy(toks), torch.from_numpy(w)

    def val_batches(self, rows: int, seq: int, count: int) -> list[torch.Tensor]:
        n = seq + 2
        step = max((len(self.val) - n) // (rows * count), 1)
        starts = [i * step for i in range(rows * count)]
        arr = np.stack([np.asarray(self.val[s : s + n], dtype=np.int64) for s in starts])
        return [torch.from_numpy(arr[i * rows : (i + 1) * rows]) for i in range(count)]


def losses(model, toks: torch.Tensor, answer_mask: torch.Tensor | None = None,
           answer_weight: float = 1.0, answer_loss_weight: float = 0.0):
    """Next-token and MTP (token after next) losses for a batch [B, T+2].

    Each is the mean over all tokens with retrieval answer tokens counted `answer_weight` times, plus
    `answer_loss_weight` x the mean over answer tokens alone. Answers are ~0.2% of the tokens, so
    inside the mean their gradient all but vanishes; their own mean term is what teaches lookup."""
    b, n = toks.shape
    t = n - 2
    inp = toks[:, :t].reshape(-1)
    pos = torch.arange(t, device=toks.device).repeat(b)
    attn = CausalBatch(b, t)
    hidden = model(inp, pos, attn)
    logits = model.compute_logits(hidden)
    tgt1 = toks[:, 1 : t + 1].reshape(-1)
    tgt2 = toks[:, 2 : t + 2].reshape(-1)
    _, mtp_logits = model.mtp_forward(hidden, tgt1, pos, attn)
    ce1 = F.cross_entropy(logits, tgt1, reduction="none")
    ce2 = F.cross_entropy(mtp_logits, tgt2, reduction="none")
    if answer_mask is None:
        return ce1.mean(), ce2.mean()
    out = []
    for ce, m in ((ce1, answer_mask[:, 1 : t + 1].reshape(-1)), (ce2, answer_mask[:, 2 : t + 2].reshape(-1))):
        w = 1.0 + (answer_weight - 1.0) * m
        loss = (ce * w).sum() / w.sum()
        if answer_loss_weight:
            loss = loss + answer_loss_weight * (ce * m).sum() / m.sum().clamp(min=1)
        out.append(loss)
    return out[0], out[1]


def rebalance(model, rate: float) -> list[float]:
    """Aux-loss-free balancing; returns each MoE layer's max/mean expert load."""
    imbalance = []
    for m in model.modules():
        if isinstance(m, MoE) and m.last_expert_ids is not None:
            load = torch.bincount(m.last_expert_ids.flatten(), minlength=m.num_experts).float()
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            imbalance.append((load.max() / load.mean()).item())
    return imbalance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="corpus")
    ap.add_argument("--out", default="strata/assets/default-model")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: --out)")
    ap.add_argument("--steps", type=int, default=1800, help="0: pick from --budget-minutes after 20 timed steps")
    ap.add_argument("--budget-minutes", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=16, help="rows per long step (short steps: same tokens)")
    ap.add_argument("--short-seq", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=4096, help="the model's context (config.json)")
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--retrieval-frac", type=float, default=0.3)
    ap.add_argument("--answer-weight", type=float, default=4.0, help="answer tokens' weight inside the mean loss")
    ap.add_argument("--answer-loss-weight", type=float, default=0.0, help="weight of the answers' own mean loss")
    ap.add_argument("--init", default=None, help="continue from this checkpoint directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4, help="processes making retrieval examples")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    from tokenizers import Tokenizer

    tok_path = os.path.join(args.tokenizer or args.out, "tokenizer.json")
    tk = Tokenizer.from_file(tok_path)
    eos = tk.token_to_id("<|endoftext|>")
    hf_cfg = model_config(tk.get_vocab_size(), eos, max(args.ctx, args.seq))
    cfg = ModelConfig.from_hf(hf_cfg)
    with dev:
        model = build_model(cfg, with_mtp=True)
    model.tie_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
        for name, p in model.named_parameters():  # scale residual outputs by depth (GPT-2 style)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(1 / math.sqrt(2 * (cfg.num_hidden_layers + 1)))
    if args.init:
        from strata.loaders import load_model

        src = load_model(args.init, device=dev, dtype=torch.float32, progress=False, pack_experts=False).model
        with torch.no_grad():
            sd = src.state_dict()
            for name, t in model.state_dict().items():
                t.copy_(sd[name])
    for m in model.modules():
        if isinstance(m, MoE):
            m.keep_routing = True
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f}M", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(args.steps - args.warmup, 1)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    sched = Schedule(args.seq, args.batch, args.short_seq, args.long_every, args.retrieval_frac)
    data = Batches(args.data, tok_path, sched, args.seed, args.workers)
    val = data.val_batches(rows=8, seq=1024, count=8)
    log: dict = {"args": vars(args), "parameters": n_params, "train": [], "val": []}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def evaluate(step: int) -> None:
        model.eval()
        tot1 = tot2 = 0.0
        with torch.no_grad(), amp:
            for vb in val:
                l1, l2 = losses(model, vb.to(dev))
                tot1, tot2 = tot1 + l1.item(), tot2 + l2.item()
        model.train()
        rec = {"step": step, "loss": tot1 / len(val), "mtp_loss": tot2 / len(val), "ppl": math.exp(tot1 / len(val))}
        log["val"].append(rec)
        print(f"  val step {step}: loss {rec['loss']:.3f} (ppl {rec['ppl']:.1f}) mtp {rec['mtp_loss']:.3f}", flush=True)

    t0 = time.perf_counter()
    model.train()
    step = -1
    while step + 1 < (args.steps or 10**9):
        step += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        toks, w = data.train_batch(step)
        with amp:
            l1, l2 = losses(model, toks.to(dev, non_blocking=True), w.to(dev, non_blocking=True),
                            args.answer_weight, args.answer_loss_weight)
            loss = l1 + MTP_WEIGHT * l2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            imb = rebalance(model, 1e-3)
        if step % 20 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            rec = {"step": step, "loss": l1.item(), "mtp_loss": l2.item(), "lr": lr_at(step),
                   "grad_norm": gnorm.item(), "max_load_ratio": max(imb) if imb else 1.0, "seconds": el}
            log["train"].append(rec)
            tok_s = (step + 1) * args.batch * args.seq / el
            print(f"step {step}: loss {rec['loss']:.3f} mtp {rec['mtp_loss']:.3f} gnorm {rec['grad_norm']:.2f} "
                  f"load {rec['max_load_ratio']:.2f} {el:.0f}s {tok_s / 1e3:.0f}K tok/s", flush=True)
        if step == 4:
            t_warm = time.perf_counter()
        if args.steps == 0 and step == 24:
            per_step = (time.perf_counter() - t_warm) / 20
            args.steps = max(int((args.budget_minutes * 60 - (t_warm - t0)) / per_step), args.warmup + 1, 26)
            log["args"]["steps"] = args.steps
            print(f"{per_step * 1000:.0f} ms/step: training for {args.steps} steps", flush=True)
        if args.steps and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            evaluate(step + 1)
    log["train_seconds"] = time.perf_counter() - t0
    log["retrieval_token_share"] = data.retrieval_tokens / max(data.total_tokens, 1)
    print(f"retrieval examples: {data.retrieval_tokens / max(data.total_tokens, 1):.1%} of training tokens", flush=True)
    save(model, hf_cfg, args.out, log)
    if args.tokenizer and os.path.abspath(args.tokenizer) != os.path.abspath(args.out):
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer, f), os.path.join(args.out, f))


def save(model, hf_cfg: dict, out: str, log: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}  # tied to the embedding
    # The router's correction bias stays fp32 (the loader keeps it fp32 too).
    for k in sd:
        if k.endswith("e_score_correction_bias"):
            sd[k] = model.state_dict()[k].float().contiguous()
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(out, "training_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(f"wrote {out}/model.safetensors ({size / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
