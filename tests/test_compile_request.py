"""The compile request is one frozen, typed value (`toptpu.request.CompileRequest`), built
once from the command line or the Python keywords and checked once:

- the command line and the Python keywords give equal requests, typed (a `QuantMode`, a
  `Chip`, `StaticShapes`, a `Parallel`), and a compile builds one request, which the
  compile steps are handed as it is;
- a bad value of every option is refused with its one line, from Python and from the
  command line, before any work;
- `toptpu compile` and `toptpu estimate` compile a net with the one `compile_net`: the same
  net gives the same program bytes both ways.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
from llm_fixtures import tiny_dir
from test_cli_errors import assert_one_error, cli

from toptpu.backend.contract import StaticShapes
from toptpu.backend.target.chips import Chip, get_chip
from toptpu.cli import build_parser
from toptpu.devices import Parallel
from toptpu.dialects.common import QuantMode
from toptpu.errors import CompileError, ToptpuError
from toptpu.request import AUTO, CompileRequest

MODEL = "MODEL_DIR"


def from_cli(argv: list[str]) -> CompileRequest:
    args = build_parser().parse_args(["compile", MODEL, "-o", "m.toptpu", *argv])
    return CompileRequest.from_args(args)


#: (command-line arguments, the same request as Python keywords)
SAME_REQUESTS: list[tuple[list[str], dict[str, Any]]] = [
    ([], {}),
    (["-q", "w4bf16", "--chip", "bm1688", "--seq-length", "64", "--max-input-length", "16",
      "--max-history", "32", "--prefill-lengths", "8,16", "--group-size", "32",
      "--symmetric"],
     {"mode": "w4bf16", "chip": "bm1688", "seq_length": 64, "max_input_length": 16,
      "max_history": 32, "prefill_lengths": [8, 16], "group_size": 32, "symmetric": True}),
    (["-q", "auto"], {"mode": "auto"}),
    (["--devices", "2"], {"devices": 2}),
    (["--devices", "4", "--parallel", "pp", "-q", "w8f16"],
     {"devices": 4, "parallel": "pp", "mode": "w8f16"}),
    (["--dequantize", "f32"], {"dequantize": "f32"}),
    (["-q", "w4f16", "--vision-quantize", "bf16", "--image-size", "448", "--max-tiles", "4",
      "--max-patches", "1024", "--max-pixels", "448x448", "--dump-ir", "ir"],
     {"mode": "w4f16", "vision_mode": "bf16", "image_size": 448, "max_tiles": 4,
      "max_patches": 1024, "max_pixels": (448, 448), "dump_ir": "ir"}),
    (["--top-pipeline", "builtin.module(top-pipeline,cse)", "--tpu-pipeline",
      "canonicalize,weight-reorder", "--pass-after", "fuse=cse", "--pass-after",
      "layer-group=canonicalize", "--pass-before", "convert-top-to-tpu=dce"],
     {"top_pipeline": "top-pipeline,cse", "tpu_pipeline": "canonicalize,weight-reorder",
      "pass_after": {"fuse": "cse", "layer-group": "canonicalize"},
      "pass_before": "convert-top-to-tpu=dce"}),
]


@pytest.mark.parametrize("argv, keywords", SAME_REQUESTS)
def test_the_command_line_and_the_python_keywords_give_equal_requests(
        argv: list[str], keywords: dict[str, Any]) -> None:
    assert from_cli(argv) == CompileRequest.make(**keywords)


def test_the_request_is_frozen_and_holds_values_not_text() -> None:
    r = from_cli(["-q", "w4bf16", "--chip", "bm1688", "--seq-length", "64", "--devices",
                  "1"])
    assert r.mode is QuantMode.W4BF16 and r.dequantize is None
    assert isinstance(r.chip, Chip) and r.chip == get_chip("bm1688")
    assert r.shapes == StaticShapes.make(64) and r.parallel is None
    assert r.quant_group_size == 64  # the w4 default, the group size not given
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.mode = QuantMode.F32  # type: ignore[misc]
    spread = CompileRequest.make(devices=2)
    assert spread.parallel is Parallel.TP  # several devices: tensor parallel by default
    assert CompileRequest.make(mode="auto").mode is AUTO
    assert CompileRequest.make(dequantize="bf16").mode is QuantMode.BF16  # the mode, then
    # typed values are taken as they are (an estimate's chip with figures changed)
    fast = get_chip("bm1684x").with_figures(ddr_gbps=128.0)
    typed = CompileRequest.make(mode=QuantMode.W8BF16, chip=fast, parallel=Parallel.PP,
                                devices=2)
    assert typed.chip is fast and typed.mode is QuantMode.W8BF16
    assert typed == CompileRequest(mode=QuantMode.W8BF16, chip=fast,
                                   parallel=Parallel.PP, devices=2)
    with pytest.raises(TypeError, match="unknown compile option"):
        CompileRequest.make(seq_len=64)


#: every Python keyword of the request -> a bad value and its one-line message
BAD_KEYWORDS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "mode": [({"mode": "w3"}, "unknown quantization mode 'w3'; choose one of f32, f16, bf16, "
              "w8f16, w8bf16, w4f16, w4bf16, w8f32, w4f32, or auto (a pre-quantized "
              "checkpoint's own)")],
    "dequantize": [({"dequantize": "q4_k"}, "--dequantize: unknown quantization mode 'q4_k'"),
                   ({"dequantize": "f32", "mode": "w4bf16"},
                    "-q w4bf16 contradicts --dequantize f32: give one of them")],
    "chip": [({"chip": "h100"}, "unknown chip 'h100'; choose one of bm1684x, bm1688")],
    "seq_length": [({"seq_length": 1}, "--seq-length must be an integer >= 2, not 1"),
                   ({"seq_length": "512"}, "--seq-length must be an integer >= 2, not '512'")],
    "max_input_length": [({"max_input_length": 0},
                          "--max-input-length must be an integer >= 1, not 0"),
                         ({"seq_length": 64, "max_input_length": 100},
                          "--max-input-length 100 must be between 1 and --seq-length 64")],
    "max_history": [({"max_history": 1.5}, "--max-history must be an integer >= 1, not 1.5"),
                    ({"seq_length": 64, "max_history": 65},
                     "--max-history 65 must be between 1 and --seq-length 64")],
    "prefill_lengths": [({"prefill_lengths": "16,64"},
                         "--prefill-lengths must be integers, not '16,64'"),
                        ({"seq_length": 64, "prefill_lengths": [16, 128]},
                         "--prefill-lengths 128 must be between 1 and --seq-length 64")],
    "devices": [({"devices": 0}, "--devices must be an integer >= 1, not 0"),
                ({"devices": 9}, "--devices 9: a bm1684x deployment joins at most 8 chips")],
    "batch": [({"batch": 0}, "--batch must be an integer >= 1, not 0"),
              ({"batch": 4, "devices": 2}, "--batch 4 with --devices 2: the batch nets are "
               "compiled for one chip; give one of them")],
    "parallel": [({"parallel": "dp", "devices": 2}, "--parallel must be tp, pp or ep, not 'dp'"),
                 ({"parallel": "pp"}, "--parallel pp spreads a model over several chips; "
                  "give --devices 2 or more (or drop --parallel)")],
    "group_size": [({"group_size": 0, "mode": "w4bf16"},
                    "--group-size must be positive or -1 (per channel), not 0"),
                   ({"group_size": 32, "mode": "bf16"}, "--group-size applies to "
                    "round-to-nearest weight quantization in the w4f16, w4bf16, w4f32; -q "
                    "bf16 does not use it")],
    "symmetric": [({"symmetric": "yes"}, "--symmetric is true, false or not given, not 'yes'"),
                  ({"symmetric": True, "mode": "f16"}, "--symmetric applies to "
                   "round-to-nearest weight quantization in the w4 and w8 modes")],
    "keep_float": [({"keep_float": 3}, "--keep-float is a part of a weight's name, not 3"),
                   ({"keep_float": "", "mode": "bf16"}, "--keep-float applies to weight "
                    "quantization in the w4 and w8 modes; -q bf16 quantizes no weight")],
    "dump_ir": [({"dump_ir": 3}, "--dump-ir is a path, not 3")],
    "image_size": [({"image_size": 0}, "--image-size must be an integer >= 1, not 0")],
    "max_tiles": [({"max_tiles": -1}, "--max-tiles must be an integer >= 1, not -1")],
    "max_patches": [({"max_patches": True}, "--max-patches must be an integer >= 1, not True")],
    "max_pixels": [({"max_pixels": (0, 768)}, "--max-pixels (0, 768): give the width and "
                    "height of the pixel budget as two positive integers (W,H)")],
    "vision_mode": [({"vision_mode": "auto"},
                     "--vision-quantize: unknown quantization mode 'auto'")],
    "calibrate": [({"calibrate": "rtn", "mode": "w4bf16"},
                   "--calibrate must be gptq or awq or signround or awq,gptq or gptaq or "
                   "awq,gptaq, not 'rtn'"),
                  ({"calibrate": "gptq,awq", "mode": "w4bf16"}, "--calibrate gptq,awq: the "
                   "combinations are awq,gptq and awq,gptaq (AWQ's scales folded, then GPTQ "
                   "or GPTAQ on the scaled weights)"),
                  ({"calibrate": "gptq", "mode": "bf16"}, "--calibrate gptq quantizes "
                   "weights: -q bf16 keeps the weights float; choose a w4 or w8 mode"),
                  ({"calibrate": "awq", "mode": "auto"}, "--calibrate awq quantizes weights: "
                   "-q auto takes a pre-quantized checkpoint's own weights"),
                  ({"calibrate": "gptq", "mode": "w4bf16", "devices": 2, "parallel": "tp"},
                   "--calibrate gptq with --parallel tp: the calibrated integers are not cut "
                   "over devices yet; use --parallel pp")],
    "calibration_data": [({"calibration_data": ["a.txt"]}, "--calibration-data shapes the "
                          "calibration of --calibrate; give --calibrate "
                          "gptq|awq|signround|awq,gptq|gptaq|awq,gptaq or drop --calibration-data"),
                         ({"calibrate": "gptq", "mode": "w4bf16", "calibration_data": [3]},
                          "--calibration-data is text file paths, not [3]"),
                         ({"calibrate": "gptq", "mode": "w4bf16", "calibration_data": []},
                          "--calibration-data names no file")],
    "calibration_samples": [({"calibrate": "gptq", "mode": "w4bf16",
                              "calibration_samples": 0},
                             "--calibration-samples must be an integer >= 1, not 0")],
    "calibration_seq_length": [({"calibrate": "gptq", "mode": "w4bf16",
                                 "calibration_seq_length": "512"},
                                "--calibration-seq-length must be an integer >= 1, not '512'")],
    "save_calibrated": [({"calibrate": "gptq", "mode": "w4bf16", "save_calibrated": 3},
                         "--save-calibrated is a path, not 3"),
                        ({"save_calibrated": "ck"}, "--save-calibrated shapes the "
                         "calibration of --calibrate")],
    "calibration_iterations": [({"calibrate": "signround", "mode": "w4bf16",
                                 "calibration_iterations": 0},
                                "--calibration-iterations must be an integer >= 1, not 0"),
                               ({"calibrate": "gptq", "mode": "w4bf16",
                                 "calibration_iterations": 50},
                                "--calibration-iterations: the tuning steps of --calibrate "
                                "signround; --calibrate gptq has none (drop it)"),
                               ({"calibration_iterations": 50}, "--calibration-iterations "
                                "shapes the calibration of --calibrate")],
    "calibration_ranges": [({"calibrate": "gptq", "mode": "w4bf16", "calibration_ranges": "max"},
                            "--calibration-ranges must be minmax or mse, not 'max'"),
                           ({"calibrate": "awq", "mode": "w4bf16", "calibration_ranges": "mse"},
                            "--calibration-ranges mse: GPTQ's range search; --calibrate awq "
                            "finds its ranges its own way"),
                           ({"calibration_ranges": "mse"}, "--calibration-ranges shapes the "
                            "calibration of --calibrate")],
    "top_pipeline": [({"top_pipeline": "shape-infer,fusee"}, "--top-pipeline "
                      "'shape-infer,fusee': unknown pass 'fusee' (did you mean 'fuse'?)"),
                     ({"top_pipeline": "fuse{max=2}"}, "--top-pipeline 'fuse{max=2}': pass "
                      "'fuse' has no option 'max' (its options: none)"),
                     ({"top_pipeline": "func.func(cse)"}, "pass pipeline 'func.func(cse)': "
                      "'func.func(...)' nests passes under 'func.func'"),
                     ({"top_pipeline": 3}, "--top-pipeline is pipeline text, not 3")],
    "tpu_pipeline": [({"tpu_pipeline": "canonicalize{"}, "--tpu-pipeline 'canonicalize{': "
                      "expected argument name at column 14"),
                     ({"tpu_pipeline": "layer-group{chip}"}, "--tpu-pipeline "
                      "'layer-group{chip}': option 'chip' of pass 'layer-group' needs a "
                      "value")],
    "pass_after": [({"pass_after": "fuse"}, "--pass-after 'fuse': give PASS=PIPELINE"),
                   ({"pass_after": "fused=cse"}, "--pass-after 'fused=cse': the compile runs "
                    "no pass 'fused'"),
                   ({"pass_after": {"fuse": "no-such-pass"}}, "--pass-after "
                    "'fuse=no-such-pass': unknown pass 'no-such-pass'"),
                   ({"pass_after": "shape-infer=cse", "top_pipeline": "fuse"},
                    "--pass-after 'shape-infer=cse': the compile runs no pass 'shape-infer'"),
                   ({"pass_after": 7}, "--pass-after takes PASS=PIPELINE text (or a list of "
                    "them), not 7")],
    "pass_before": [({"pass_before": ["fuse=cse", "=cse"]}, "--pass-before '=cse': give "
                     "PASS=PIPELINE")],
}


def test_every_option_has_its_bad_values_here() -> None:
    """A new request option comes with its refusals in `BAD_KEYWORDS` and `BAD_ARGS`."""
    keywords = {o.keyword for o in CompileRequest.options()}
    assert set(BAD_KEYWORDS) == keywords
    flags = {o.flags[-1] for o in CompileRequest.options()}
    assert flags <= {a[0] for a, _, _ in BAD_ARGS}


@pytest.mark.parametrize("keyword", sorted(BAD_KEYWORDS))
def test_a_bad_keyword_value_is_one_line_naming_it(keyword: str) -> None:
    for given, message in BAD_KEYWORDS[keyword]:
        with pytest.raises(CompileError) as e:
            CompileRequest.make(**given)
        assert str(e.value) == message or str(e.value).startswith(message), given
        assert "\n" not in str(e.value)


#: the command line: (arguments, exit status, the one line's fragment; {model}: the model
#: directory); every option's long flag leads one case (status 2: argparse's type; 1: the
#: request's check)
BAD_ARGS: list[tuple[list[str], int, str]] = [
    (["--quantize", "w3"], 1, "unknown quantization mode 'w3'"),
    (["--dequantize", "w3f16"], 1, "--dequantize: unknown quantization mode 'w3f16'"),
    (["--chip", "h100"], 1, "unknown chip 'h100'"),
    (["--seq-length", "1"], 2, "--seq-length: must be an integer >= 2"),
    (["--max-input-length", "0"], 2, "--max-input-length: must be an integer >= 1"),
    (["--max-history", "100", "--seq-length", "64"], 1,
     "--max-history 100 must be between 1 and --seq-length 64"),
    (["--prefill-lengths", "16,16"], 2, "16 is given twice"),
    (["--devices", "9"], 1, "--devices 9: a bm1684x deployment joins at most 8 chips"),
    (["--batch", "0"], 2, "--batch: must be an integer >= 1"),
    (["--batch", "2", "--devices", "2"], 1, "--batch 2 with --devices 2"),
    (["--parallel", "dp"], 2, "argument --parallel: invalid choice: 'dp'"),
    (["--parallel", "tp"], 1, "--parallel tp spreads a model over several chips"),
    (["--group-size", "-2"], 2, "positive integer or -1"),
    (["--keep-float", "embed"], 1, "--keep-float applies to weight quantization in the w4 "
     "and w8 modes; the default mode"),
    (["--symmetric", "-q", "bf16"], 1, "--symmetric applies to round-to-nearest"),
    (["--dump-ir", "{model}/ir"], 1, "--dump-ir '{model}/ir' is inside"),
    (["--image-size", "0"], 2, "--image-size: must be an integer >= 1"),
    (["--max-tiles", "x"], 2, "--max-tiles: must be an integer >= 1, got 'x'"),
    (["--max-patches", "0"], 2, "--max-patches: must be an integer >= 1"),
    (["--max-pixels", "768"], 2, "--max-pixels: must be a width and a height"),
    (["--vision-quantize", "w3"], 1, "--vision-quantize: unknown quantization mode 'w3'"),
    (["--calibrate", "rtn"], 2, "argument --calibrate: invalid choice: 'rtn'"),
    (["--calibration-data", "{model}/config.json"], 1,
     "--calibration-data shapes the calibration of --calibrate"),
    (["--calibration-samples", "0", "--calibrate", "gptq", "-q", "w4bf16"], 2,
     "--calibration-samples: must be an integer >= 1"),
    (["--calibration-seq-length", "x", "--calibrate", "gptq", "-q", "w4bf16"], 2,
     "--calibration-seq-length: must be an integer >= 1, got 'x'"),
    (["--save-calibrated", "{model}/ck", "--calibrate", "gptq", "-q", "w4bf16"], 1,
     "--save-calibrated '{model}/ck' is inside the input model directory"),
    (["--calibration-iterations", "0", "--calibrate", "signround", "-q", "w4bf16"], 2,
     "--calibration-iterations: must be an integer >= 1, got '0'"),
    (["--calibration-ranges", "mse", "--calibrate", "awq", "-q", "w4bf16"], 1,
     "--calibration-ranges mse: GPTQ's range search; --calibrate awq finds its ranges its "
     "own way"),
    (["--top-pipeline", "shape-infer,,"], 1, "--top-pipeline 'shape-infer,,': expected "
     "pass name at column 13"),
    (["--tpu-pipeline", "expand-silu"], 1,
     "--tpu-pipeline 'expand-silu': unknown pass 'expand-silu'"),
    (["--pass-after", "fuse"], 1, "--pass-after 'fuse': give PASS=PIPELINE"),
    (["--pass-before", "nothing=cse"], 1,
     "--pass-before 'nothing=cse': the compile runs no pass 'nothing'"),
]


def test_a_bad_option_value_is_one_line_before_any_work(tmp_path_factory, tmp_path, capsys,
                                                        monkeypatch) -> None:
    def load(*args: Any, **kw: Any) -> None:
        raise AssertionError("compile loaded the model before refusing")

    monkeypatch.setattr("toptpu.compiler._load", load)
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = str(tmp_path / "m.toptpu")
    for argv, status, fragment in BAD_ARGS:
        code, _, err = cli(["compile", ck, "-o", out, *(a.format(model=ck) for a in argv)],
                           capsys)
        assert_one_error(code, err, "compile", fragment.format(model=ck), status)
    assert os.listdir(tmp_path) == []


class Stop(ToptpuError):
    """Raised where the test stops a compile (after its request is checked)."""


def test_a_compile_builds_one_request_and_hands_it_on(tmp_path_factory, tmp_path,
                                                      monkeypatch, capsys) -> None:
    """The command line and `toptpu.compile(**keywords)` build one request each, equal, and
    the compile steps get that request; a request given is not built again."""
    from toptpu.compiler import compile as compile_model

    built: list[CompileRequest] = []
    planned: list[CompileRequest] = []
    post_init = CompileRequest.__post_init__

    def counting(self: CompileRequest) -> None:
        post_init(self)
        built.append(self)

    def plan(model: Any, request: CompileRequest, **kw: Any) -> None:
        planned.append(request)
        raise Stop("stopped before loading")

    monkeypatch.setattr(CompileRequest, "__post_init__", counting)
    monkeypatch.setattr("toptpu.compiler.plan", plan)
    ck = tiny_dir(tmp_path_factory, "qwen2")
    out = str(tmp_path / "m.toptpu")
    argv = ["-q", "w4bf16", "--seq-length", "64", "--group-size", "32", "--devices", "2",
            "--parallel", "pp"]
    assert main_stops(["compile", ck, "-o", out, *argv], capsys)
    assert len(built) == 1 and planned == built
    keywords: dict[str, Any] = {"mode": "w4bf16", "seq_length": 64, "group_size": 32,
                                "devices": 2, "parallel": "pp"}
    with pytest.raises(Stop):
        compile_model(ck, out, progress=None, **keywords)
    assert len(built) == 2 and planned[1] is built[1] and planned[1] == planned[0]
    with pytest.raises(Stop):
        compile_model(ck, out, planned[0], progress=None)
    assert len(built) == 2 and planned[2] is planned[0]
    with pytest.raises(TypeError, match="not both"):
        compile_model(ck, out, planned[0], mode="f32")


def main_stops(argv: list[str], capsys: pytest.CaptureFixture[str]) -> bool:
    code, _, err = cli(argv, capsys)
    return code == 1 and "stopped before loading" in err


@pytest.mark.slow  # compiles the tiny model twice, and its nets for the estimate
@pytest.mark.parametrize("keywords", [
    {"mode": "w4bf16", "seq_length": 48, "max_input_length": 8},
    {"mode": "f32", "seq_length": 48, "max_input_length": 8, "devices": 2}])
def test_compile_and_estimate_make_the_same_program_of_each_net(
        tmp_path_factory, tmp_path, keywords: dict[str, Any]) -> None:
    """`toptpu estimate` (placeholder weights, one layer) and `toptpu compile` build each
    net with the one `compile_net`: the same command streams, byte for byte (a
    tensor-parallel net's too)."""
    import toptpu.compiler
    import toptpu.estimate
    import toptpu.net_compiler
    from toptpu.estimate import compile_programs, read_checked_config

    assert toptpu.estimate.compile_net is toptpu.net_compiler.compile_net
    assert toptpu.compiler.compile_net is toptpu.net_compiler.compile_net
    src = tiny_dir(tmp_path_factory, "qwen2")
    res = toptpu.compiler.compile(src, str(tmp_path / "m.toptpu"), progress=None,
                                  keep_modules=True, **keywords)
    request = CompileRequest.make(**keywords)
    programs = compile_programs(read_checked_config(src, request), request, list(res.nets))
    assert set(programs) == set(res.nets)
    for name, net in res.nets.items():
        assert net.program is not None
        assert net.program.to_json() == programs[name].to_json(), name
