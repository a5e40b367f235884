"""The one typed registry of STRATA_* environment switches. Nothing else in Strata reads os.environ.

Each switch is declared once with its type, default and meaning; `strata.env.ENV.<name>` reads it at
call time so tests can set the variable per case.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def _bool(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Switch(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


class _Env:
    SPLIT_MTP_BATCH = Switch("STRATA_SPLIT_MTP_BATCH", _bool, False,
                             "compute the MTP layer's prompt K/V batched, chunk by chunk, during the prompt read")
    PIPED_CONCURRENT = Switch("STRATA_PIPED_CONCURRENT", _bool, False,
                              "run prompt reads as their own stage beside decoding: a worker thread, on CUDA its own "
                              "low-priority stream (docs/CONCURRENT_READ.md)")
    PIPED_CONCURRENT_SMB = Switch("STRATA_PIPED_CONCURRENT_SMB", _bool, False,
                                  "let STRATA_SPLIT_MTP_BATCH run beside STRATA_PIPED_CONCURRENT: the read stage writes "
                                  "the draft K/V itself, its stream-K pool grown before each read")
    PDL = Switch("STRATA_PDL", _bool, True,
                 "launch Triton kernels with programmatic dependent launch on sm_90+ (a kernel's launch "
                 "overlaps its predecessor's tail; each kernel waits for it before touching memory)")
    GEMV_PREFETCH_MB = Switch("STRATA_GEMV_PREFETCH_MB", int, 0,
                              "MiB of weights each decode GEMV asks L2 to prefetch before its PDL wait, while "
                              "the kernel before it still runs (0: off; on the H200 8 gained < 0.5% and 16+ "
                              "lost, scripts/profile_step.py --prefetch-sweep)")
    Q8_DECODE = Switch("STRATA_Q8_DECODE", str, "auto",
                       "Q8_0 decode GEMV (M <= 16, 16-bit x): 'dequant' (weights to bf16, tensor cores), 'dp4a' "
                       "(x quantized per 32 values, packed int8 dot products; strata/kernels/quant/dp4a.py) or "
                       "'auto' (dp4a up to 3 rows, q8_0.DP4A_MAX_ROWS). H200, Qwen3-8B shapes: dp4a 1.6-1.8x "
                       "faster at M = 1, 1.2-1.6x slower at M = 8 (rows 2-7 interpolated); batch-1 decode 175 -> "
                       "279 tok/s")
    IQ3S_DECODE = Switch("STRATA_IQ3S_DECODE", str, "auto",
                         "IQ3_S decode GEMV (M <= 16, 16-bit x): 'dequant' (weights to bf16, tensor cores), 'dp4a' "
                         "(packed int8 dot products; strata/kernels/quant/iq3_s_dp4a.py) or 'auto' (dp4a up to 4 "
                         "rows, iq3_s.DP4A_MAX_ROWS). H200, Qwen3-8B shapes: dp4a 1.9-2.2x faster at M = 1, "
                         "0.74-0.85x at M = 8; batch-1 decode 74 -> 230 tok/s")
    IQ3S_GRID = Switch("STRATA_IQ3S_GRID", str, "shared",
                       "where the IQ3_S kernels gather their grid words: 'shared' (the 2 KB table copied to shared "
                       "memory once a program, tl.gather) or 'global' (loaded through L1). The same words either "
                       "way. H200: batch-1 decode 201.7 -> 205.0 tok/s at 8B shapes, 150.4 -> 184.1 at 30B-A3B "
                       "(docs/QUANTIZATION.md)")
    Q4K_DECODE = Switch("STRATA_Q4K_DECODE", str, "auto",
                        "Q4_K decode GEMV (M <= 16, 16-bit x): 'dequant' (weights to bf16, tensor cores), 'dp4a' "
                        "(packed int8 dot products; strata/kernels/quant/q4_k_dp4a.py) or 'auto' (dp4a up to 2 "
                        "rows, q4_k.DP4A_MAX_ROWS). H200, Qwen3-8B shapes: dp4a 1.9-2.5x faster at M = 1, "
                        "1.35-2.3x slower at M = 8 (rows 2-7 interpolated); batch-1 decode 171 -> 292 tok/s")
    Q6K_DECODE = Switch("STRATA_Q6K_DECODE", str, "auto",
                        "Q6_K decode GEMV (M <= 16, 16-bit x): 'dequant' (weights to bf16, tensor cores), 'dp4a' "
                        "(packed int8 dot products; strata/kernels/quant/q6_k_dp4a.py) or 'auto' (dp4a up to 2 "
                        "rows, q6_k.DP4A_MAX_ROWS). H200, Qwen3-8B shapes: dp4a 1.4-1.7x faster at M = 1, "
                        "1.75-2.3x slower at M = 8 (rows 2-7 interpolated); batch-1 decode 129 -> 187 tok/s")
    QMOE_DECODE = Switch("STRATA_QMOE_DECODE", str, "fused",
                         "routed experts kept quantized (GGUF or --quantize fp8, CUDA) at decode-sized steps (<= 16 "
                         "tokens): 'fused' "
                         "(two launches that dequantize in registers, strata/kernels/quant/moe_decode_q.py, probed "
                         "at load) or 'grouped' (the sort, the grouped kernels and the combine of moe_q.py)")
    QUANT_DEQUANT_ROWS = Switch("STRATA_QUANT_DEQUANT_ROWS", int, 512,
                                "reads of at least this many rows over GGUF-quantized weights (--keep-quantized, "
                                "CUDA) dequantize each weight into one shared bf16 buffer and run cuBLAS instead of "
                                "the fused dequantizing GEMMs; 0 turns it off (H200: 1.5-5x faster at 512-4,096 rows, fewer "
                                "not timed)")
    GDN_KERNEL = Switch("STRATA_GDN_KERNEL", str, "auto",
                        "Gated DeltaNet prompt reads on CUDA (qwen3_next): 'fla' (fla-core's chunked Triton kernel, all "
                        "sequences in one launch; 5.5-5.7x the reference's read speed on the H200), 'ref' (torch "
                        "reference, chunk by chunk) or 'auto' (fla when fla-core is installed)")
    NO_PROGRESS = Switch("STRATA_NO_PROGRESS", _bool, False, "hide the weight-loading progress bar")
    CACHE_DIR = Switch("STRATA_CACHE_DIR", str, "", "where test fixtures and downloads are cached")
    API_KEY = Switch("STRATA_API_KEY", str, "", "the server's API key when --api-key is not given")
    LOG_LEVEL = Switch("STRATA_LOG_LEVEL", str, "",
                       "level of strata's own log on stderr (DEBUG, INFO, WARNING, ...); empty: INFO for "
                       "`strata serve`, WARNING for the other commands")

    def __getattr__(self, item: str):  # pragma: no cover - typo guard
        raise AttributeError(f"unknown Strata switch {item!r}")

    def switches(self) -> list[Switch]:
        return [v for v in type(self).__dict__.values() if isinstance(v, Switch)]

    def value(self, switch: Switch[T]) -> T:
        return switch.get()

    def set_in_environment(self) -> dict[str, str]:
        """The switches set in this process's environment, as written there (a bench result records
        them: part of the command it came from)."""
        return {s.name: os.environ[s.name] for s in self.switches() if s.name in os.environ}


ENV = _Env()


def child_environment(pythonpath_first: str) -> dict[str, str]:
    """This process's environment for a child Python process, with `pythonpath_first` ahead on its
    PYTHONPATH (benchmarks start their clients this way)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath_first + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def get(switch: Switch[T]) -> T:
    return switch.get()


@contextmanager
def overridden(switch: Switch, value: str | None) -> Iterator[None]:
    """Sets (or, with None, unsets) a switch for the duration of a block; benchmarks compare arms."""
    old = os.environ.get(switch.name)
    if value is None:
        os.environ.pop(switch.name, None)
    else:
        os.environ[switch.name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(switch.name, None)
        else:
            os.environ[switch.name] = old
