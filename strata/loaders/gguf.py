"""GGUF files (llama.cpp's format): metadata → HF-style config, tensors → HF-named torch tensors.

The file is memory-mapped by `gguf.GGUFReader` and tensors are read only when asked for; nothing is
ever unpickled. F32/F16/BF16 tensors keep their dtype; every quantized type is dequantized to float32
by `gguf.quants.dequantize` when its tensor is read. Stacked expert tensors are split per expert by
indexing the stack, so a quantized stack is dequantized one expert at a time. `raw` hands out the
blocks themselves (a 2-D weight, or one expert of a stack) for the weights kept quantized.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from strata.config import ConfigError, ModelConfig
from strata.loaders.base import Checkpoint, LoadError
from strata.loaders.names import (
    ARCH_TO_MODEL_TYPE,
    IGNORED_TENSORS,
    MetadataError,
    TensorRef,
    config_from_metadata,
    expected_tensors,
    gguf_to_hf,
)

_PLAIN_TYPES = {QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64}


class _Truncated(ValueError):
    pass


class _FastReader(GGUFReader):
    """GGUFReader with a faster, bounds-checked `_get`.

    The stock `_get` slices an `np.memmap`, whose per-slice bookkeeping makes parsing a 150k-token
    vocabulary take ~10 s; slicing a plain ndarray view of the same mapping is ~4x faster. The stock
    one also silently returns short arrays past the end of the file, which on a corrupt element count
    can loop for a very long time; here a read past the end raises at once.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        end = offset + dt.itemsize * count
        if end > plain.shape[0] or count < 0:
            raise _Truncated(f"needs bytes {offset}..{end} but the file has {plain.shape[0]}")
        arr = plain[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dt.newbyteorder(order))


# Only use the override while the private method keeps the signature it was written against.
_FAST_OK = list(inspect.signature(GGUFReader._get).parameters) == ["self", "offset", "dtype", "count", "override_order"]


def open_reader(path: str) -> GGUFReader:
    """A `GGUFReader` for `path`; any parse failure becomes a one-line `LoadError`."""
    try:
        return (_FastReader if _FAST_OK else GGUFReader)(path, "r")
    except _Truncated as e:
        raise LoadError(path, f"truncated GGUF file ({e})") from None
    # A corrupt header can fail anywhere inside the parser with any exception type.
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        raise LoadError(path, f"not a valid GGUF file ({type(e).__name__}: {msg})") from None


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every scalar and small array field; the (large) vocabulary arrays are left to gguf_vocab."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types and f.types[0] == GGUFValueType.ARRAY and key.startswith("tokenizer.ggml."):
            continue
        try:
            value = f.contents()
        except UnicodeDecodeError:
            continue
        if f.types == [GGUFValueType.FLOAT32]:
            # Back to the decimal the converter wrote: float32 1e-6 reads as 9.99999997e-07 otherwise.
            value = float(str(np.float32(value)))
        meta[key] = value
    return meta


def _np_shape(t: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first; numpy/torch order is the reverse.
    return tuple(int(d) for d in reversed(t.shape.tolist()))


@functools.cache
def _dequantizable(qtype: QT) -> bool:
    if qtype in _PLAIN_TYPES or qtype == QT.BF16:
        return True
    _, size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def tensor_to_torch(t: ReaderTensor, expert: int | None = None) -> torch.Tensor:
    """Read tensor `t` (or one expert of a stack) into a CPU torch tensor in torch dimension order."""
    data = t.data if expert is None else t.data[expert]
    qtype = t.tensor_type
    if qtype in _PLAIN_TYPES:
        # A copy: the mapping is read-only and must not be written through.
        return torch.from_numpy(np.array(data, dtype=_PLAIN_TYPES[qtype]))
    if qtype == QT.BF16:
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    # Read as floats (the CPU path, embeddings, experts); `Checkpoint.raw` keeps linear weights packed.
    return torch.from_numpy(dequantize(data, qtype))


# Transforms that only regroup rows: also undone on a quantized file's rows of blocks, kept quantized.
ROW_ORDER_UNDO = frozenset({"qkvz"})


def _undo(how: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The inverse of the llama.cpp converter's transform `how` (`names.UNDO`, `names.JOINED_TENSORS`)
    on the tensor read, or on the GGUF tensors it is joined from (`parts`)."""
    x = parts[0]
    if how == "minus_one":
        # Exact in fp32: the model's 1 + w then gives back the stored value bit for bit.
        return x.float() - 1
    if how == "log_neg":
        return torch.log(-x.float())
    if how == "unsqueeze_1":
        return x.unsqueeze(1)
    if how == "qkvz":
        # q|k|v + z → HF's rows per key head: its q, its k, then the v and z of its value heads.
        gate = parts[1]
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        q, k, v = x.split([hk * dk, hk * dk, x.shape[0] - 2 * hk * dk])
        dtype = torch.promote_types(x.dtype, gate.dtype)
        per_head = [t.to(dtype).reshape(hk, -1, x.shape[1]) for t in (q, k, v, gate)]
        return torch.cat(per_head, dim=1).reshape(-1, x.shape[1])
    raise ValueError(f"unknown GGUF tensor transform {how!r}")


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _fail_list(path: str, what: str, names: list[str]) -> LoadError:
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return LoadError(path, f"{what}: {', '.join(names[:3])}{more}")


_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")


def _split_parts(path: str, count: int) -> tuple[str, list[GGUFReader]]:
    """A split file's parts (llama.cpp's `NAME-0000k-of-0000N.gguf`, from any of them), first part first:
    its path and the readers. Metadata lives in the first part; every part holds some of the tensors."""
    m = _SPLIT_NAME.match(path)
    if m is None or int(m["count"]) != count:
        raise LoadError(path, f"a part of a GGUF file split in {count}, but its name does not end in "
                              f"-0000k-of-{count:05d}.gguf, so the other parts cannot be found")
    names = [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [n for n in names if not os.path.exists(n)]
    if missing:
        raise LoadError(path, f"split GGUF file: missing part{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(os.path.basename(n) for n in missing)}")
    readers = [open_reader(n) for n in names]
    for i, (n, r) in enumerate(zip(names, readers)):
        no, parts = r.fields.get("split.no"), r.fields.get("split.count")
        if no is None or parts is None or int(no.contents()) != i or int(parts.contents()) != count:
            raise LoadError(n, f"not part {i + 1} of {count} of {os.path.basename(names[0])}")
    return names[0], readers


def read_gguf(path: str) -> Checkpoint:
    path = os.fspath(path)
    reader = open_reader(path)
    if reader.byte_order != "I":
        raise LoadError(path, "big-endian GGUF files are not supported")
    meta = _metadata(reader)
    readers = [reader]
    if int(meta.get("split.count") or 1) > 1:
        path, readers = _split_parts(path, int(meta["split.count"]))
        reader = readers[0]
        meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        known = ", ".join(sorted(ARCH_TO_MODEL_TYPE))
        raise LoadError(path, f"unknown GGUF architecture {arch!r} (supported: {known})")

    tensors: dict[str, ReaderTensor] = {}
    for part in readers:
        size = part.data.shape[0]
        for t in part.tensors:
            if t.name in tensors:
                raise LoadError(path, f"tensor {t.name} is in two parts of the split file")
            if t.data_offset + t.n_bytes > size:
                raise LoadError(path, f"truncated GGUF file (tensor {t.name} ends past the end of the file)")
            tensors[t.name] = t
    shapes = {n: _np_shape(t) for n, t in tensors.items()}
    try:
        config = config_from_metadata(arch, meta, shapes)
        cfg = ModelConfig.from_hf(config)
    except (MetadataError, ConfigError, ValueError, TypeError) as e:
        raise LoadError(path, f"bad GGUF metadata: {e}") from None

    mtp_prefix = f"blk.{cfg.num_hidden_layers}."
    with_mtp = cfg.num_nextn_predict_layers > 0 and any(n.startswith(mtp_prefix) for n in tensors)
    expected, optional = expected_tensors(arch, cfg, with_mtp, tensors)
    extra = sorted(n for n in tensors if n not in expected and n not in IGNORED_TENSORS)
    if extra:
        raise _fail_list(path, "unexpected tensors", extra)
    missing = sorted(n for n in expected if n not in tensors and n not in optional)
    if missing:
        raise _fail_list(path, "missing tensors", missing)
    for n, t in tensors.items():
        if n in expected and shapes[n] != expected[n]:
            # Older llama.cpp converters squeezed every tensor ([1, H] → [H]); read those in full shape.
            if _squeezed(shapes[n]) != _squeezed(expected[n]):
                raise LoadError(path, f"shape mismatch for {n}: file has {shapes[n]}, config implies {expected[n]}")
            shapes[n] = expected[n]
        if not _dequantizable(t.tensor_type):
            raise LoadError(path, f"tensor {n} has unsupported type {t.tensor_type.name}")

    where: dict[str, TensorRef] = {}
    hf_shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, str] = {}
    nbytes: dict[str, int] = {}
    for n in tensors:
        if n in IGNORED_TENSORS:
            continue
        n_experts = shapes[n][0] if len(shapes[n]) == 3 else 0
        for hf, ref in gguf_to_hf(arch, n, n_experts, cfg.num_hidden_layers) or ():
            where[hf] = ref
            types[hf] = tensors[n].tensor_type.name
            nbytes[hf] = sum(int(tensors[g].n_bytes) for g in (n, *ref.more)) // (n_experts if ref.expert is not None else 1)
            shape = shapes[n][1:] if ref.expert is not None else shapes[n]
            if ref.undo is not None:
                parts = [torch.empty(shape if g == n else shapes[g], device="meta") for g in (n, *ref.more)]
                shape = tuple(_undo(ref.undo, parts, cfg).shape)
            hf_shapes[hf] = shape

    def read(name: str, expert: int | None) -> torch.Tensor:
        try:
            x = tensor_to_torch(tensors[name], expert)
        except (ValueError, OSError) as e:
            raise LoadError(path, f"cannot read tensor {name} ({e})") from None
        want = shapes[name][1:] if expert is not None else shapes[name]
        return x if tuple(x.shape) == want else x.reshape(want)

    def get(name: str) -> torch.Tensor:
        ref = where[name]
        parts = [read(g, ref.expert) for g in (ref.gguf_name, *ref.more)]
        return parts[0] if ref.undo is None else _undo(ref.undo, parts, cfg)

    def raw(name: str) -> tuple[str, torch.Tensor] | None:
        from strata.kernels.quant import FORMATS

        ref = where[name]
        group = [tensors[g] for g in (ref.gguf_name, *ref.more)]
        dims = 2 if ref.expert is None else 3  # a 2-D weight, or one expert of a stack
        kept = (ref.undo is None and not ref.more) or (ref.undo in ROW_ORDER_UNDO and ref.expert is None)
        if not kept or len({t.tensor_type for t in group}) != 1 or group[0].tensor_type.name not in FORMATS \
                or any(len(shapes[t.name]) != dims or _np_shape(t) != shapes[t.name] for t in group):
            return None
        # A copy: the mapping is read-only. Rows of blocks, as the file stores them (rows regrouped by a
        # transform that only reorders them).
        parts = [torch.from_numpy(np.array(t.data if ref.expert is None else t.data[ref.expert], dtype=np.uint8))
                 for t in group]
        return group[0].tensor_type.name, parts[0] if ref.undo is None else _undo(ref.undo, parts, cfg)

    tokenizer = None
    if reader.fields.get("tokenizer.ggml.model") is not None:
        from strata.loaders.gguf_vocab import tokenizer_from_gguf

        try:
            tokenizer = tokenizer_from_gguf(reader, path)
        except LoadError:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise LoadError(path, f"cannot build the tokenizer ({why})") from None
    return Checkpoint(path=path, config=config, names=list(where), get=get, tokenizer=tokenizer, shapes=hf_shapes,
                      types=types, nbytes=nbytes,
                      raw=raw)
