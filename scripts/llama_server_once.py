"""Times one long prompt through llama-server: starts it with the flags given after `--`, waits for its
/health (giving up, with the server's log, as soon as the server exits), sends one /completion of
`--tokens` token ids (the ids `strata bench kv-tier` reads: seed 0, 10..999) with `--decode` tokens to
generate, writes the response (its `timings`: prompt and generated tokens per second) to `--out`, and
stops the server. `strata bench kv-tier --llamacpp OUT` reads those timings.

With `--read-timeout S`, a prompt still being read after S seconds is given up: OUT then holds the
server's own last progress line (the tokens read so far, their seconds and rate; `"partial": true`, no
decode figure). That rate is over the read's first part: with every K/V in RAM each token's attention
costs more than the one before it, so it is an upper bound on the whole read's.

    python scripts/llama_server_once.py --tokens 130944 --decode 32 --out nkvo.json -- \\
        /tmp/llama/build/bin/llama-server -m F.gguf -ngl 99 -fa on -nkvo -ncmoe 36 -c 131072
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from strata.bench.kv_tier import prompt_ids


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


# llama-server's periodic line while it reads a prompt (print_timings_pp in tools/server).
PROGRESS = re.compile(r"prompt processing, n_tokens = +(\d+), progress = ([\d.]+), t = +([\d.]+) s / ([\d.]+) tokens per second")


def last_progress(log: str) -> dict | None:
    """The last prompt-progress line of a llama-server log: tokens read, fraction, seconds and rate."""
    found = PROGRESS.findall(log)
    if not found:
        return None
    n, frac, t, rate = found[-1]
    return {"prompt_tokens_read": int(n), "progress": float(frac), "read_s": float(t), "read_tok_s": float(rate)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (the prompt's ids stay below it)")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--out", required=True)
    p.add_argument("--log", default="/tmp/llama_server_once.log")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--read-timeout", type=float, default=None,
                   help="give up a read still going after this many seconds; write its rate so far")
    p.add_argument("server", nargs=argparse.REMAINDER, help="-- llama-server and its flags")
    a = p.parse_args()
    cmd = [x for x in a.server if x != "--"] + ["--port", str(a.port), "-np", "1"]
    base = f"http://127.0.0.1:{a.port}"
    with open(a.log, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while _get(base + "/health", 5) != 200:
            if server.poll() is not None or time.monotonic() - t0 > a.start_timeout:
                print(f"llama-server {'exited' if server.poll() is not None else 'did not start'}; its log:",
                      file=sys.stderr)
                print(open(a.log).read()[-6000:], file=sys.stderr)
                return 1
            time.sleep(2)
        print(f"llama-server up in {time.monotonic() - t0:.0f} s", flush=True)
        body = json.dumps({"prompt": prompt_ids(a.tokens, a.vocab), "n_predict": a.decode, "ignore_eos": True,
                           "cache_prompt": False, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/completion", body, {"Content-Type": "application/json"})
        t1 = time.monotonic()
        got: dict = {}

        def send() -> None:
            try:
                with urllib.request.urlopen(req, timeout=None) as r:
                    got["resp"] = json.load(r)
            except Exception as e:  # reported below, from the main thread
                got["error"] = e

        worker = threading.Thread(target=send, daemon=True)
        worker.start()
        worker.join(a.read_timeout)
        if worker.is_alive():
            seen = last_progress(open(a.log, errors="replace").read())
            if seen is None:
                print(f"no prompt progress in llama-server's log after {a.read_timeout:.0f} s", file=sys.stderr)
                return 1
            resp = {"partial": True, "prompt_tokens": a.tokens, "decode_tok_s": None, **seen}
            with open(a.out, "w") as f:
                json.dump(resp, f, indent=1)
            print(json.dumps(resp, indent=1))
            return 0
        if "error" in got:
            raise got["error"]
        resp = got["resp"]
        resp.pop("content", None)
        resp["wall_s"] = time.monotonic() - t1
        with open(a.out, "w") as f:
            json.dump(resp, f, indent=1)
        print(json.dumps(resp.get("timings"), indent=1))
        return 0
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
