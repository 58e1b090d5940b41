"""Plugins (`toptpu.plugins`, the entry-point group `toptpu.plugins`): the repository's
example plugin really installed (pip, into a directory of its own) adds `expand-silu` to
toptpu-opt (listed by --help with its option; its FileCheck test) and to the compile's
pipeline; a plugin that is broken in any way is one line and breaks nothing else; a pass
that breaks the net contract is refused naming the net and the input or output."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from llm_fixtures import compiled, tiny_dir
from plugin_fixtures import EXAMPLE, example_plugin, on_path, path_env, write_plugin

from toptpu.backend.formats.llm_file import LlmFile
from toptpu.backend.runtime.runtime import Runtime
from toptpu.cli import main
from toptpu.plugins import ENTRY_POINT_GROUP, load_plugins

LIT = "import sys; from lit.main import main; sys.exit(main())"

#: a plugin with a pass that renames the net's first output (a broken pass)
RENAMING = '''
from dataclasses import dataclass
from xdsl.dialects import func
from xdsl.dialects.builtin import StringAttr
from xdsl.passes import ModulePass
from toptpu.plugins import Plugin

@dataclass(frozen=True)
class RenameOutput(ModulePass):
    """Rename the first output of every function to `renamed`."""
    name = "rename-output"
    def apply(self, ctx, op):
        for fn in op.walk():
            if isinstance(fn, func.FuncOp) and fn.res_attrs is not None:
                attrs = list(fn.res_attrs.data)
                first = dict(attrs[0].data)
                first["top.name"] = StringAttr("renamed")
                from xdsl.dialects.builtin import DictionaryAttr, ArrayAttr
                attrs[0] = DictionaryAttr(first)
                fn.res_attrs = ArrayAttr(attrs)

plugin = Plugin("renaming", passes=(RenameOutput,))
'''


def _opt(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "toptpu-opt"),
                           *argv], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_the_example_plugin_installed_lists_its_pass_and_passes_its_filecheck_test(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    target = example_plugin(tmp_path_factory)
    env = path_env(target)
    res = _opt(["--help"], env)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert ("passes of the plugin 'example' (toptpu-plugin-example 0.1.0; entry point "
            f"{ENTRY_POINT_GROUP}: example = toptpu_plugin_example:plugin)") in text
    assert ("expand-silu Rewrite every top.silu into x * sigmoid(x) (form=tanh: through "
            "tanh). form: a string (default sigmoid)") in text
    assert "not loaded" not in text
    # its FileCheck test, run by lit with the plugin installed
    lit = subprocess.run([sys.executable, "-c", LIT, "-v", os.path.join(EXAMPLE, "tests")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert lit.returncode == 0 and "PASS: toptpu-plugin-example :: expand_silu.mlir" in \
        lit.stdout, lit.stdout[-4000:]
    assert "PASS: toptpu-plugin-example :: fuse_silu_mul.mlir" in lit.stdout
    # not installed: the pass is unknown, nothing else changes
    res = _opt(["--help"], dict(os.environ))
    assert "expand-silu" not in res.stdout


def test_a_broken_plugin_is_one_line_and_breaks_nothing_else(tmp_path) -> None:
    d = str(tmp_path)
    write_plugin(d, "broken_import", "import no_such_module_anywhere\n")
    write_plugin(d, "not_a_plugin", "plugin = 42\n")
    write_plugin(d, "with_ops", "from toptpu.plugins import Plugin\nclass FooOp:\n"
                 "    name = 'top.foo'\nplugin = Plugin('ops', ops=(FooOp,))\n")
    write_plugin(d, "clashing", "from dataclasses import dataclass\n"
                 "from xdsl.passes import ModulePass\nfrom toptpu.plugins import Plugin\n"
                 "@dataclass(frozen=True)\nclass Fuse(ModulePass):\n    name = 'fuse'\n"
                 "    def apply(self, ctx, op): pass\n"
                 "@dataclass(frozen=True)\nclass Good(ModulePass):\n    '''Do nothing.'''\n"
                 "    name = 'good-pass'\n    def apply(self, ctx, op): pass\n"
                 "plugin = lambda: Plugin('clashing', passes=(Fuse, Good, int))\n")
    with on_path(d):
        found = load_plugins()
        lines = [p.line() for p in found.problems]
        assert lines == [
            "plugin 'broken_import' (toptpu.plugins: broken_import:plugin): failed to load: "
            "ModuleNotFoundError: No module named 'no_such_module_anywhere'",
            "plugin 'clashing' (toptpu.plugins: clashing:plugin): the pass 'fuse' is not "
            "loaded: toptpu already has a pass of that name",
            "plugin 'clashing' (toptpu.plugins: clashing:plugin): <class 'int'> is not a "
            "pass (an xDSL ModulePass class)",
            "plugin 'not_a_plugin' (toptpu.plugins: not_a_plugin:plugin): failed to load: "
            "TypeError: the entry point's object is int, not a toptpu.plugins.Plugin (or a "
            "function returning one)",
            "plugin 'with_ops' (toptpu.plugins: with_ops:plugin): <class 'with_ops.FooOp'> "
            "is not an op class (an xDSL IRDLOperation); the plugin is not loaded (its "
            "passes may need its ops)"]  # broken ops: tests/test_plugin_ops.py
        assert sorted(found.passes) == ["good-pass"]  # the clashing plugin's good pass
    env = path_env(d)
    ir = tmp_path / "x.mlir"
    ir.write_text('builtin.module {\n  func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n'
                  '    %y = "top.silu"(%x) : (tensor<2xf32>) -> tensor<2xf32>\n'
                  '    func.return %y : tensor<2xf32>\n  }\n}\n')
    res = _opt([str(ir), "-p", "canonicalize,good-pass"], env)  # the others still run
    assert res.returncode == 0 and "top.silu" in res.stdout, res.stderr
    warnings = res.stderr.strip().splitlines()
    assert warnings == [f"toptpu-opt: warning: {line}" for line in lines], res.stderr
    assert "Traceback" not in res.stderr
    res = _opt(["--help"], env)
    assert res.returncode == 0 and "not loaded: plugin 'broken_import'" in res.stdout
    # an unknown pass names the plugins that failed, in the one line
    res = _opt([str(ir), "-p", "expand-silu"], env)
    assert res.returncode == 1 and "unknown pass 'expand-silu'" in res.stderr
    assert "failed to load: ModuleNotFoundError" in res.stderr.splitlines()[-1]
    # another command does not load plugins at all
    res = subprocess.run([os.path.join(os.path.dirname(sys.executable), "toptpu"), "info",
                          str(ir)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1 and res.stderr.startswith("toptpu info: error: ")
    assert "toptpu.plugins" not in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_plugin_pass_in_the_compile_pipeline_changes_only_what_it_rewrites(
        tmp_path_factory: pytest.TempPathFactory, tmp_path) -> None:
    """`--pass-after fuse=expand-silu`: the nets with a silu compile with sigmoid and mul
    instead, the passes are recorded per net, and the model generates; its block's hidden
    states are those of the default compile to f32 rounding."""
    target = example_plugin(tmp_path_factory)
    base = compiled(tmp_path_factory, "qwen2", seq=64, input_len=16)
    out = str(tmp_path / "silu.toptpu")
    with on_path(target):
        code = main(["compile", base.model_dir, "-o", out, "--seq-length", "64",
                    "--max-input-length", "16", "--pass-after", "fuse=expand-silu",
                    "--quiet"])
    assert code == 0
    a, b = LlmFile(base.model_file), LlmFile(out)
    differ = sorted(s for s in a.file.sections if a.file.read(s) != b.file.read(s))
    assert differ == [f"{kind}:{net}" for kind in ("ir", "stream")
                      for net in ("block", "block_cache", "block_kv")]
    for net in ("block", "block_cache", "block_kv"):
        ir = b.net_ir(net)
        assert "tpu.silu" not in ir and ir.count("tpu.sigmoid") == 1
        assert "fuse,expand-silu,canonicalize" in b.meta.nets[net].pipeline
        assert "expand-silu" not in (a.meta.nets[net].pipeline or "")
    assert b.meta.compile.pipeline == "--pass-after 'fuse=expand-silu'"
    assert a.meta.compile.pipeline == "default"
    # the same function, computed another way: tokens and block outputs agree
    ra, rb = Runtime.open(base.model_file), Runtime.open(out)
    ids = ra.encode("Hello world! The tensor processor")
    assert ra.generate(ids, 8).generated_ids == rb.generate(ids, 8).generated_ids
    la, lb = ra.sequence_logits(ids), rb.sequence_logits(ids)
    assert np.abs(la - lb).max() < 1e-4 and not np.array_equal(la, lb)


@pytest.mark.slow
def test_a_pass_that_breaks_the_net_contract_is_refused_naming_net_and_output(
        tmp_path_factory: pytest.TempPathFactory, tmp_path, capsys) -> None:
    d = write_plugin(str(tmp_path / "plug"), "renaming", RENAMING)
    model = tiny_dir(tmp_path_factory, "qwen2")
    out = tmp_path / "m.toptpu"
    with on_path(d):
        code = main(["compile", model, "-o", str(out), "--seq-length", "64",
                    "--max-input-length", "16", "--pass-after", "fuse=rename-output",
                    "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert err == ("toptpu compile: error: net 'block': the pass 'rename-output' breaks "
                   "the net contract: it renamed output 'hidden_out' to 'renamed' (the runtime "
                   "binds each net's inputs and outputs by name, shape and type: "
                   "backend/contract.py)\n")
