"""Evaluate the embedded default model through Strata's own loader and generator.

    python scripts/eval_default_model.py [--model strata/assets/default-model] [--data corpus] [--device cuda]

Measures, on held-out text (corpus/val.bin and the *.val.txt files, never trained on):
  - perplexity of the main head over non-overlapping 1024-token windows;
  - the MTP head's loss, and its top-1 agreement with the main head's next-next token: at row i the
    MTP head (fed h_i and the true t_{i+1}) predicts t_{i+2}; the main head's greedy choice for t_{i+2}
    is its argmax at row i+1. Their agreement is the draft acceptance greedy speculation can expect;
  - pass-key retrieval accuracy (greedy) at 1K and 4K tokens, needle depth 10/50/90%, with filler
    from the held-out text;
  - greedy samples for a few prompts.
Writes <model>/eval.json (or --out).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from strata.data.retrieval import make_retrieval_example  # noqa: E402
from strata.loaders import load_model  # noqa: E402
from strata.attention import CausalBatch  # noqa: E402
from strata.runner.generator import Generator  # noqa: E402
from strata.sampling import SamplingParams  # noqa: E402

SAMPLE_PROMPTS = [
    "It is a truth universally acknowledged, that",
    "In the beginning God created",
    "To be, or not to be:",
    "The list type in Python",
]


@torch.no_grad()
def heldout_scores(lm, val: np.ndarray, seq: int, device) -> dict:
    n_win = (len(val) - 2) // seq
    nll = mtp_nll = agree = count = 0.0
    for w in range(n_win):
        toks = torch.from_numpy(np.asarray(val[w * seq : w * seq + seq + 2], dtype=np.int64)).to(device)
        inp, t1, t2 = toks[:seq], toks[1 : seq + 1], toks[2 : seq + 2]
        pos = torch.arange(seq, device=device)
        attn = CausalBatch(1, seq)
        h = lm.model(inp, pos, attn)
        logits = lm.model.compute_logits(h)
        nll += F.cross_entropy(logits, t1, reduction="sum").item()
        if lm.has_mtp:
            _, mlog = lm.model.mtp_forward(h, t1, pos, attn)
            mtp_nll += F.cross_entropy(mlog, t2, reduction="sum").item()
            agree += (mlog[:-1].argmax(-1) == logits[1:].argmax(-1)).sum().item()
        count += seq
    out = {"windows": n_win, "tokens": int(count), "perplexity": math.exp(nll / count)}
    if lm.has_mtp:
        out["mtp_perplexity"] = math.exp(mtp_nll / count)
        out["mtp_top1_agreement"] = agree / (n_win * (seq - 1))
    return out


def passkey_accuracy(lm, device, dtype, filler: str, lengths, depths, n: int) -> dict:
    gen = Generator(lm.model, lm.tokenizer, max(lengths) + 16, device, dtype)
    table = {}
    for length in lengths:
        for depth in depths:
            ok = 0
            for i in range(n):
                ex = make_retrieval_example(lm.tokenizer, filler, length, depth, kind="passkey", seed=f"eval/{i}")
                ids = lm.tokenizer.encode(ex.prompt)
                out = gen.generate(ids, SamplingParams(max_tokens=ex.answer_tokens + 2, ignore_eos=True))
                ok += out.text.strip().startswith(ex.answer.strip())
            table[f"{length}@{int(depth * 100)}%"] = ok / n
            print(f"  pass-key {length} tokens, depth {depth:.0%}: {ok}/{n}", flush=True)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="strata/assets/default-model")
    ap.add_argument("--data", default="corpus")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=20, help="pass-key trials per (length, depth)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default=None, help="where to write the JSON (default: <model>/eval.json)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32  # evaluate the weights, not a kernel's rounding
    t0 = time.perf_counter()
    lm = load_model(args.model, device=device, dtype=dtype, progress=False)
    load_s = time.perf_counter() - t0

    val = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")
    res: dict = {"model": args.model, "device": str(device), "load_seconds": load_s}
    res["heldout"] = heldout_scores(lm, val, args.seq, device)
    print(json.dumps(res["heldout"]), flush=True)
    filler = "\n".join(open(f).read() for f in sorted(glob.glob(os.path.join(args.data, "*.val.txt"))))
    res["passkey"] = passkey_accuracy(lm, device, dtype, filler, (1024, 4096), (0.1, 0.5, 0.9), args.n)
    res["passkey_n_per_cell"] = args.n
    gen = Generator(lm.model, lm.tokenizer, 512, device, dtype)
    res["samples"] = {p: gen.generate(lm.tokenizer.encode(p), SamplingParams(max_tokens=48)).text for p in SAMPLE_PROMPTS}
    for p, s in res["samples"].items():
        print(f"  {p!r} -> {s!r}", flush=True)
    with open(args.out or os.path.join(args.model, "eval.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
