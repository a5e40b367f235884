"""scripts/llama_server_once.py against a stand-in llama-server (a small HTTP server taking the same flags):
the prompt it sends is the ids `strata bench kv-tier` reads, the response's timings are written out, and
a server that exits before it is up ends the wait at once with its log, and a read given up after
--read-timeout leaves the server's own rate so far."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llama_server_once.py"

FAKE = '''
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--die" in sys.argv:
    print("fake llama-server: cannot load the model"); sys.exit(3)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        open(sys.argv[sys.argv.index("--dump") + 1], "w").write(json.dumps(body))
        if "--slow" in sys.argv:  # a read that goes on: two progress lines, as llama-server prints them
            for n, t in ((64, 3.2), (128, 8.0)):
                print(f"slot print_timings_pp: id  0 | task 0 | prompt processing, n_tokens = {n:6d}, "
                      f"progress = {n / len(body['prompt']):.2f}, t = {t:6.2f} s / {n / t:.2f} tokens per second",
                      flush=True)
            time.sleep(60)
        out = {"content": "x", "timings": {"prompt_n": len(body["prompt"]), "prompt_per_second": 123.0,
                                           "predicted_n": body["n_predict"], "predicted_per_second": 7.0}}
        data = json.dumps(out).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _free_port() -> int:
    """A port no server holds now: each run its own, so no earlier test's server, still closing, answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, *flags, once=()):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE)
    out, dump = tmp_path / "out.json", tmp_path / "dump.json"
    cmd = [sys.executable, str(SCRIPT), "--tokens", "300", "--decode", "5", "--port", str(_free_port()), "--out", str(out),
           "--log", str(tmp_path / "server.log"), "--start-timeout", "60", *once, "--", sys.executable, str(fake),
           "--dump", str(dump), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120), out, dump


def test_one_prompt_of_the_benchs_ids_and_its_timings(tmp_path):
    from strata.bench import kv_tier

    proc, out, dump = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    sent = json.loads(dump.read_text())
    g = torch.Generator().manual_seed(0)
    assert sent["prompt"] == torch.randint(10, 1000, (300,), generator=g).tolist() == kv_tier.prompt_ids(300, 151936)
    assert sent["n_predict"] == 5 and sent["ignore_eos"] and not sent["cache_prompt"]
    assert kv_tier.llamacpp_figures(str(out)) == {"read_tok_s": 123.0, "decode_tok_s": 7.0, "prompt_tokens": 300,
                                                  "decode_tokens": 5}


def test_a_server_that_exits_ends_the_wait_with_its_log(tmp_path):
    proc, out, _ = _run(tmp_path, "--die")
    assert proc.returncode == 1 and not out.exists()
    assert "exited" in proc.stderr and "cannot load the model" in proc.stderr


def test_a_read_given_up_leaves_the_servers_rate_so_far(tmp_path):
    from strata.bench import kv_tier

    proc, out, _ = _run(tmp_path, "--slow", once=("--read-timeout", "3"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["partial"] and got["prompt_tokens_read"] == 128 and got["read_s"] == 8.0
    assert got["read_tok_s"] == 16.0 and got["prompt_tokens"] == 300 and got["decode_tok_s"] is None
    assert kv_tier.llamacpp_figures(str(out)) == {"read_tok_s": 16.0, "decode_tok_s": None, "partial": True,
                                                  "prompt_tokens_read": 128}
