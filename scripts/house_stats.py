"""The state of the code base in a few counts: the import graph against the layer order
(scripts/layering.py), the STRATA_* switches, the files under bench/results/, the lines of docs, and
history written into code or docs (rounds, dates, issue numbers), which git keeps instead.

    python scripts/house_stats.py [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import layering  # noqa: E402

ROUND = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                   r"thirteenth|fourteenth|fifteenth|last|next) (H[0-9]00 )?round\b|\bround ?[0-9]+\b", re.I)
DATE = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
ISSUE = re.compile(r"\bissue #?[0-9]+", re.I)


def tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
        return [REPO / line for line in out.stdout.splitlines() if (REPO / line).exists()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: what is on disk
        return [p for pat in patterns for p in REPO.glob(pat)]


def switches() -> list[str]:
    return sorted(set(re.findall(r'Switch\(\s*"(STRATA_[A-Z0-9_]+)"', (REPO / "strata" / "env.py").read_text())))


def mentions(paths: list[Path]) -> dict[str, int]:
    counts = {"rounds": 0, "dates": 0, "issue_numbers": 0}
    for p in paths:
        text = p.read_text(errors="ignore")
        counts["rounds"] += len(ROUND.findall(text))
        counts["dates"] += len(DATE.findall(text))
        counts["issue_numbers"] += len(ISSUE.findall(text))
    return counts


def stats() -> dict:
    imports = layering.all_imports(REPO / "strata")
    up = layering.upward(imports)
    docs = tracked("README.md", "docs/*.md")
    code = tracked("strata/*.py", "strata/**/*.py")
    return {
        "import_circles_between_packages": len(layering.package_cycles(imports)),
        "import_circles_between_modules": [" <-> ".join(c) for c in layering.module_cycles(imports)],
        "upward_imports_module_level": sum(not i.in_function for i in up),
        "upward_imports_in_functions": sum(i.in_function for i in up),
        "strata_switches": switches(),
        "bench_results_files": len(tracked("bench/results/*")),
        "doc_lines": {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in docs},
        "history_in_code": mentions(code),
        "history_in_docs": mentions(docs),
        "python_files_over_600_lines": sorted(str(p.relative_to(REPO)) for p in code
                                              if len(p.read_text().splitlines()) > 600),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    s = stats()
    if ap.parse_args().json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"import circles between packages:      {s['import_circles_between_packages']}")
    print(f"import circles between modules:       {len(s['import_circles_between_modules'])}"
          + "".join(f"\n    {c}" for c in s["import_circles_between_modules"]))
    print(f"upward imports (module level):        {s['upward_imports_module_level']}")
    print(f"upward imports (inside functions):    {s['upward_imports_in_functions']}")
    print(f"STRATA_* switches ({len(s['strata_switches'])}):                {', '.join(s['strata_switches'])}")
    print(f"files in bench/results/:              {s['bench_results_files']}")
    print(f"lines of docs:                        {sum(s['doc_lines'].values())} "
          f"({', '.join(f'{k} {v}' for k, v in s['doc_lines'].items())})")
    for where in ("code", "docs"):
        m = s[f"history_in_{where}"]
        print(f"history in {where + ':':<27} {m['rounds']} rounds, {m['dates']} dates, {m['issue_numbers']} issue numbers")
    print(f"python files over 600 lines:          {', '.join(s['python_files_over_600_lines']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
