"""Strata's layer order and the import graph that must respect it.

Every import between strata packages, at module level or inside a function, goes down the layers (or
stays within one), and no two packages, nor two modules, import each other through any chain. `tests/test_layering.py`
asserts both; `scripts/house_stats.py` reports the counts.

    python scripts/layering.py            # the violations, one per line (exit 1 if any)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest first. A package (or top-level module) may import its own layer and those below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels",),  # leaves: Triton kernels beside their torch references
    ("env", "config", "params", "grammar", "sampling", "tokenizer", "data", "cli_args", "memory_plan", "version", "assets"),
    ("kvcache",),
    ("attention",),
    ("models",),
    ("loaders",),
    ("sched",),
    ("speculative",),
    ("runner",),
    ("dist",),  # pipeline stages: rank 0's link and the other stages' loop, on torch.distributed
    ("engine",),
    ("llm", "server", "tui", "web"),
    ("bench", "cli", "__init__", "__main__"),
)
# Packages that never import torch: the scheduler and the block allocator stay CPU-testable.
TORCH_FREE = ("strata.sched", "strata.kvcache.allocator", "strata.kvcache.prefix", "strata.params", "strata.memory_plan")

LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (a name imported from a package counts as its submodule)
    line: int
    in_function: bool

    @property
    def source_unit(self) -> str:
        return unit_of(self.module)

    @property
    def target_unit(self) -> str:
        return unit_of(self.target)


def unit_of(module: str) -> str:
    """strata.kernels.quant.q8_0 -> kernels; strata.config -> config; strata -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(root: Path, dotted: str) -> bool:
    """Whether `dotted` (strata.x.y) names a module or package under `root` (the strata folder)."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()


def imports_of(root: Path, path: Path, package: str = "strata") -> list[Import]:
    """Every import of a `package` module in one file, with whether it sits inside a function."""
    module = module_name(root, path)
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, module, path.name == "__init__.py")
                # `from strata.kernels import gemv` imports the module strata.kernels.gemv; `from strata
                # import __version__`, a name of the package itself.
                targets = [f"{base}.{a.name}" if _is_module(root, f"{base}.{a.name}") else base for a in child.names]
            else:
                visit(child, inner)
                continue
            for t in targets:
                if t == package or t.startswith(package + "."):
                    found.append(Import(module, t, child.lineno, in_function))

    visit(tree, False)
    return found


def all_imports(root: Path) -> list[Import]:
    return [imp for path in sorted(root.rglob("*.py")) for imp in imports_of(root, path)]


def upward(imports: list[Import]) -> list[Import]:
    """Imports from a lower layer to a higher one (and from a unit the order does not name)."""
    bad = []
    for imp in imports:
        src, dst = imp.source_unit, imp.target_unit
        if src == dst:
            continue
        if src not in LEVEL or dst not in LEVEL or LEVEL[dst] > LEVEL[src]:
            bad.append(imp)
    return bad


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of two or more units in the unit-level import graph."""
    return _cycles({(i.source_unit, i.target_unit) for i in imports})


def module_cycles(imports: list[Import]) -> list[list[str]]:
    """The same among modules (a package's `__init__` counted as the package's module)."""
    modules = {i.module for i in imports}
    # `from strata.kernels import quant` names the module strata.kernels.quant, not the package.
    return _cycles({(i.module, i.target) for i in imports if i.target in modules})


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def torch_users(root: Path) -> list[str]:
    """Modules of TORCH_FREE that import torch, at any level."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(root, path)
        if not any(module == p or module.startswith(p + ".") for p in TORCH_FREE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                bad.append(f"{module}:{node.lineno} imports torch")
    return bad


def report(root: Path) -> list[str]:
    imports = all_imports(root)
    lines = [f"{i.module}:{i.line} ({i.source_unit}) imports {i.target} ({i.target_unit})"
             f"{' inside a function' if i.in_function else ''}: a higher layer" for i in upward(imports)]
    lines += [f"import circle between {' <-> '.join(g)}" for g in package_cycles(imports)]
    lines += [f"import circle between modules {' <-> '.join(g)}" for g in module_cycles(imports)]
    return lines + torch_users(root)


def main() -> int:
    root = Path(__file__).resolve().parent.parent / "strata"
    lines = report(root)
    print("\n".join(lines) if lines else "layering: no upward import, no circle between packages")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
