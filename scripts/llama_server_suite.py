"""Runs llama.cpp's own server test suite (tools/server/tests, from the llama-cpp-python sdist on PyPI)
against `strata serve` on the embedded model, and reports pass / fail per file.

    python scripts/llama_server_suite.py [FILE ...] [--version 0.3.36] [-k EXPR]

The suite starts its server through `$LLAMA_SERVER_BIN_PATH`; this script points that at a launcher
(`python scripts/llama_server_suite.py --launch ...`) that maps llama-server's flags onto Strata's:
`--ctx-size N --parallel P` become `--ctx N/P` (llama-server's per-slot context; `--ctx N` with
`--kv-unified`, where one slot may use the whole context), `--batch-size` becomes `--chunk-size`, and
`--host`, `--port`, `--alias`, `--tags`, `--seed`, `--temp`, `--n-predict`, `--api-key`,
`--chat-template(-file)`, `--slots`/`--no-slots`, `--cors-origins`, `--reasoning`, `--verbose` and
`--metrics` keep their names (without `--metrics`, `--no-metrics`: llama-server's default); `--no-ui`
is `--no-webui`. The model flags (`--hf-repo`, `--model`, ...) are dropped: the embedded model serves
every test, so tests that assert the text or token counts of llama.cpp's own test models fail by design.
Flags about llama.cpp's internals (threads, GPU layers, flash attention, ...) are dropped too.
Downloads go to `.cache/llama-server-suite/`; the suite's own requirements are installed
there (`pip install --target`), not into the environment.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "llama-server-suite"
DEFAULT_FILES = ["test_basic.py", "test_completion.py", "test_chat_completion.py", "test_tokenize.py",
                 "test_template.py", "test_tool_call.py", "test_compat_anthropic.py", "test_compat_oai_responses.py",
                 "test_security.py", "test_metrics.py"]
DEPS = ["wget", "filelock", "requests", "pytest-timeout"]

# llama-server flag -> Strata flag (None: dropped); flags taking a value are listed with their arity.
TAKES_VALUE = {"--port", "--host", "--temp", "--seed", "--model", "--model-url", "--model-draft", "--hf-repo",
               "--hf-file", "--batch-size", "--ubatch-size", "--threads", "--n-gpu-layers", "--alias", "--tags",
               "--ctx-size", "--parallel", "-ctk", "-ctv", "-fa", "--n-predict", "--slot-save-path",
               "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type", "--api-key", "--spec-draft-n-max",
               "--spec-draft-n-min", "--reasoning-format", "--reasoning", "--chat-template", "--chat-template-file",
               "--mmproj-url", "--media-path", "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime",
               "--mcp-servers-config", "--mcp-servers-json", "--cors-origins", "--pooling", "--models-dir",
               "--models-max", "--models-preset", "--spec-synth-len", "--spec-synth-rates"}
RENAMED = {"--port": "--port", "--host": "--host", "--seed": "--seed", "--n-predict": "--n-predict",
           "--alias": "--alias", "--tags": "--tags",
           "--api-key": "--api-key", "--chat-template": "--chat-template",
           "--chat-template-file": "--chat-template-file", "--cors-origins": "--cors-origins",
           "--reasoning": "--reasoning", "--batch-size": "--chunk-size", "--temp": "--temp"}
SWITCHES = {"--slots": "--slots", "--no-slots": "--no-slots", "--no-ui": "--no-webui", "--metrics": "--metrics",
            "--verbose": "--verbose"}


def launch(argv: list[str]) -> int:
    """The launcher: llama-server's command line as `strata serve`'s, then exec."""
    os.execvp(sys.executable, [sys.executable, "-m", "strata.cli", *strata_args(argv)])
    return 1


def strata_args(argv: list[str]) -> list[str]:
    """llama-server's command line (its arguments) as `strata serve`'s."""
    out = ["serve", "--device", "cpu", "--log-level", "warning"]
    ctx, parallel, unified = None, 1, False
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if flag in TAKES_VALUE and i + 1 < len(argv) else None
        i += 2 if flag in TAKES_VALUE else 1
        if flag == "--ctx-size":
            ctx = int(value)  # type: ignore[arg-type]
        elif flag == "--parallel":
            parallel = int(value)  # type: ignore[arg-type]
        elif flag == "--kv-unified":
            unified = True
        elif flag in RENAMED and value is not None:
            out += [RENAMED[flag], value]
        elif flag in SWITCHES:
            out.append(SWITCHES[flag])
    if "--metrics" not in argv:  # llama-server serves /metrics only when asked to
        out.append("--no-metrics")
    out += ["--parallel", str(parallel)]
    if ctx:  # a unified KV cache lets one slot use the whole context, as Strata's shared pool does
        out += ["--ctx", str(ctx if unified else max(ctx // parallel, 64))]
    return out


def fetch(version: str) -> Path:
    """llama.cpp's tree from the sdist (tools/server/tests and models/templates), cached."""
    tree = CACHE / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "tools" / "server" / "tests").is_dir():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(CACHE)], check=True)
    with tarfile.open(CACHE / f"llama_cpp_python-{version}.tar.gz") as tar:
        wanted = [m for m in tar.getmembers() if "/vendor/llama.cpp/tools/server/tests/" in m.name
                  or "/vendor/llama.cpp/models/templates/" in m.name]
        tar.extractall(CACHE, members=wanted, filter="data")
    return tree


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--launch":
        return launch(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=DEFAULT_FILES)
    p.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist version")
    p.add_argument("-n", type=int, default=1, help="pytest-xdist workers (the suite's servers share one port: "
                   "more than one worker makes tests talk to each other's servers)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--timeout", type=int, default=300, help="seconds per test")
    a = p.parse_args()
    tree = fetch(a.version)
    deps = CACHE / "deps"
    if not (deps / "wget.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps), *DEPS], check=True)
    launcher = CACHE / "llama-server"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --launch \"$@\"\n")
    launcher.chmod(0o755)
    tests = tree / "tools" / "server" / "tests"
    report = CACHE / "report.xml"
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(launcher), "STRATA_NO_PROGRESS": "1",
           "PYTHONPATH": os.pathsep.join([str(deps), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           f"--timeout={a.timeout}", "-m", "not slow", *(["-n", str(a.n)] if a.n > 1 else []),
           *(["-k", a.k] if a.k else []), *[f"unit/{f}" for f in a.files]]
    subprocess.run(cmd, cwd=tests, env=env)
    per_file: dict[str, list[int]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        counts = per_file.setdefault(name, [0, 0, 0])
        if case.find("skipped") is not None:
            counts[2] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts[1] += 1
        else:
            counts[0] += 1
    print(f"{'file':36} {'pass':>5} {'fail':>5} {'skip':>5}")
    for name, (ok, bad, skip) in sorted(per_file.items()):
        print(f"{name:36} {ok:5} {bad:5} {skip:5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
