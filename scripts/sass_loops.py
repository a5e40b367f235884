"""Compile a Triton kernel for sm_90 (or another target: `--arch`) without a GPU and count the SASS
instructions of its loops: a proxy for what a kernel costs per value when it is issue-bound (a
decode GEMV on packed formats), checkable on a CPU before device time is spent. Uses the ptxas and
nvdisasm that Triton's NVIDIA backend ships; the compile is this machine's Triton, which may differ from the device's.

    python scripts/sass_loops.py strata.kernels.quant.iq3_s_dp4a:_iq3s_gemv_dp4a_kernel \
        --sig x_ptr=*bf16 ... --const BLOCK_M=1 ... [--warps 4 --stages 3 --no-fp-fusion]

Or from Python: `loops(kernel, signature, constexprs, num_warps, num_stages)` -> [(start, end, count,
histogram)] per loop (a backward branch and its target), innermost first.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter would replace the kernels' compile

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


# Integer arguments the launches pass as multiples of 16 (shapes and row strides): the JIT specialises
# such a value with tt.divisibility=16, as it does every 16-byte aligned pointer.
ALIGNED_INTS = ("n", "k", "x_stride", "out_stride", "hidden", "inter")


def launch_attrs(kernel, signature: dict, aligned_ints=ALIGNED_INTS) -> dict:
    """The divisibility attributes the JIT would give a launch of `kernel` with 16-byte aligned tensors
    and the `aligned_ints` arguments multiples of 16 (the arguments in `do_not_specialize` get none).
    Without them the compile assumes nothing about alignment, and every load of a packed plane comes out
    as scalar loads that the launched kernel does not issue."""
    skip = set(getattr(kernel, "do_not_specialize", ()) or ())
    names = kernel.arg_names
    skip |= {names[i] for i in skip if isinstance(i, int)}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
            if name in signature and name not in skip
            and (signature[name].startswith("*") or name in aligned_ints)}


def compile_kernel(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                   fp_fusion: bool = True, aligned: bool = True, arch: int = 90):
    """`kernel` compiled for sm_`arch` (80, 86, 89, 90): the compiled kernel, its `asm["cubin"]` and its
    `metadata` (`shared`: bytes of shared memory per block, `n_regs`, `n_spills`); `aligned`: specialised
    as a launch with aligned tensors and shapes would be (`launch_attrs`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = launch_attrs(kernel, signature) if aligned else {}
    return triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion})


def disassemble(compiled) -> str:
    """SASS of a compiled kernel (`compile_kernel`), by the nvdisasm Triton ships."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, f.name], check=True, capture_output=True, text=True).stdout


def sass(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
         fp_fusion: bool = True, aligned: bool = True, arch: int = 90) -> str:
    """SASS of `kernel` compiled for sm_`arch` (`compile_kernel`)."""
    return disassemble(compile_kernel(kernel, signature, constexprs, num_warps, num_stages, fp_fusion, aligned, arch))


def loops(text: str) -> list[tuple[int, int, int, collections.Counter]]:
    """(start, end, instructions, opcode histogram) of each loop: a branch back to an earlier address."""
    insts = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(LINE.search, text.splitlines()) if m]
    # nvdisasm prints a label line before the instruction it names: map labels to the next address.
    labels, pending = {}, []
    for line in text.splitlines():
        lab = re.match(r"\.(L_x_\d+):", line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = LINE.search(line)
        if m and pending:
            for p in pending:
                labels[p] = int(m.group(1), 16)
            pending = []
    out = []
    for addr, op, args in insts:
        if op.startswith("BRA"):
            target = re.search(r"`\(\.(L_x_\d+)\)", args)
            if target and labels.get(target.group(1)) is not None and labels[target.group(1)] <= addr:
                start = labels[target.group(1)]
                body = [o for a, o, _ in insts if start <= a <= addr]
                out.append((start, addr, len(body), collections.Counter(o.split(".")[0] for o in body)))
    return sorted(out, key=lambda r: r[2])


def _kv(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = int(value) if re.fullmatch(r"-?\d+", value) else {"True": True, "False": False}.get(value, value)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", help="module:function")
    p.add_argument("--sig", nargs="+", default=[], help="name=type (*bf16, i32, fp32, ...) for each runtime argument")
    p.add_argument("--const", nargs="+", default=[], help="name=value for each constexpr")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--no-fp-fusion", action="store_true")
    p.add_argument("--arch", type=int, default=90, help="the target: 80, 86, 89 or 90")
    p.add_argument("--dump", default=None, help="write the SASS here")
    args = p.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    text = sass(kernel, {k: v for k, v in (s.split("=", 1) for s in args.sig)}, _kv(args.const), args.warps,
                args.stages, not args.no_fp_fusion, arch=args.arch)
    if args.dump:
        open(args.dump, "w").write(text)
    for start, end, count, hist in loops(text):
        top = ", ".join(f"{op} {c}" for op, c in hist.most_common(12))
        print(f"loop {start:#06x}-{end:#06x}: {count} instructions ({top})")


if __name__ == "__main__":
    main(sys.argv[1:])
