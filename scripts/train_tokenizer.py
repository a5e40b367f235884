#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of Strata's embedded default model.

Reads the train split written by `scripts/build_corpus.py` (every `corpus/<source>.train.txt`, in
manifest order; the val split is only measured), trains a byte-level BPE with the `tokenizers` library and
writes into `strata/assets/default-model/`:

  tokenizer.json          the tokenizer: ids 0-2 are the special tokens <|endoftext|> (end of text, also
                          padding), <|im_start|>, <|im_end|>; digits are split one per token; 256 byte
                          tokens; merges up to the vocabulary size (8192 by default)
  tokenizer_config.json   eos/pad `<|endoftext|>`, no BOS (`bos_token: null`, `add_bos_token: false`),
                          a ChatML chat template, model_max_length 4096

Then it checks the result: Strata's `Tokenizer.from_hf_dir` loads it and round-trips every val document,
the chat template renders, and (when transformers is installed) `AutoTokenizer.from_pretrained` gives the
same ids and the same rendered chat. It prints the vocabulary size and bytes per token on the val split.

    python scripts/train_tokenizer.py [--vocab-size 8192] [--corpus corpus] [--out strata/assets/default-model]

Training is deterministic for a given corpus (tokenizers' BPE trainer breaks ties by pair order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from build_corpus import read_docs, split_files  # noqa: E402

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CONTEXT_LENGTH = 4096
# ChatML, one line so that trim_blocks/lstrip_blocks (Strata and transformers both set them) change nothing
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def train(corpus: str, vocab_size: int) -> Tokenizer:
    tk = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def docs():
        for path in split_files(corpus, "train"):
            yield from read_docs(path)

    tk.train_from_iterator(docs(), trainer=trainer)
    return tk


def tokenizer_config() -> dict:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def check(out_dir: str, corpus: str) -> dict:
    """Loads what was written with Strata (and transformers, if present); returns val statistics."""
    from strata.tokenizer import Tokenizer as StrataTokenizer

    st = StrataTokenizer.from_hf_dir(out_dir)
    eos_id = st.token_to_id(EOS)
    assert eos_id == 0 and st.eos_ids == (eos_id,), st.eos_ids
    assert st.bos_id is None and not st.add_bos
    assert {st.token_to_id(t) for t in SPECIAL_TOKENS} <= st.stop_ids | {1}
    n_bytes = n_tokens = n_docs = 0
    samples = []
    for path in split_files(corpus, "val"):
        for doc in read_docs(path):
            ids = st.encode(doc)
            if st.decode(ids, skip_special=False) != doc:
                raise AssertionError(f"round trip failed in {path}")
            n_bytes += len(doc.encode("utf-8"))
            n_tokens += len(ids)
            n_docs += 1
            samples.append(doc[:2000])
    messages = [{"role": "system", "content": "You are Strata's default model."},
                {"role": "user", "content": "Continue: In the beginning God created"}]
    rendered = st.apply_chat_template(messages, add_generation_prompt=True)
    expected = ("<|im_start|>system\nYou are Strata's default model.<|im_end|>\n"
                "<|im_start|>user\nContinue: In the beginning God created<|im_end|>\n<|im_start|>assistant\n")
    assert rendered == expected, repr(rendered)
    chat_ids = st.encode(rendered)
    assert chat_ids.count(st.token_to_id("<|im_start|>")) == 3, "special tokens not recognised in text"
    result = {"vocab_size": st.vocab_size, "val_docs": n_docs, "val_bytes": n_bytes, "val_tokens": n_tokens,
              "val_bytes_per_token": round(n_bytes / n_tokens, 4), "transformers": "not installed"}
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return result
    hf = AutoTokenizer.from_pretrained(out_dir)
    assert hf.eos_token == EOS and hf.pad_token == EOS and hf.bos_token is None, (hf.eos_token, hf.bos_token)
    for text in samples[:50] + [rendered, "The pass key is 48213. Remember it."]:
        if hf.encode(text, add_special_tokens=False) != st.encode(text):
            raise AssertionError("transformers and Strata tokenize differently")
        if hf.encode(text) != st.encode(text):
            raise AssertionError("transformers adds special tokens that Strata does not")
    hf_rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf_rendered == rendered, repr(hf_rendered)
    import transformers

    result["transformers"] = f"AutoTokenizer ({type(hf).__name__}, transformers {transformers.__version__}) agrees"
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=os.path.join(ROOT, "corpus"))
    ap.add_argument("--out", default=os.path.join(ROOT, "strata", "assets", "default-model"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    if not 512 <= args.vocab_size <= 16384:
        ap.error("--vocab-size must be within [512, 16384] (token ids are stored as uint16)")
    if not os.path.exists(os.path.join(args.corpus, "manifest.json")):
        print(f"no {args.corpus}/manifest.json: run scripts/build_corpus.py first", file=sys.stderr)
        return 2
    t0 = time.time()
    tk = train(args.corpus, args.vocab_size)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tk.token_to_id(t) == i, (t, tk.token_to_id(t))
    os.makedirs(args.out, exist_ok=True)
    tk.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"trained in {time.time() - t0:.1f}s -> {args.out}")
    stats = check(args.out, args.corpus)
    for k, v in stats.items():
        print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
