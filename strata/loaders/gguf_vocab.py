"""GGUF vocabularies (`tokenizer.ggml.*`) → `strata.tokenizer.Tokenizer`.

Two vocabulary kinds are supported, and each is rebuilt as a `tokenizers.Tokenizer` that splits text
the way llama.cpp does (checked against llama.cpp's own test vectors in tests/loaders/test_tokenizer_vectors.py):

* `gpt2`: byte-level BPE. The pre-tokenizer regexes are chosen by `tokenizer.ggml.pre`, as llama.cpp
  chooses them; several regexes are applied one after another, each splitting the pieces further and
  keeping the text between matches as pieces of its own.
* `llama`: SentencePiece BPE. llama.cpp repeatedly merges the adjacent pair whose concatenation is the
  vocabulary piece with the highest score (leftmost on ties), then falls back to `<0xXX>` byte pieces for
  characters the vocabulary lacks. That is a BPE whose merge ranks are the merged pieces' scores, so the
  merges are derived from the scores; spaces become `▁` and one `▁` is prepended to every run of text.

Control tokens are matched as special tokens in text (so rendered chat templates encode to them), and
user-defined tokens always, as llama.cpp does.
"""

from __future__ import annotations

import warnings
from typing import Any

from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata.loaders.base import LoadError
from strata.tokenizer import Tokenizer

# llama.cpp's token types (`tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The contraction alternatives are spelled out case by case instead of `(?i:...)` because llama.cpp
# does so; both mean the same to Oniguruma.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 but digits are split one by one.
QWEN2_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

PRE_TOKENIZERS: dict[str, list[str]] = {
    "gpt2": [GPT2_REGEX],
    "llama3": [LLAMA3_REGEX],
    "qwen2": [QWEN2_REGEX],
    "starcoder": [r"\p{N}", GPT2_REGEX],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]"],
    # llama.cpp's fallback for files that name no pre-tokenizer: punctuation runs first, then GPT-2
    # words, then digit runs in threes.
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
# `tokenizer.ggml.pre` value → (regex set, whether a word found whole in the vocabulary skips merges).
PRE_ALIASES: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    "gpt-2": ("gpt2", False),
    "phi-2": ("gpt2", False),
    "mpt": ("gpt2", False),
    "olmo": ("gpt2", False),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "llama-bpe": ("llama3", True),
    "falcon3": ("llama3", True),
    "dbrx": ("llama3", False),
    "smaug-bpe": ("llama3", False),
    "glm4": ("llama3", False),
    "chatglm-bpe": ("llama3", False),
    "qwen2": ("qwen2", False),
    "deepseek-r1-qwen": ("qwen2", False),
    "stablelm2": ("qwen2", False),
    "starcoder": ("starcoder", False),
    "refact": ("starcoder", False),
    "smollm": ("starcoder", False),
    "command-r": ("starcoder", False),
    "falcon": ("falcon", False),
}

# Texts of end-of-turn tokens that llama.cpp also treats as end of generation.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|user|>", "<|observation|>")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    if len(f.types) == 2 and f.types[0] == GGUFValueType.ARRAY and f.types[1] == GGUFValueType.STRING:
        # Lenient decoding: a piece that is not valid UTF-8 must not make the whole file unreadable.
        return [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
    return f.contents()


def _token_texts(tokens: list[str]) -> list[str]:
    # llama.cpp renames empty pieces the same way, so ids stay aligned and every piece is distinct text.
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    # On a duplicated piece text the last id wins, as in llama.cpp's text → id map.
    return {t: i for i, t in enumerate(tokens)}


def _add_token_types(tk: HFTokenizer, tokens: list[str], types: list[int] | None) -> None:
    if not types:
        return
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _bpe_tokenizer(tokens: list[str], types: list[int] | None, merges: list[str], pre: str) -> HFTokenizer:
    kind, ignore_merges = PRE_ALIASES.get(pre, (None, False))
    if kind is None:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using llama.cpp's default splitting", stacklevel=3)
        kind = "default"
    vocab = _vocab_dict(tokens)
    pairs = []
    for m in merges:
        # The separator is the first space after the first character, as llama.cpp reads it.
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1 :]
        if a in vocab and b in vocab:
            pairs.append((a, b))
    model = models.BPE(vocab, pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)
    tk = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[kind]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tk.decoder = decoders.ByteLevel()
    _add_token_types(tk, tokens, types)
    return tk


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked by the whole piece's score (best first).

    Ties between splits of the same piece keep id order; llama.cpp would prefer the leftmost position
    in the text instead, which only differs when one text holds two such competing splits at once.
    """
    vocab = _vocab_dict(tokens)
    ranked = []
    for tid, piece in enumerate(tokens):
        if len(piece) < 2 or vocab.get(piece) != tid:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                ranked.append((-scores[tid], tid, lid, rid, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [(r[4], r[5]) for r in ranked]


def _spm_tokenizer(
    tokens: list[str], types: list[int] | None, scores: list[float] | None, add_space_prefix: bool
) -> HFTokenizer:
    if scores is None:
        scores = [0.0] * len(tokens)
    unk = None
    if types:
        unk = next((tokens[i] for i, t in enumerate(types) if t == UNKNOWN), None)
    merges = spm_merges(tokens, scores)
    model = models.BPE(_vocab_dict(tokens), merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tk = HFTokenizer(model)
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    _add_token_types(tk, tokens, types)
    return tk


def tokenizer_from_gguf(reader: Any, path: str) -> Tokenizer:
    """Build the tokenizer described by a GGUF file's metadata (`reader` is a `gguf.GGUFReader`)."""
    kind = _field(reader, "tokenizer.ggml.model")
    raw_tokens = _field(reader, "tokenizer.ggml.tokens")
    if not raw_tokens:
        raise LoadError(path, "GGUF tokenizer has no tokenizer.ggml.tokens")
    tokens = _token_texts(raw_tokens)
    types = _field(reader, "tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise LoadError(path, f"GGUF tokenizer has {len(types)} token types for {len(tokens)} tokens")
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    if kind == "gpt2":
        merges = _field(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise LoadError(path, "GGUF BPE tokenizer has no tokenizer.ggml.merges")
        tk = _bpe_tokenizer(tokens, types, merges, pre)
        default_add_bos = PRE_ALIASES.get(pre, ("", False))[0] == "llama3"
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is not None and len(scores) != len(tokens):
            raise LoadError(path, f"GGUF tokenizer has {len(scores)} scores for {len(tokens)} tokens")
        add_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        tk = _spm_tokenizer(tokens, types, scores, add_prefix)
        default_add_bos = True
    else:
        raise LoadError(path, f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    def token_id(key: str) -> int | None:
        v = _field(reader, key)
        return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

    bos_id, eos_id = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None
    extra = [i for k in ("eot", "eom") if (i := token_id(f"tokenizer.ggml.{k}_token_id")) is not None]
    extra += [i for t in END_OF_TURN_TEXTS if (i := tk.token_to_id(t)) is not None]
    extra = [i for i in dict.fromkeys(extra) if i != eos_id]
    template = _field(reader, "tokenizer.chat_template")
    return Tokenizer(
        tk=tk,
        bos_id=bos_id,
        eos_ids=() if eos_id is None else (eos_id,),
        add_bos=add_bos,
        chat_template=template,
        bos_token=tokens[bos_id] if bos_id is not None else "",
        eos_token=tokens[eos_id] if eos_id is not None else "",
        extra_stop_ids=tuple(extra),
    )
