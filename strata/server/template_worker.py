"""A chat-template renderer in a process of its own (`python -m strata.server.template_worker`), so that a
model file's template, untrusted code in a sandbox that stops code execution but not loops or memory,
can be killed when it runs too long and cannot take more than its memory limit.

Protocol, JSON lines: the first line on stdin is `{"template", "bos_token", "eos_token", "max_chars",
"memory_bytes"}`, answered `{"ready": true}` once the worker has compiled the template; then each line is a render
`{"messages", "tools", "add_generation_prompt", "kwargs"}` answered by one line on stdout: `{"text": ...}`
or `{"error": ...}`.
"""

from __future__ import annotations

import json
import resource
import sys


def _limit_memory(extra: int) -> None:
    """Address space: what the process has now plus `extra` bytes (MemoryError beyond)."""
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        now = 0
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = now + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> int:
    from strata.tokenizer import DEFAULT_CHAT_TEMPLATE, compile_chat_template, render_chat_template

    setup = json.loads(sys.stdin.readline())
    source = setup["template"] or DEFAULT_CHAT_TEMPLATE
    _limit_memory(setup["memory_bytes"])  # compiling folds constant expressions: it is bounded too
    try:
        compile_chat_template(source)
        error = None
    except MemoryError:
        error = f"the chat template used more than {setup['memory_bytes'] // 2**20} MiB"
    except Exception as e:  # answered to every request: the parent reports it at start-up
        error = f"{type(e).__name__}: {e}"
    # Ready once compiled: a render's time limit then counts the render alone, not the compiling.
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            if error is not None:
                raise ValueError(error)
            req = json.loads(line)
            text = render_chat_template(source, req["messages"], req["tools"], req["add_generation_prompt"],
                                        setup["bos_token"], setup["eos_token"], req["kwargs"], setup["max_chars"])
            reply = {"text": text}
        except MemoryError:
            reply = {"error": f"the chat template used more than {setup['memory_bytes'] // 2**20} MiB"}
        except RecursionError:
            reply = {"error": "the chat template recursed too deeply"}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)}
        try:
            out.write(json.dumps(reply) + "\n")
            out.flush()
        except MemoryError:
            out.write(json.dumps({"error": "the rendered prompt did not fit the template's memory"}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
