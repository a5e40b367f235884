#!/usr/bin/env python3
"""Tokenize the corpus and build the masked retrieval/chat mix for training Strata's default model.

Needs `corpus/` from `scripts/build_corpus.py` and the tokenizer from `scripts/train_tokenizer.py`.

    python scripts/prepare_training_data.py [--corpus corpus] [--seed 0] [--retrieval-frac 0.15]
                                             [--chat-frac 0.015] [--max-len 4096] [--min-len 200]

Files written to `corpus/` (all token ids are uint16 little-endian, the vocabulary has 8192 entries):

  train.bin, val.bin
      Flat token streams: every document of every source (manifest order, documents in corpus order)
      followed by <|endoftext|> (id 0). Read with `np.memmap(path, dtype=np.uint16, mode="r")` and sample
      windows of up to 4096 + 1 tokens anywhere; loss on every position.

  retrieval_train.*, retrieval_val.*, chat_train.*   (each a .bin, an .idx.npy and a .kind.npy)
      Masked examples, each a complete sequence of at most --max-len (4096) tokens, stored back to back in
      the .bin (uint16). The index (.idx.npy) is a uint32 array of shape (N, 3), one row per example:
          offset       first token of the example in the .bin
          length       its number of tokens (the last one is <|endoftext|>)
          answer_start tokens before the first trained one: train on positions [answer_start, length)
                       (i.e. predict token t from tokens < t for t in that range); the prompt is context only
      and .kind.npy a uint8 array of shape (N, 2), the same rows:
          kind         0 pass key, 1 key-value lookup, 2 KJV verse continuation
          chat         1 if the example is ChatML (<|im_start|>user ... <|im_end|>\n<|im_start|>assistant\n
                       reply<|im_end|>), 0 for the raw completion format of `strata.data.retrieval`
      Use each example as its own sequence (pad to a length bucket, padding masked out), or pack several
      into one window with the loss limited to their trained spans. `read_masked(prefix)` below returns
      (tokens, index, kinds) and `loss_mask(index_row)` the per-token mask of one example.
      retrieval_train holds only pass-key/key-value examples, so sampling its rows uniformly gives the
      retrieval mix; they come from `strata.data.retrieval.iter_retrieval_examples` (lengths
      log-uniform in [--min-len, --max-len] with 10% at exactly --max-len, depths uniform in [0, 1]
      with 5% at exactly 0 or 1),
      with filler cut from the prose sources' own split (kjv, web, austen, shakespeare); a quarter of them
      are wrapped as a chat turn. Their tokens are --retrieval-frac of all training tokens (train.bin +
      retrieval_train.bin + chat_train.bin). chat_train (optional for training) holds KJV verse
      continuations as chat turns, user "Continue: <start of a verse>", assistant "<rest of it>", for
      --chat-frac of the training tokens. retrieval_val holds 64 pass-key/key-value examples built from
      the val split for evaluation.

  data_stats.json
      Token counts per source and split, bytes per token, the mix and the seed.

Same corpus, tokenizer and seed: same bytes. The GPU run needs the .bin/.npy files listed above (not the
.txt files): the script checks that they stay under 40 MB together.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import numpy as np
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from build_corpus import read_docs  # noqa: E402

from strata.data.retrieval import iter_retrieval_examples  # noqa: E402

EOS = "<|endoftext|>"
PROSE_SOURCES = ("kjv", "web", "austen", "shakespeare")
KIND_CODES = {"passkey": 0, "kv": 1, "continue": 2}
CHAT_SHARE = 0.25  # of the retrieval examples, wrapped as a chat turn
MAX_BIN_BYTES = 40 * 1000 * 1000
N_RETRIEVAL_VAL = 64


def read_masked(prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens uint16 memmap, index uint32 (N, 3), kinds uint8 (N, 2)) of `<prefix>.bin/.idx.npy/.kind.npy`."""
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    return tokens, np.load(prefix + ".idx.npy"), np.load(prefix + ".kind.npy")


def loss_mask(row: np.ndarray) -> np.ndarray:
    """Boolean mask over one example's tokens: True where the model is trained."""
    mask = np.zeros(int(row[1]), dtype=bool)
    mask[int(row[2]):] = True
    return mask


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class Writer:
    """Collects masked examples into one token array and an index."""

    def __init__(self, eos_id: int, max_len: int):
        self.eos_id, self.max_len = eos_id, max_len
        self.chunks: list[np.ndarray] = []
        self.rows: list[tuple[int, int, int]] = []
        self.kinds: list[tuple[int, int]] = []
        self.n_tokens = 0

    def add(self, prompt_ids: list[int], answer_ids: list[int], kind: str, chat: bool) -> None:
        ids = prompt_ids + answer_ids + [self.eos_id]
        if len(ids) > self.max_len:
            raise AssertionError(f"{kind} example of {len(ids)} tokens exceeds {self.max_len}")
        self.rows.append((self.n_tokens, len(ids), len(prompt_ids)))
        self.kinds.append((KIND_CODES[kind], int(chat)))
        self.chunks.append(np.asarray(ids, dtype=np.uint16))
        self.n_tokens += len(ids)

    def save(self, prefix: str) -> dict:
        tokens = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.uint16)
        tokens.astype("<u2").tofile(prefix + ".bin")
        index = np.asarray(self.rows, dtype=np.uint32).reshape(-1, 3)
        np.save(prefix + ".idx.npy", index)
        kind = np.asarray(self.kinds, dtype=np.uint8).reshape(-1, 2)
        np.save(prefix + ".kind.npy", kind)
        by_kind = {k: int((kind[:, 0] == c).sum()) for k, c in KIND_CODES.items()}
        trained = int((index[:, 1] - index[:, 2]).sum())
        return {"examples": len(self.rows), "tokens": int(tokens.size), "trained_tokens": trained,
                "by_kind": by_kind, "chat_examples": int(kind[:, 1].sum()),
                "max_length": int(index[:, 1].max()) if len(index) else 0}


def add_retrieval(w: Writer, tk: Tokenizer, filler: str, seed: int, n_target: int | None, n_examples: int | None,
                  min_len: int, max_len: int) -> None:
    rng = random.Random(f"prepare/chat-wrap/{seed}")
    # chat-wrapped examples get 16 tokens of headroom for the ChatML frame, +1 for the final EOS
    stream = iter_retrieval_examples(tk, filler, seed=seed, min_tokens=min_len, max_tokens=max_len - 17)
    count = 0
    while (n_target is not None and w.n_tokens < n_target) or (n_examples is not None and count < n_examples):
        ex = next(stream)
        if rng.random() < CHAT_SHARE:
            messages, reply = ex.chat()
            prompt_ids = tk.encode(chatml(messages[0]["content"])).ids
            answer_ids = tk.encode(reply + "<|im_end|>").ids
            w.add(prompt_ids, answer_ids, ex.kind, True)
        else:
            w.add(tk.encode(ex.prompt).ids, tk.encode(ex.answer).ids, ex.kind, False)
        count += 1


def add_continuations(w: Writer, tk: Tokenizer, kjv_docs: list[str], seed: int, n_target: int) -> None:
    """KJV verses as chat turns: user "Continue: <first words>", assistant "<the rest of the verse>"."""
    verses = []
    for doc in kjv_docs:
        for line in doc.split("\n")[2:]:  # skip the "Book N" heading
            words = line.split(" ")[1:]  # drop the verse number
            if len(words) >= 10:
                verses.append(words)
    rng = random.Random(f"prepare/continue/{seed}")
    start = w.n_tokens
    while w.n_tokens - start < n_target:
        words = rng.choice(verses)
        cut = rng.randint(max(3, int(0.3 * len(words))), int(0.6 * len(words)))
        prompt_ids = tk.encode(chatml("Continue: " + " ".join(words[:cut]))).ids
        answer_ids = tk.encode(" ".join(words[cut:]) + "<|im_end|>").ids
        w.add(prompt_ids, answer_ids, "continue", True)


def tokenize_split(tk: Tokenizer, manifest: dict, corpus: str, split: str, eos_id: int) -> tuple[np.ndarray, dict]:
    parts, stats = [], {}
    for s in manifest["sources"]:
        docs = read_docs(os.path.join(corpus, s["files"][split]["path"]))
        n_tok = 0
        for enc in tk.encode_batch(docs, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=np.uint16))
            n_tok += len(enc.ids)
        n_bytes = sum(len(d.encode("utf-8")) for d in docs)
        stats[s["source"]] = {"docs": len(docs), "bytes": n_bytes, "tokens": n_tok + len(docs),
                              "bytes_per_token": round(n_bytes / max(1, n_tok), 4)}
    return np.concatenate(parts), stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=os.path.join(ROOT, "corpus"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "strata", "assets", "default-model", "tokenizer.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retrieval-frac", type=float, default=0.15)
    ap.add_argument("--chat-frac", type=float, default=0.015)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args(argv)
    if not 0 <= args.retrieval_frac + args.chat_frac < 0.5:
        ap.error("--retrieval-frac + --chat-frac must be below 0.5")
    for need in (os.path.join(args.corpus, "manifest.json"), args.tokenizer):
        if not os.path.exists(need):
            print(f"missing {need}: run scripts/build_corpus.py and scripts/train_tokenizer.py first",
                  file=sys.stderr)
            return 2
    t0 = time.time()
    tk = Tokenizer.from_file(args.tokenizer)
    eos_id = tk.token_to_id(EOS)
    if tk.get_vocab_size() > 65536 or eos_id is None:
        raise SystemExit("tokenizer must have <|endoftext|> and fit uint16 ids")
    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = json.load(f)

    stats: dict = {"tokenizer_sha256": hashlib.sha256(open(args.tokenizer, "rb").read()).hexdigest(),
                   "vocab_size": tk.get_vocab_size(), "seed": args.seed, "eos_id": eos_id, "splits": {}}
    for split in ("train", "val"):
        tokens, per_source = tokenize_split(tk, manifest, args.corpus, split, eos_id)
        tokens.astype("<u2").tofile(os.path.join(args.corpus, f"{split}.bin"))
        n_bytes = sum(v["bytes"] for v in per_source.values())
        n_text = sum(v["tokens"] - v["docs"] for v in per_source.values())
        stats["splits"][split] = {"tokens": int(tokens.size), "bytes_per_token": round(n_bytes / n_text, 4),
                                  "sources": per_source}
        print(f"{split}.bin: {tokens.size:,} tokens ({n_bytes / n_text:.3f} bytes/token)")

    def prose(split: str) -> str:
        docs = []
        for s in manifest["sources"]:
            if s["source"] in PROSE_SOURCES:
                docs += read_docs(os.path.join(args.corpus, s["files"][split]["path"]))
        if not docs:
            raise SystemExit(f"no prose source ({', '.join(PROSE_SOURCES)}) in the corpus for filler")
        return "\n\n".join(docs)

    n_text = stats["splits"]["train"]["tokens"]
    total = n_text / (1 - args.retrieval_frac - args.chat_frac)
    w = Writer(eos_id, args.max_len)
    add_retrieval(w, tk, prose("train"), args.seed, round(args.retrieval_frac * total), None,
                  args.min_len, args.max_len)
    stats["retrieval_train"] = w.save(os.path.join(args.corpus, "retrieval_train"))
    wc = Writer(eos_id, args.max_len)
    kjv = [s for s in manifest["sources"] if s["source"] == "kjv"]
    if kjv and args.chat_frac > 0:
        kjv_docs = read_docs(os.path.join(args.corpus, kjv[0]["files"]["train"]["path"]))
        add_continuations(wc, tk, kjv_docs, args.seed, round(args.chat_frac * total))
    stats["chat_train"] = wc.save(os.path.join(args.corpus, "chat_train"))
    wv = Writer(eos_id, args.max_len)
    add_retrieval(wv, tk, prose("val"), args.seed + 1_000_003, None, N_RETRIEVAL_VAL, args.min_len, args.max_len)
    stats["retrieval_val"] = wv.save(os.path.join(args.corpus, "retrieval_val"))
    all_train = n_text + stats["retrieval_train"]["tokens"] + stats["chat_train"]["tokens"]
    stats["mix"] = {
        "train_text_tokens": n_text,
        "retrieval_tokens": stats["retrieval_train"]["tokens"],
        "chat_tokens": stats["chat_train"]["tokens"],
        "retrieval_share_of_training_tokens": round(stats["retrieval_train"]["tokens"] / all_train, 4),
        "chat_share_of_training_tokens": round(stats["chat_train"]["tokens"] / all_train, 4),
    }
    for name in ("retrieval_train", "retrieval_val", "chat_train"):
        r = stats[name]
        print(f"{name}: {r['examples']} examples, {r['tokens']:,} tokens ({r['trained_tokens']:,} trained), "
              f"{r['by_kind']}, {r['chat_examples']} chat, longest {r['max_length']}")
    print(f"share of training tokens: retrieval {stats['mix']['retrieval_share_of_training_tokens']:.1%}, "
          f"chat {stats['mix']['chat_share_of_training_tokens']:.1%}")
    bins = ["train.bin", "val.bin"] + [f"{name}{ext}" for name in ("retrieval_train", "retrieval_val", "chat_train")
                                         for ext in (".bin", ".idx.npy", ".kind.npy")]
    size = sum(os.path.getsize(os.path.join(args.corpus, b)) for b in bins)
    stats["files"] = {b: os.path.getsize(os.path.join(args.corpus, b)) for b in bins}
    stats["files_total_bytes"] = size
    with open(os.path.join(args.corpus, "data_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
        f.write("\n")
    print(f"files for the GPU run: {size / 1e6:.1f} MB ({', '.join(bins)}); {time.time() - t0:.0f}s")
    if size > MAX_BIN_BYTES:
        print(f"error: more than {MAX_BIN_BYTES / 1e6:.0f} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
