"""GGUF vocabularies → tokenizers, checked against llama.cpp's own tokenizer test vectors.

The vocab-only GGUF files and their `.inp`/`.out` vectors come from llama.cpp (see fetch_vocab.py).
Every vector must match exactly: these are the ids llama.cpp produces for the same text with
`add_special=False`.
"""

from __future__ import annotations

import functools
import os

import pytest

from fetch_vocab import EXTRA_VOCABS, VOCABS, NoNetwork, fetch, read_vectors
from strata.loaders.gguf import open_reader
from strata.loaders.gguf_vocab import tokenizer_from_gguf


@pytest.fixture(scope="session")
def vocab_dir() -> str:
    try:
        return fetch()
    except NoNetwork as e:
        pytest.skip(str(e))


@functools.cache
def _tokenizer(folder: str, vocab: str):
    path = os.path.join(folder, f"ggml-vocab-{vocab}.gguf")
    return tokenizer_from_gguf(open_reader(path), path)


@pytest.mark.parametrize("vocab", VOCABS + EXTRA_VOCABS)
def test_llama_cpp_vectors(vocab, vocab_dir):
    tok = _tokenizer(vocab_dir, vocab)
    cases = read_vectors(vocab_dir, vocab)
    assert len(cases) >= 40, f"only {len(cases)} vectors parsed"
    failures = []
    for text, want in cases:
        got = tok.encode(text, add_special=False)
        if got != want:
            failures.append(f"{text[:60]!r}: want {want[:16]} got {got[:16]}")
    assert not failures, f"{len(failures)}/{len(cases)} vectors differ:\n" + "\n".join(failures)


@pytest.mark.parametrize("vocab", VOCABS + EXTRA_VOCABS)
def test_decode_inverts_encode(vocab, vocab_dir):
    tok = _tokenizer(vocab_dir, vocab)
    for text, want in read_vectors(vocab_dir, vocab):
        assert tok.decode(want) == text, (vocab, text)


def test_bos_and_stop_tokens(vocab_dir):
    spm = _tokenizer(vocab_dir, "llama-spm")
    assert (spm.bos_id, spm.eos_ids, spm.add_bos, spm.bos_token) == (1, (2,), True, "<s>")
    assert spm.encode("Hello")[0] == 1 and spm.encode("Hello", add_special=False)[0] != 1

    llama3 = _tokenizer(vocab_dir, "llama-bpe")
    # The file sets no add_bos flag; llama.cpp adds BOS for the llama3 pre-tokenizer by default.
    assert llama3.add_bos and llama3.bos_id == 128000 and llama3.eos_ids == (128001,)
    assert llama3.token_to_id("<|eot_id|>") in llama3.stop_ids

    gpt2 = _tokenizer(vocab_dir, "gpt-2")
    assert not gpt2.add_bos and gpt2.eos_ids == (50256,)

    qwen = _tokenizer(vocab_dir, "qwen2")
    assert not qwen.add_bos and qwen.eos_ids == (151643,)
    assert qwen.token_to_id("<|im_end|>") in qwen.stop_ids


def test_special_tokens_in_rendered_chat(vocab_dir):
    qwen = _tokenizer(vocab_dir, "qwen2")
    assert qwen.chat_template and "im_start" in qwen.chat_template
    prompt = qwen.apply_chat_template([{"role": "user", "content": "Hi there"}])
    ids = qwen.encode(prompt)
    start, end = qwen.token_to_id("<|im_start|>"), qwen.token_to_id("<|im_end|>")
    # Control tokens in text become single ids, and decode hides them.
    assert ids.count(start) == prompt.count("<|im_start|>") and ids.count(end) == prompt.count("<|im_end|>")
    assert "<|im_start|>" not in qwen.decode(ids) and "Hi there" in qwen.decode(ids)

    spm = _tokenizer(vocab_dir, "llama-spm")
    ids = spm.encode("</s>Hi", add_special=False)
    # Text after a special token gets its own leading "▁", as in llama.cpp.
    assert ids == [2] + spm.encode("Hi", add_special=False)
    assert spm.tk.id_to_token(ids[1]) == "▁Hi"
