"""The quantization mode is one typed value (`QuantMode`) and the defaults live in one place:
every pass, pipeline and command that takes a mode, a chip or a group size agrees with them."""

from __future__ import annotations

import pytest

from toptpu.backend.target.chips import DEFAULT_CHIP, chip_names
from toptpu.dialects.common import DEFAULT_GROUP_SIZE, QuantMode
from toptpu.passes.convert_top_to_tpu import ConversionError, ConvertTopToTpuPass, parse_mode
from toptpu.passes.layer_group import LayerGroupPass
from toptpu.passes.pipelines import MachinePipeline, TpuPipeline


@pytest.mark.parametrize("name, act, bits", [
    ("f32", "f32", None), ("f16", "f16", None), ("bf16", "bf16", None),
    ("w8f16", "f16", 8), ("w8bf16", "bf16", 8), ("w4f16", "f16", 4), ("w4bf16", "bf16", 4),
    ("w8f32", "f32", 8), ("w4f32", "f32", 4)])
def test_each_mode_says_its_activations_and_weight_bits(name: str, act: str,
                                                        bits: int | None) -> None:
    mode = QuantMode(name)
    assert (mode.activation, mode.weight_bits) == (act, bits)
    assert mode == name and QuantMode.named(name) is mode  # a str: headers keep the spelling


def test_the_mode_list_and_its_refusals() -> None:
    assert QuantMode.names() == ["f32", "f16", "bf16", "w8f16", "w8bf16", "w4f16", "w4bf16",
                                 "w8f32", "w4f32"]
    assert QuantMode.names(bits=4) == ["w4f16", "w4bf16", "w4f32"]
    assert QuantMode.names(bits=None) == ["f32", "f16", "bf16"]
    for bad in ("w4", "W4BF16", "int8", "", "auto"):
        assert QuantMode.named(bad) is None
        with pytest.raises(ConversionError, match=f"unknown quantization mode '{bad}'; choose "
                           "one of f32, f16, bf16, w8f16"):
            parse_mode(bad)


def test_the_defaults_are_the_ones_every_pass_and_pipeline_uses() -> None:
    assert DEFAULT_CHIP in chip_names()
    assert ConvertTopToTpuPass().group_size == DEFAULT_GROUP_SIZE
    assert TpuPipeline().group_size == DEFAULT_GROUP_SIZE
    assert TpuPipeline().chip == MachinePipeline().chip == LayerGroupPass().chip == DEFAULT_CHIP


def test_the_command_lines_default_to_the_same_chip() -> None:
    import argparse

    from toptpu.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    with_chip = []
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if "--chip" in a.option_strings:
                assert a.default == DEFAULT_CHIP, name
                with_chip.append(name)
    assert {"compile", "estimate", "sweep"} <= set(with_chip)
