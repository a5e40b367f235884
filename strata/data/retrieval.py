"""Synthetic long-context retrieval examples: a pass key, or `key: value` pairs, buried in natural text.

One function, `make_retrieval_example`, builds every example: the default model's training mix
(`scripts/prepare_training_data.py`), the needle-in-a-haystack tests and the evaluation all call it, so the
three see the same format. It takes a tokenizer only to measure lengths, and a filler text (a long
stretch of natural prose, e.g. the corpus) from which it cuts a seeded window.

Pass key (`kind="passkey"`):

    There is an important piece of information hidden inside a lot of irrelevant text. Find it and
    memorize it. I will quiz you about the important information there.

    <filler ...> The pass key is 48213. Remember it. 48213 is the pass key. <... filler>

    What is the pass key? The pass key is            <- prompt ends here
     48213                                           <- answer (leading space)

Key–value (`kind="kv"`): several sentences such as `amber-falcon: 52817.` at different depths (the
queried pair at the requested depth, the others at seeded random depths), then `What is the value of the
key amber-falcon? The value of the key amber-falcon is` and the answer ` 52817`.

Lengths: `prompt` + `answer` together take at most `target_tokens` tokens of the given tokenizer (each
measured on its own, without BOS/EOS), and at least `target_tokens - 8` unless the next filler word alone
is longer than the gap. The depth is the fraction of the filler's tokens that come before the needle; the
needle goes in at a sentence end, the one nearest that fraction (0.0 and 1.0 are exact). Same arguments
and seed, same example.

Dependencies: the standard library and the tokenizer object passed in (a `tokenizers.Tokenizer`, a
`strata.tokenizer.Tokenizer`, a transformers tokenizer, or anything whose `encode(text)` gives ids).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
KV_INTRO = (
    "Some key: value pairs are hidden inside the text below. "
    "Memorize them. I will ask you for the value of one key.\n\n"
)
KINDS = ("passkey", "kv")

_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "calm", "clever", "copper", "crimson",
    "dusty", "eager", "early", "fair", "gentle", "golden", "green", "grey", "hidden", "hollow",
    "iron", "ivory", "jolly", "quiet", "little", "lucky", "marble", "merry", "misty", "noble",
    "olive", "pale", "proud", "purple", "rapid", "rusty", "scarlet", "secret", "silent", "silver",
    "sleepy", "small", "steady", "stone", "swift", "tall", "velvet", "wild",
)
_NOUNS = (
    "anchor", "apple", "badger", "barrel", "beacon", "bridge", "candle", "castle", "cedar", "comet",
    "falcon", "feather", "forest", "garden", "harbor", "hammer", "island", "lantern", "meadow", "mirror",
    "orchard", "otter", "pebble", "pepper", "pillar", "planet", "raven", "river", "saddle", "shadow",
    "spider", "spring", "tiger", "tower", "trumpet", "valley", "violin", "wagon", "walnut", "willow",
    "window", "wizard", "wolf", "harp", "kettle", "lemon", "marsh", "sparrow",
)

# a sentence ends with . ! or ? and maybe closing quotes or brackets, but not with a title like "Mrs."
_NOT_SENTENCE_END = r"(?<!\bMr)(?<!\bMrs)(?<!\bMessrs)(?<!\bDr)(?<!\bSt)(?<!\bCol)(?<!\bCapt)"
_SENTENCE_END = re.compile(_NOT_SENTENCE_END + r"[.!?][\"'\u201d\u2019)\]]*$")
_SENTENCE_START = re.compile(_NOT_SENTENCE_END + r"[.!?][\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z])")


@dataclass(frozen=True)
class RetrievalExample:
    """One example. Train or score on `prompt` followed by `answer` (encode them separately)."""

    prompt: str
    answer: str  # starts with a space: " 48213"
    kind: str  # "passkey" or "kv"
    target_tokens: int
    depth: float  # requested depth of the needle (the queried pair)
    needle_depth: float  # actual fraction of filler tokens before it
    prompt_tokens: int
    answer_tokens: int
    context: str  # intro + filler with the needle(s), without the question
    question: str  # "What is the pass key?"
    response_prefix: str  # "The pass key is"
    pairs: tuple[tuple[str, str], ...] = field(default=())  # kv: every (key, value) in the context

    @property
    def n_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens

    def chat(self) -> tuple[list[dict[str, str]], str]:
        """The same example as one chat turn: ([user message], assistant reply)."""
        user = {"role": "user", "content": self.context + "\n\n" + self.question}
        return [user], self.response_prefix + self.answer


def _token_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]]:
    """Counts tokens of each text, without special tokens, for the tokenizer kinds Strata meets."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return lambda texts: [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    encode = tokenizer.encode
    # transformers' encode swallows unknown keywords, so ask for its keyword first
    for kwargs in ({"add_special_tokens": False}, {"add_special": False}, {}):
        try:
            encode("probe", **kwargs)
        except TypeError:
            continue

        def count(texts: Sequence[str], kwargs: dict = kwargs) -> list[int]:
            out = []
            for t in texts:
                ids = encode(t, **kwargs)
                out.append(len(getattr(ids, "ids", ids)))
            return out

        return count
    raise TypeError(f"cannot call {type(tokenizer).__name__}.encode(text)")


def _window(filler: str, rng: random.Random, n_chars: int) -> str:
    """A stretch of `filler` of at least n_chars characters, from a seeded sentence start (wrapping)."""
    if not filler.strip():
        raise ValueError("filler text is empty")
    start = rng.randrange(len(filler))
    m = _SENTENCE_START.search(filler, start)
    start = m.end() if m else 0
    text = filler[start:start + n_chars]
    while len(text) < n_chars:
        text += "\n\n" + filler
    return text[:n_chars]


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def make_retrieval_example(
    tokenizer: Any,
    filler: str,
    target_tokens: int,
    depth: float,
    *,
    kind: str = "passkey",
    seed: int | str = 0,
    n_pairs: int = 4,
    n_digits: int = 5,
) -> RetrievalExample:
    """A (prompt, answer) retrieval example of about `target_tokens` tokens with its needle at `depth`.

    `filler` is natural text (any length: it wraps); `kind` is "passkey" or "kv" (`n_pairs` pairs, one of
    them queried); the secret is an `n_digits`-digit number. See the module docstring for the layout.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], not {depth}")
    rng = random.Random(f"strata-retrieval/{kind}/{seed}/{target_tokens}/{depth!r}")
    count = _token_counter(tokenizer)

    if kind == "passkey":
        value = _digits(rng, n_digits)
        intro = PASSKEY_INTRO
        needles = [(depth, f"The pass key is {value}. Remember it. {value} is the pass key.")]
        question, prefix, pairs = "What is the pass key?", "The pass key is", ()
    else:
        if n_pairs < 1:
            raise ValueError("n_pairs must be at least 1")
        keys = rng.sample([f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS], n_pairs)
        values = [_digits(rng, n_digits) for _ in keys]
        pairs = tuple(zip(keys, values))
        q = rng.randrange(n_pairs)
        value = values[q]
        intro = KV_INTRO
        needles = [(depth if i == q else rng.random(), f"{k}: {v}.") for i, (k, v) in enumerate(pairs)]
        question = f"What is the value of the key {keys[q]}?"
        prefix = f"The value of the key {keys[q]} is"
    answer = " " + value
    tail = "\n\n" + question + " " + prefix

    fixed = sum(count([intro, tail, answer] + [" " + text for _, text in needles]))
    budget = target_tokens - fixed
    if budget < 0:
        raise ValueError(f"target_tokens={target_tokens} is below the {fixed} tokens the {kind} frame needs")

    # Words (with their leading whitespace) of a seeded window, each with its token count. Byte-level BPE
    # splits before a space, so these counts add up to (almost exactly) the count of the joined text.
    n_chars = 8 * budget + 400
    for _ in range(8):
        words = re.findall(r"\s*\S+", _window(filler, rng, n_chars))
        counts = count(words)
        if sum(counts) >= budget + 16:
            break
        n_chars *= 2
    cum, keep = 0, 0
    while keep < len(words) and cum <= budget + 64:
        cum += counts[keep]
        keep += 1
    words, counts = words[:keep], counts[:keep]

    def build(n: int) -> str:
        cum = [0]
        for c in counts[:n]:
            cum.append(cum[-1] + c)
        # needles go in at sentence ends: positions 0, n and after every word that ends a sentence
        bounds = [0] + [i + 1 for i in range(n) if _SENTENCE_END.search(words[i])] + [n]
        at: dict[int, list[str]] = {}
        for d, text in needles:
            want = d * cum[n]
            at.setdefault(min(bounds, key=lambda b: (abs(cum[b] - want), b)), []).append(text)
        body = ""
        for i in range(n + 1):
            for text in at.get(i, []):
                body += (" " if body else "") + text
            if i < n:  # a filler word keeps its whitespace (paragraph breaks stay)
                w = words[i]
                body += w.lstrip() if not body else (w if w[:1].isspace() else " " + w)
        return intro + body

    def measure(n: int) -> tuple[str, int]:
        context = build(n)
        return context, sum(count([context + tail, answer]))

    # Largest n whose prompt fits: the per-word counts give the guess, exact counts decide.
    n, total = 0, 0
    while n < len(words) and total + counts[n] <= budget:
        total += counts[n]
        n += 1
    context, exact = measure(n)
    for _ in range(16):
        if exact > target_tokens:
            drop = 0
            while n > 0 and (drop == 0 or drop < exact - target_tokens):
                n -= 1
                drop += counts[n]
        elif exact < target_tokens - 8 and n < len(words) and counts[n] <= target_tokens - exact:
            room = target_tokens - exact
            while n < len(words) and counts[n] <= room:
                room -= counts[n]
                n += 1
        else:
            break
        context, exact = measure(n)
    while exact > target_tokens and n > 0:
        n -= 1
        context, exact = measure(n)
    if exact > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is too small for the {kind} frame")
    prompt = context + tail
    p_tok, a_tok = count([prompt, answer])

    # actual depth of the queried needle: share of the filler tokens (other needles left out) before it
    qtext = needles[0][1] if kind == "passkey" else needles[q][1]
    before, after = context[len(intro):].split(qtext, 1)
    for _, text in needles:
        before, after = before.replace(text, ""), after.replace(text, "")
    b_tok, f_tok = count([before.strip(), after.strip()])
    needle_depth = b_tok / (b_tok + f_tok) if b_tok + f_tok else depth
    return RetrievalExample(
        prompt=prompt, answer=answer, kind=kind, target_tokens=target_tokens, depth=depth,
        needle_depth=needle_depth, prompt_tokens=p_tok, answer_tokens=a_tok, context=context,
        question=question, response_prefix=prefix, pairs=pairs,
    )


def iter_retrieval_examples(
    tokenizer: Any,
    filler: str,
    *,
    seed: int = 0,
    min_tokens: int = 200,
    max_tokens: int = 4096,
    kinds: Sequence[str] = KINDS,
    p_max_length: float = 0.1,
) -> Iterator[RetrievalExample]:
    """An endless seeded stream of examples: lengths log-uniform in [min_tokens, max_tokens] (a share
    `p_max_length` exactly max_tokens), depths uniform in [0, 1] (5% exactly 0 or 1), kinds at random,
    2-8 pairs (2-4 below 600 tokens), secrets of 4-7 digits."""
    rng = random.Random(f"strata-retrieval-stream/{seed}")
    i = 0
    while True:
        if rng.random() < p_max_length:
            length = max_tokens
        else:
            length = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        kind = rng.choice(list(kinds))
        depth = rng.choice((0.0, 1.0)) if rng.random() < 0.05 else rng.random()
        yield make_retrieval_example(
            tokenizer, filler, length, depth, kind=kind, seed=f"{seed}/{i}",
            n_pairs=rng.randint(2, 8 if length >= 600 else 4), n_digits=rng.randint(4, 7),
        )
        i += 1
