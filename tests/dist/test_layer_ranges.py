"""Pipeline stage planning: layer ranges from --tensor-split shares, devices, stage counts."""

from __future__ import annotations

import pytest

from strata.config import EngineConfig
from strata.dist.plan import layer_ranges, parse_devices, parse_shares, stage_count, stage_device


def test_even_and_proportional_ranges():
    assert layer_ranges(4, [1, 1]) == [(0, 2), (2, 4)]
    assert layer_ranges(48, [3, 2]) == [(0, 29), (29, 48)]
    assert layer_ranges(5, [1, 1, 1]) == [(0, 2), (2, 3), (3, 5)]


def test_every_stage_gets_a_layer():
    assert layer_ranges(3, [100, 1, 1]) == [(0, 1), (1, 2), (2, 3)]
    assert layer_ranges(3, [1, 1, 100]) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="at least 3 layers"):
        layer_ranges(2, [1, 1, 1])


def test_ranges_cover_the_model_in_order():
    for n in range(2, 30):
        for shares in ([1, 1], [3, 2], [1, 2, 3], [5, 1, 1, 1]):
            if len(shares) > n:
                continue
            r = layer_ranges(n, shares)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(a < b for a, b in r) and all(r[i][1] == r[i + 1][0] for i in range(len(r) - 1))


def test_devices_and_counts():
    assert parse_devices("0,1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cuda:1, CUDA0") == ["cuda:1", "cuda:0"]
    with pytest.raises(ValueError, match="not a GPU index"):
        parse_devices("gpu-a")
    assert stage_count("3,2", None, 1, 0, False) == 2
    assert stage_count(None, ["cuda:0", "cuda:1"], 2, 8, True) == 4
    assert stage_count(None, None, 1, 4, True) == 4
    with pytest.raises(ValueError, match="--tensor-split"):
        stage_count(None, None, 1, 0, False)
    assert stage_device(1, ["cuda:2", "cuda:3"], True) == "cuda:3" and stage_device(1, None, False) == "cpu"
    with pytest.raises(ValueError, match="names 3 stages"):
        parse_shares("1,1,1", 2)


def test_config_checks_the_split_flags():
    EngineConfig(split_mode="layer", tensor_split="3,2")
    with pytest.raises(ValueError, match="split_mode"):
        EngineConfig(split_mode="row")
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(split_mode="layer", tensor_split="1,0")
    with pytest.raises(ValueError, match="need split_mode layer"):
        EngineConfig(tensor_split="1,1")
