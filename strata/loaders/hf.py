"""HF model directories: config.json + one or many safetensors files (+ tokenizer.json).

Only safetensors are read; pickled `*.bin` / `*.pt` checkpoints are refused, since unpickling runs
arbitrary code from the file.
"""

from __future__ import annotations

import json
import math
import os

from safetensors import SafetensorError, safe_open

from strata.loaders.base import Checkpoint, LoadError
from strata.tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(index, f"corrupt safetensors index ({e})") from None
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path)):
            raise LoadError(path, "only pickled weights found; Strata loads safetensors only (never pickles)")
        raise LoadError(path, "no *.safetensors weights found")
    return files


def read_hf_dir(path: str) -> Checkpoint:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise LoadError(path, "not a model directory: config.json is missing")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(cfg_path, f"corrupt config.json ({e})") from None

    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, str] = {}
    nbytes: dict[str, int] = {}
    handles = {}
    for file in _shard_files(path):
        if not os.path.exists(file):
            raise LoadError(file, "shard named in the index is missing")
        try:
            h = safe_open(file, framework="pt")
            for name in h.keys():
                where[name] = file
                part = h.get_slice(name)
                shapes[name] = tuple(part.get_shape())
                types[name] = part.get_dtype()
                nbytes[name] = math.prod(shapes[name]) * _DTYPE_BYTES.get(types[name], 4)
        except (SafetensorError, OSError, ValueError) as e:
            raise LoadError(file, f"truncated or corrupt safetensors file ({str(e).splitlines()[0]})") from None
        handles[file] = h

    def get(name: str):
        file = where[name]
        try:
            return handles[file].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise LoadError(file, f"cannot read tensor {name} ({str(e).splitlines()[0]})") from None

    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        eos = config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        tokenizer = Tokenizer.from_hf_dir(path, eos_ids)
    return Checkpoint(path=path, config=config, names=list(where), get=get, tokenizer=tokenizer, shapes=shapes,
                      types=types, nbytes=nbytes)
