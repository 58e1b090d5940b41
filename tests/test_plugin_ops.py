"""Plugin ops (`Plugin.ops`, `toptpu.dialects.plugin_ops`): a plugin's Top op, written as
toptpu's own, parses and prints in toptpu-opt, gets its Tpu twin, lowers with
convert-top-to-tpu and runs through its kernel binding (its kernel in the plugin) on the
interpreters and the machine; the example plugin's `fuse-silu-mul` compiles a real (tiny,
random-weight transformers) model with its op `top.silu_mul`, equal to the default compile
on both executors, and a model file holding a plugin's op is refused in one line where the
plugin is not installed. A broken op declaration is one line; the other plugins load."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from llm_fixtures import compiled
from plugin_fixtures import example_plugin, on_path, path_env, write_plugin
from xdsl.dialects.builtin import StringAttr

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.reference.interpreter import Interpreter
from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.simulate import simulate
from toptpu.backend.target.chips import get_chip
from toptpu.cli import main
from toptpu.dialects import plugin_ops
from toptpu.dialects.ir_text import parse_ir
from toptpu.dialects.weight_store import STORE_ATTR, WeightStore
from toptpu.machine_pipeline import compile_for_machine
from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass
from toptpu.passes.pipelines import run_passes
from toptpu.plugins import load_plugins

#: a plugin whose op, `top.cube`, has its kernel in the plugin's own module
CUBE = '''
from typing import ClassVar
import numpy as np
from xdsl.irdl import irdl_op_definition
from toptpu.backend.reference.kernels import f32, round_to
from toptpu.dialects import top
from toptpu.plugins import Plugin

def cube(x, *, out_dtype=None):
    """x ** 3 in f32, rounded to out_dtype."""
    return round_to(f32(x) * f32(x) * f32(x), np.dtype(out_dtype or x.dtype))

class CubeBase(top.UnaryOp):
    """x ** 3, elementwise."""
    KERNEL_MODULE: ClassVar[str] = __name__
    KERNEL: ClassVar[str] = "cube"
    FLOPS_PER_ELEMENT: ClassVar[int] = 2

@irdl_op_definition
class CubeOp(CubeBase, top.TopOp):
    name = "top.cube"

    def linalg_scalar(self, b, x):
        return b.mul(b.mul(x, x), x)

plugin = Plugin("cube", ops=(CubeOp,))
'''


def _unary_plugin(name: str, op_name: str, extra: str = "") -> str:
    """A plugin of one unary op named `op_name` whose kernel binding is toptpu's default
    (the kernel of its kind in toptpu's kernels.py), plus `extra` lines in its class."""
    return f'''
from xdsl.irdl import irdl_op_definition
from toptpu.dialects import top
from toptpu.plugins import Plugin

@irdl_op_definition
class AnOp(top.UnaryOp, top.TopOp):
    name = "{op_name}"
{extra}
plugin = Plugin("{name}", ops=(AnOp,))
'''


CUBE_IR = '''builtin.module {
  func.func @main(%x: tensor<2x8x16xf32>) -> tensor<2x8x16xf32> {
    %c = top.cube %x : tensor<2x8x16xf32> -> tensor<2x8x16xf32> loc("cubed")
    %y = top.add %c, %x : tensor<2x8x16xf32>, tensor<2x8x16xf32> -> tensor<2x8x16xf32>
    func.return %y : tensor<2x8x16xf32>
  }
}
'''


def _opt(argv: list[str], env: dict[str, str], stdin: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "toptpu-opt"),
                           *argv], capture_output=True, text=True, env=env, input=stdin,
                          timeout=300)


def _toptpu(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "toptpu"), *argv],
                          capture_output=True, text=True, env=env, timeout=600)


def test_a_plugin_op_runs_through_its_kernel_on_both_levels_and_the_machine(tmp_path) -> None:
    d = write_plugin(str(tmp_path), "cube_plugin", CUBE)
    with on_path(d):
        assert load_plugins().problems == ()
        (entry,) = plugin_ops.registered()
        assert (entry.top.name, entry.tpu.name, entry.plugin) == ("top.cube", "tpu.cube",
                                                                   "cube")
        assert entry.tpu.__module__ == "cube_plugin" and entry.tpu.KERNEL == "cube"
        store = WeightStore.from_arrays({})
        module = parse_ir(CUBE_IR, "cube.mlir")
        module.attributes[STORE_ATTR] = StringAttr(store.uri)
        x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
        (top_out,) = Interpreter(module, store).run([x]).outputs.values()
        np.testing.assert_array_equal(top_out, x * x * x + x)
        run_passes(module, [ConvertTopToTpuPass(mode="bf16")], store=store)
        assert [op.name for op in module.walk() if op.name.endswith("cube")] == ["tpu.cube"]
        (tpu_out,) = Interpreter(module, store).run([x]).outputs.values()
        assert tpu_out.dtype.name == "bfloat16"
        program = compile_for_machine(module, get_chip("bm1684x"))
        assert "tpu.cube" in program.ir  # a compute command of the plugin's op
        (machine_out,) = simulate(program, store, {"input0": x.astype(tpu_out.dtype)},
                                  get_chip("bm1684x")).outputs.values()
        assert machine_out.tobytes() == tpu_out.tobytes()
        assert np.abs(tpu_out.astype(np.float32) - top_out).max() <= \
            np.abs(top_out).max() * 2 ** -7
    # gone with the plugin: the IR no longer parses
    assert plugin_ops.registered() == ()
    with pytest.raises(Exception, match="top.cube is not registered"):
        parse_ir(CUBE_IR, "cube.mlir")


def test_a_broken_op_declaration_is_one_line_and_the_other_plugins_load(tmp_path) -> None:
    d = str(tmp_path)
    write_plugin(d, "cube_plugin", CUBE)
    write_plugin(d, "cube_again", CUBE.replace('Plugin("cube"', 'Plugin("cube-again"'))
    write_plugin(d, "no_kernel", _unary_plugin("no-kernel", "top.squash"))
    write_plugin(d, "clash_top", _unary_plugin("clash-top", "top.silu"))
    write_plugin(d, "clash_twin", _unary_plugin("clash-twin", "top.a16_matmul"))
    write_plugin(d, "no_infer", '''
from typing import ClassVar
from xdsl.irdl import irdl_op_definition, operand_def, result_def
from toptpu.dialects import top
from toptpu.dialects.common import AnyTensor
from toptpu.plugins import Plugin

@irdl_op_definition
class NoInferOp(top.TopOp):
    name = "top.no_infer"
    input = operand_def(AnyTensor)
    output = result_def(AnyTensor)
    KERNEL_MODULE: ClassVar[str] = "numpy"
    KERNEL: ClassVar[str] = "negative"

plugin = Plugin("no-infer", ops=(NoInferOp,))
''')
    write_plugin(d, "not_an_op", "from toptpu.plugins import Plugin\nclass FooOp:\n"
                 "    name = 'top.foo'\nplugin = Plugin('not-an-op', ops=(FooOp,))\n")
    with on_path(d):
        found = load_plugins()
        lines = [p.line() for p in found.problems]
        tail = "; the plugin is not loaded (its passes may need its ops)"
        assert lines == [
            "plugin 'clash_top' (toptpu.plugins: clash_top:plugin): the op 'top.silu' is not "
            "loaded: toptpu already has an op 'top.silu'" + tail,
            "plugin 'clash_twin' (toptpu.plugins: clash_twin:plugin): the op 'top.a16_matmul' "
            "is not loaded: toptpu already has an op 'tpu.a16_matmul'" + tail,
            "plugin 'cube_plugin' (toptpu.plugins: cube_plugin:plugin): the op 'top.cube' is "
            "not loaded: the plugin 'cube-again' (cube_again 0.1) already has an op "
            "'top.cube'" + tail,
            "plugin 'no_infer' (toptpu.plugins: no_infer:plugin): the op 'top.no_infer' is "
            "not loaded: it has no shape inference (a classmethod infer)" + tail,
            "plugin 'no_kernel' (toptpu.plugins: no_kernel:plugin): the op 'top.squash' is "
            "not loaded: it has no kernel: its KERNEL_MODULE "
            "'toptpu.backend.reference.kernels' defines no function 'squash' (set "
            "KERNEL_MODULE to the plugin's module of kernels and KERNEL to the function's "
            "name)" + tail,
            "plugin 'not_an_op' (toptpu.plugins: not_an_op:plugin): <class "
            "'not_an_op.FooOp'> is not an op class (an xDSL IRDLOperation)" + tail]
        # the first of the two cube plugins loaded, its op runs
        assert [e.plugin.name for e in found.loaded] == ["cube-again"]
        assert [(e.top.name, e.plugin) for e in plugin_ops.registered()] == [
            ("top.cube", "cube-again")]
    # toptpu-opt: one warning line each, the good plugin's op parses and prints
    ir = tmp_path / "cube.mlir"
    ir.write_text(CUBE_IR)
    res = _opt([str(ir), "-p", "canonicalize"], path_env(d))
    assert res.returncode == 0, res.stderr
    assert "%c = top.cube %x : tensor<2x8x16xf32> -> tensor<2x8x16xf32>" in res.stdout
    assert res.stderr.strip().splitlines() == [f"toptpu-opt: warning: {line}"
                                               for line in lines]


@pytest.mark.slow
def test_the_example_op_parses_prints_and_is_listed_in_toptpu_opt(
        tmp_path_factory: pytest.TempPathFactory, tmp_path) -> None:
    env = path_env(example_plugin(tmp_path_factory))
    res = _opt(["--help"], env)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert ("passes of the plugin 'example' (toptpu-plugin-example 0.1.0; entry point "
            "toptpu.plugins: example = toptpu_plugin_example:plugin) (-p "
            "'NAME{option=value ...}'): its ops: top.silu_mul (on the chip tpu.silu_mul)"
            in text)
    assert "fuse-silu-mul Fuse SwiGLU's silu(gate) * up into one top.silu_mul" in text
    generic = ('builtin.module {\n  func.func @f(%g: tensor<4x8xbf16>, %u: tensor<4x8xbf16>) '
               '-> tensor<4x8xbf16> {\n    %y = "top.silu_mul"(%g, %u) : (tensor<4x8xbf16>, '
               'tensor<4x8xbf16>) -> tensor<4x8xbf16>\n    func.return %y : tensor<4x8xbf16>\n'
               '  }\n}\n')
    custom = _opt(["-"], env, generic)
    assert custom.returncode == 0, custom.stderr
    assert ("%y = top.silu_mul %g, %u : tensor<4x8xbf16>, tensor<4x8xbf16> -> "
            "tensor<4x8xbf16>") in custom.stdout
    back = _opt(["-", "--print-op-generic"], env, custom.stdout)
    assert back.returncode == 0 and '"top.silu_mul"(%g, %u)' in back.stdout, back.stderr
    # real MLIR verifies it too: the IRDL export holds the plugin's ops
    ir = tmp_path / "silu_mul.mlir"
    ir.write_text(custom.stdout)
    res = subprocess.run([sys.executable, "-m", "toptpu.dialects.mlir_check", str(ir)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and f"{ir}: verifies in mlir-opt" in res.stdout, res.stderr
    # without the plugin the op is unknown, in one located error
    res = _opt(["-"], dict(os.environ), generic)
    assert res.returncode == 1 and "Operation top.silu_mul is not registered" in res.stderr


@pytest.mark.slow
def test_the_example_plugin_s_op_compiles_a_model_that_runs_as_the_default_compile(
        tmp_path_factory: pytest.TempPathFactory, tmp_path) -> None:
    """`--pass-after fuse=fuse-silu-mul` in f32: each block net computes its MLP with
    `tpu.silu_mul`, whose kernel computes what silu then mul computes in f32, so the model
    generates the same tokens with the same logits as the default compile on the machine
    and the interpreter; a process without the plugin refuses the file in one line."""
    target = example_plugin(tmp_path_factory)
    base = compiled(tmp_path_factory, "qwen2", seq=64, input_len=16)
    out = str(tmp_path / "fused.toptpu")
    with on_path(target):
        code = main(["compile", base.model_dir, "-o", out, "--seq-length", "64",
                     "--max-input-length", "16", "--pass-after", "fuse=fuse-silu-mul",
                     "--quiet"])
        assert code == 0
        b = LlmFile(out)
        for net in ("block", "block_cache", "block_kv"):
            ir = b.net_ir(net)
            assert ir.count('"tpu.silu_mul"') == 1 and '"tpu.silu"' not in ir, net
            assert "fuse,fuse-silu-mul,canonicalize" in (b.meta.nets[net].pipeline or "")
        assert '"tpu.silu_mul"' not in b.net_ir("lm_head")
        ops = b.meta.compile.plugin_ops or {}
        assert {n: (i.plugin, i.package) for n, i in ops.items()} == {
            "tpu.silu_mul": ("example", "toptpu-plugin-example 0.1.0")}
        b.file.close()
        ids = Runtime.open(base.model_file).encode("Hello world! The tensor processor")
        for executor in ("machine", "interpreter"):
            ra, rb = Runtime.open(base.model_file, executor), Runtime.open(out, executor)
            assert ra.generate(ids, 8).generated_ids == rb.generate(ids, 8).generated_ids
            la, lb = ra.sequence_logits(ids), rb.sequence_logits(ids)
            assert la.tobytes() == lb.tobytes(), executor  # f32: the same arithmetic
    # another process, the plugin installed: the runtime loads the plugin's op itself
    res = _toptpu(["run", out, "--prompt", "Hello world", "--max-new-tokens", "4"],
                  path_env(target))
    assert res.returncode == 0, res.stderr
    # not installed: refused in one line naming the op and its plugin; info still describes
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    for argv in (["run", out, "--prompt", "Hello", "--max-new-tokens", "2"],
                 ["profile", out]):
        res = _toptpu(argv, env)
        assert res.returncode == 1
        assert res.stderr == (
            f"toptpu {argv[0]}: error: '{out}' uses the op 'tpu.silu_mul' of the plugin "
            "'example' (toptpu-plugin-example 0.1.0), which is not installed: install that "
            "plugin (its package toptpu-plugin-example) to run it\n")
    res = _toptpu(["info", out], env)
    assert res.returncode == 0 and ("plugin op: tpu.silu_mul of the plugin 'example' "
                                    "(toptpu-plugin-example 0.1.0)") in res.stdout
