"""llama.cpp's tokenizer test vectors, fetched once into `.cache/` at the repo root.

llama.cpp keeps vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`) with test inputs (`.inp`) and
the token ids its reference tokenizers produce (`.out`). They ship inside the llama-cpp-python source
distribution on PyPI (`vendor/llama.cpp/models/`); pip downloads it and only the needed members are
extracted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile

LLAMA_CPP_PYTHON = "0.3.16"
VOCABS = ("qwen2", "gpt-2", "llama-bpe", "llama-spm")
# Small extra vocabularies covering the other pre-tokenizer presets (and a second SentencePiece vocab).
EXTRA_VOCABS = ("mpt", "starcoder", "refact", "falcon", "phi-3")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache", f"llama-cpp-vocab-{LLAMA_CPP_PYTHON}")
SEPARATOR = "\n__ggml_vocab_test__\n"

# Output of pip that means the package index could not be reached at all.
_NO_NETWORK = (
    "NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
    "Name or service not known", "No route to host", "Connection refused", "ConnectTimeoutError",
    "Max retries exceeded", "ProxyError",
)


class NoNetwork(RuntimeError):
    """The source distribution cannot be downloaded because there is no network."""


def _wanted() -> list[str]:
    return [f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS + EXTRA_VOCABS for ext in ("", ".inp", ".out")]


def fetch() -> str:
    """The cache folder holding the vocab files and vectors; downloads them if absent.

    Raises NoNetwork when the index cannot be reached, RuntimeError on any other failure.
    """
    if all(os.path.exists(os.path.join(CACHE, f)) for f in _wanted()):
        return CACHE
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # Only llama-cpp-python itself must come as source: `:all:` would also force the build backend
        # that pip installs to read its metadata to be built from source, which takes minutes.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--retries", "1", "--timeout", "30", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            out = r.stdout + r.stderr
            tail = " | ".join(out.strip().splitlines()[-3:])
            if any(s in out for s in _NO_NETWORK):
                raise NoNetwork(f"cannot download llama-cpp-python {LLAMA_CPP_PYTHON} (no network): {tail}")
            raise RuntimeError(f"pip download of llama-cpp-python {LLAMA_CPP_PYTHON} failed: {tail}")
        sdists = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        if not sdists:
            raise RuntimeError(f"pip download left no source distribution in {tmp}: {os.listdir(tmp)}")
        wanted = set(_wanted())
        with tarfile.open(os.path.join(tmp, sdists[0]), "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")
                if member.isfile() and parts[-3:-1] == ["llama.cpp", "models"] and parts[-1] in wanted:
                    src = tar.extractfile(member)
                    assert src is not None
                    dst = os.path.join(CACHE, parts[-1])
                    # Write-then-rename, so an interrupted run never leaves a half file that looks complete.
                    with open(dst + ".part", "wb") as f:
                        f.write(src.read())
                    os.replace(dst + ".part", dst)
                    wanted.discard(parts[-1])
        if wanted:
            raise RuntimeError(f"llama-cpp-python {LLAMA_CPP_PYTHON} lacks {sorted(wanted)}")
    return CACHE


def read_vectors(folder: str, vocab: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs, parsed the way llama.cpp's test-tokenizer-0 parses them: inputs are
    separated by a marker line, and line i of `.out` holds the space-separated ids of input i."""
    base = os.path.join(folder, f"ggml-vocab-{vocab}.gguf")
    with open(base + ".inp", encoding="utf-8", newline="") as f:
        raw = f.read()
    inputs = raw.split(SEPARATOR)
    if inputs and inputs[-1] == "":  # the file ends with a separator
        inputs.pop()
    with open(base + ".out", encoding="utf-8", newline="") as f:
        outputs = f.read().split("\n")
    if outputs and outputs[-1] == "":
        outputs.pop()
    if len(inputs) != len(outputs):
        raise ValueError(f"{base}: {len(inputs)} inputs but {len(outputs)} outputs")
    return [(text, [int(t) for t in ids.split()]) for text, ids in zip(inputs, outputs, strict=True)]
