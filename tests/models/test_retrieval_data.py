"""Synthetic retrieval examples (strata.data.retrieval): lengths, depths, determinism, answer present.

Fast and CPU-only: the filler is generated here and the tokenizer is a small byte-level BPE trained on it.
"""

import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.data import make_retrieval_example
from strata.data.retrieval import KV_INTRO, PASSKEY_INTRO, iter_retrieval_examples
from strata.tokenizer import Tokenizer as StrataTokenizer

SUBJECTS = ["The old miller", "Her sister", "A stranger from the north", "The captain", "My neighbour",
            "The young clerk", "Everyone in the village", "The innkeeper's wife"]
VERBS = ["walked slowly to", "spoke warmly of", "could not forget", "wrote a letter about", "dreamed of",
         "returned at last to", "laughed about", "was silent about"]
OBJECTS = ["the river at dawn", "the house on the hill", "a long and rainy winter", "the market square",
           "the quarrel of the previous evening", "an old promise", "the orchard behind the church",
           "the price of bread"]


def make_filler(n_sentences: int = 400) -> str:
    rng = random.Random(7)
    paras, cur = [], []
    for _ in range(n_sentences):
        cur.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice('.!?.')}")
        if rng.random() < 0.2:
            paras.append(" ".join(cur))
            cur = []
    paras.append(" ".join(cur))
    return "\n\n".join(paras)


@pytest.fixture(scope="module")
def filler():
    return make_filler()


@pytest.fixture(scope="module")
def tok(filler):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    frame = [PASSKEY_INTRO, KV_INTRO, "What is the pass key? The value of the key"] * 20
    tk.train_from_iterator([filler] + frame, trainer=trainer)
    return tk


def n_tokens(tk, text):
    return len(tk.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("kind", ["passkey", "kv"])
@pytest.mark.parametrize("target", [200, 700, 1500, 4096])
def test_length_close_to_target(tok, filler, kind, target):
    ex = make_retrieval_example(tok, filler, target, 0.5, kind=kind, seed=1, n_pairs=3)
    assert ex.prompt_tokens == n_tokens(tok, ex.prompt)
    assert ex.answer_tokens == n_tokens(tok, ex.answer)
    assert target - 8 <= ex.n_tokens <= target
    assert ex.answer.startswith(" ") and not ex.prompt.endswith(" ")
    assert ex.prompt == ex.context + "\n\n" + ex.question + " " + ex.response_prefix


@pytest.mark.parametrize("kind", ["passkey", "kv"])
def test_depths(tok, filler, kind):
    for depth in (0.0, 0.2, 0.5, 0.8, 1.0):
        ex = make_retrieval_example(tok, filler, 2000, depth, kind=kind, seed=3, n_pairs=3)
        assert abs(ex.needle_depth - depth) < 0.04, (depth, ex.needle_depth)
    needle = f"The pass key is {make_retrieval_example(tok, filler, 600, 0.0, seed=5).answer.strip()}."
    first = make_retrieval_example(tok, filler, 600, 0.0, seed=5)
    last = make_retrieval_example(tok, filler, 600, 1.0, seed=5)
    assert first.needle_depth == 0.0 and last.needle_depth == 1.0
    if kind == "passkey":
        body = first.context.split("\n\n", 1)[1]
        assert body.startswith(needle)
        assert last.context.endswith(f"{last.answer.strip()} is the pass key.")


def test_deeper_needle_comes_later(tok, filler):
    positions = []
    for depth in (0.1, 0.4, 0.7, 0.95):
        ex = make_retrieval_example(tok, filler, 3000, depth, seed=11)
        positions.append(ex.prompt.index("The pass key is") / len(ex.prompt))
    assert positions == sorted(positions)


def test_deterministic_per_seed(tok, filler):
    a = make_retrieval_example(tok, filler, 1000, 0.3, kind="kv", seed=42)
    b = make_retrieval_example(tok, filler, 1000, 0.3, kind="kv", seed=42)
    c = make_retrieval_example(tok, filler, 1000, 0.3, kind="kv", seed=43)
    assert a == b
    assert (a.prompt, a.answer) != (c.prompt, c.answer)
    stream1 = iter_retrieval_examples(tok, filler, seed=9, max_tokens=1024)
    stream2 = iter_retrieval_examples(tok, filler, seed=9, max_tokens=1024)
    for _ in range(6):
        x, y = next(stream1), next(stream2)
        assert x == y
        assert 200 - 8 <= x.n_tokens <= 1024


def test_answer_is_in_prompt(tok, filler):
    for seed in range(5):
        ex = make_retrieval_example(tok, filler, 800, 0.6, kind="passkey", seed=seed, n_digits=6)
        value = ex.answer.strip()
        assert re.fullmatch(r"\d{6}", value)
        assert ex.prompt.count(f"The pass key is {value}. Remember it. {value} is the pass key.") == 1
        assert ex.prompt.endswith("What is the pass key? The pass key is")

        ex = make_retrieval_example(tok, filler, 800, 0.6, kind="kv", seed=seed, n_pairs=5)
        keys = [k for k, _ in ex.pairs]
        assert len(set(keys)) == 5
        for k, v in ex.pairs:
            assert ex.context.count(f"{k}: {v}.") == 1
        (key,) = re.findall(r"What is the value of the key (\S+)\?", ex.prompt)
        assert dict(ex.pairs)[key] == ex.answer.strip()
        assert ex.prompt.endswith(f"The value of the key {key} is")


def test_chat_form(tok, filler):
    ex = make_retrieval_example(tok, filler, 500, 0.5, seed=2)
    messages, reply = ex.chat()
    assert messages[0]["role"] == "user" and messages[0]["content"].endswith("What is the pass key?")
    assert reply == "The pass key is" + ex.answer


def test_same_example_with_strata_tokenizer(tok, filler):
    st = StrataTokenizer(tk=tok)
    for kind in ("passkey", "kv"):
        assert make_retrieval_example(st, filler, 900, 0.4, kind=kind, seed=6) == make_retrieval_example(
            tok, filler, 900, 0.4, kind=kind, seed=6
        )


def test_short_filler_wraps_and_bad_arguments(tok):
    ex = make_retrieval_example(tok, "A short line of text. Another one!", 400, 0.5, seed=0)
    assert 392 <= ex.n_tokens <= 400
    with pytest.raises(ValueError):
        make_retrieval_example(tok, make_filler(20), 20, 0.5)
    with pytest.raises(ValueError):
        make_retrieval_example(tok, make_filler(20), 300, 1.5)
    with pytest.raises(ValueError):
        make_retrieval_example(tok, make_filler(20), 300, 0.5, kind="haystack")
    with pytest.raises(ValueError):
        make_retrieval_example(tok, "   ", 300, 0.5)
