"""`strata bench split`: its summary from the arms' figures (null where not measured), and its refusal
without CUDA."""

from __future__ import annotations

import pytest
import torch

from strata.bench.split import summarize


def test_summary_keys_and_nulls():
    arms = {"one_1": {"decode_tok_s": 100.0, "read_tok_s": 1000.0}, "one_2": None,
            "split_1": {"decode_tok_s": 95.0, "read_tok_s": 1800.0}, "split_2": {"decode_tok_s": 171.0}}
    s = summarize(arms, 2, {"decode_tok_s": 50.0, "read_tok_s": 600.0})
    assert s == pytest.approx({"gpus": 2, "two_slots_over_one": 1.8, "two_stages_over_one": 0.95,
                               "decode_over_llamacpp": 1.9, "read_over_llamacpp": 3.0})
    s = summarize({**arms, "one_1": None}, 2, None)
    assert s["two_stages_over_one"] is None and s["decode_over_llamacpp"] is None and s["read_over_llamacpp"] is None
    assert s["two_slots_over_one"] == pytest.approx(1.8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda(capsys):
    from strata.cli import main

    assert main(["bench", "split"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_the_plot_draws_the_arms_that_ran(tmp_path):
    from strata.bench.results import save
    from strata.bench.split import draw

    pytest.importorskip("matplotlib")
    arms = {"one_1": {"decode_tok_s": 100.0, "read_tok_s": 1000.0, "slots": 1}, "one_2": None}
    save({"arms": arms, "summary": summarize(arms, 1, None)}, str(tmp_path / "layer_split_x_cuda.json"), draw)
    assert (tmp_path / "layer_split_x_cuda.png").stat().st_size > 0
