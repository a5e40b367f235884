"""Strata's packages import only downward (scripts/layering.py states the order once), at module level
and inside functions, with no circle between packages or modules; the scheduler and the allocator never
import torch."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.path.join(REPO, "scripts"))

import layering  # noqa: E402


def test_strata_imports_only_downward_with_no_circle():
    assert layering.report(REPO / "strata") == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "strata"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return root


def test_a_kernel_importing_a_model_inside_a_function_fails(tmp_path):
    root = _tree(tmp_path, {
        "kernels/gemv.py": "def bench():\n    from strata.models.moe import MoE\n    return MoE\n",
        "models/moe.py": "from strata.kernels import gemv\n\nclass MoE:\n    pass\n",
    })
    lines = layering.report(root)
    assert any("strata.kernels.gemv:2 (kernels) imports strata.models.moe (models) inside a function" in line
               for line in lines), lines
    assert "import circle between kernels <-> models" in lines
    assert "import circle between modules strata.kernels.gemv <-> strata.models.moe" in lines


def test_relative_imports_and_package_names_resolve(tmp_path):
    root = _tree(tmp_path, {
        "sched/scheduler.py": "from ..runner import steps\nimport torch\n",
        "runner/steps.py": "from strata import config\n",
        "config.py": "",
    })
    lines = layering.report(root)
    assert any(line.startswith("strata.sched.scheduler:1 (sched) imports strata.runner.steps (runner)") for line in lines)
    assert "strata.sched.scheduler:2 imports torch" in lines
    assert not any(line.startswith("strata.runner.steps") for line in lines)  # runner may import config


def test_every_package_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in (REPO / "strata").iterdir()
             if (p.suffix == ".py" or (p.is_dir() and not p.name.startswith(("_", "."))))}
    assert units <= set(layering.LEVEL), units - set(layering.LEVEL)
