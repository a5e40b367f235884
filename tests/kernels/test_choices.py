"""The kernel choices (`strata.kernels.choices`): their values and checks, `using` for a block, and the
engine installing its `EngineConfig`'s choices when it starts."""

from __future__ import annotations

import dataclasses

import pytest

from strata.config import EngineConfig
from strata.kernels import choices
from strata.kernels.choices import KernelChoices

FIELDS = ("quant_decode", "moe_decode", "dequant_read_rows", "linear_attention_kernel", "pdl", "cpu_kernels")


def test_defaults_are_the_engine_configs():
    assert tuple(f.name for f in dataclasses.fields(KernelChoices)) == FIELDS
    assert EngineConfig().kernel_choices() == KernelChoices()
    assert KernelChoices() == KernelChoices(quant_decode="auto", moe_decode="fused", dequant_read_rows=512,
                                            linear_attention_kernel="auto", pdl=True, cpu_kernels=True)


@pytest.mark.parametrize("bad", [dict(quant_decode="fast"), dict(moe_decode="fast"), dict(dequant_read_rows=-1),
                                 dict(linear_attention_kernel="triton"), dict(dequant_read_rows=True),
                                 dict(pdl="yes"), dict(cpu_kernels=1)])
def test_bad_values_are_refused(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        KernelChoices(**bad)
    # The config checks values; its flags parse the booleans' types.
    if not isinstance(bad[name], bool) and name not in ("pdl", "cpu_kernels"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**bad)


def test_using_overrides_for_the_block_and_restores():
    before = choices.current()
    with choices.using(quant_decode="dp4a", pdl=False) as inside:
        assert choices.current() is inside
        assert (inside.quant_decode, inside.pdl, inside.moe_decode) == ("dp4a", False, before.moe_decode)
        choices.set_choices(KernelChoices(moe_decode="grouped"))  # whatever the block sets
    assert choices.current() is before
    with pytest.raises(TypeError):
        choices.set_choices(dataclasses.asdict(before))


def test_the_config_maps_each_field():
    cfg = EngineConfig(quant_decode="dequant", moe_decode="grouped", dequant_read_rows=0,
                       linear_attention_kernel="ref", pdl=False)
    assert cfg.kernel_choices() == KernelChoices("dequant", "grouped", 0, "ref", False)


def test_the_engine_installs_its_config_choices():
    from strata.engine.engine import LLMEngine

    wanted = KernelChoices(quant_decode="dp4a", moe_decode="grouped", dequant_read_rows=64,
                           linear_attention_kernel="ref", pdl=False)
    with choices.using():  # the process's choices back after the test
        eng = LLMEngine(EngineConfig(device="cpu", ctx=64, **dataclasses.asdict(wanted)), progress=False)
        try:
            assert choices.current() == wanted
        finally:
            eng.close()
