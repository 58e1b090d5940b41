"""torch.export (FX) importer: `nn.Module` -> Top IR + weight store.

A table of builders, one per aten op (`ATEN_BUILDERS`), each mapping its op onto Top ops.
torch-mlir's FX importer works differently: it imports every aten op generically from its
op schema into a `torch.aten.*` op and leaves the mapping to later conversion passes; Top
is a smaller, framework-independent dialect, so the mapping happens here, op by op.
Parameters and buffers become `top.weight` ops naming tensors of a weight store; user
inputs become function arguments. Subgraphs that depend on no input and no weight
(aten.arange, aten.full, ...) are evaluated by torch at import time and become small
`top.constant`s. Any other aten op stops the import with `UnsupportedOpError`, naming the
op and the model source line it came from.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ModuleOp,
    TensorType,
)
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue
from xdsl.utils.exceptions import VerifyException

from toptpu.dialects import top
from toptpu.dialects.common import (
    ComparePredicate,
    GeluApproximation,
    ReduceMode,
    dtype_from_name,
    element_type_of_numpy,
    numpy_dtype,
    shape_of,
    tensor,
)
from toptpu.dialects.naming import make_loc, name_dicts
from toptpu.dialects.weight_store import WeightStore, _torch_to_numpy, attach_store
from toptpu.errors import ToptpuError
from toptpu.frontends import (  # noqa: F401 - moe_ops registers torch.ops.toptpu
    linear_attention_ops,  # noqa: F401 - registers torch.ops.toptpu
    moe,
    moe_ops,
)

aten = torch.ops.aten

#: constants larger than this many elements go to the weight store, not the IR
MAX_INLINE_CONSTANT = 1024


class ImportError_(ToptpuError):
    """Base class of import errors (named so it does not shadow the builtin)."""


class UnsupportedOpError(ImportError_):
    pass


TORCH_TO_ELEM = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "ui8",
    torch.bool: "i1",
}


def elem_of_torch(dtype: torch.dtype) -> Attribute:
    if dtype not in TORCH_TO_ELEM:
        raise ImportError_(f"tensors of dtype {dtype} are not supported")
    return dtype_from_name(TORCH_TO_ELEM[dtype])


def source_line(node: torch.fx.Node) -> tuple[str | None, int, str]:
    """(file, line, code) of the innermost model frame that produced `node`."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return None, 0, ""
    model_frames = [f for f in frames if "/torch/" not in f[0]] or frames
    file, line, code = model_frames[-1]
    return file, int(line), code.strip()


def _import_roots() -> list[tuple[str, str]]:
    """(directory, prefix) of the roots source files are imported from, longest first:
    every `sys.path` entry (site-packages, the working directory), and toptpu's package
    directory, named 'toptpu/' (a venv inside the checkout is a longer root than it)."""
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # toptpu's
    roots = {os.path.abspath(p): "" for p in sys.path if p}
    roots[package_dir] = "toptpu/"
    return sorted(roots.items(), key=lambda r: len(r[0]), reverse=True)


def _import_name_path(path: str) -> str | None:
    """The path of the loaded module whose file is `path`, from its import name
    ('transformers.models.qwen2.modeling_qwen2' -> 'transformers/models/qwen2/
    modeling_qwen2.py'); None when no loaded module has that file."""
    real = os.path.realpath(path)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or name.startswith("__"):
            continue
        if os.path.realpath(file) != real:
            continue
        base = os.path.basename(file)
        stem, ext = os.path.splitext(base)
        parts = name.split(".")
        if stem == "__init__":
            return "/".join(parts) + "/" + base
        if stem == parts[-1]:
            return "/".join(parts) + ext
    return None


@functools.lru_cache(maxsize=256)
def portable_path(file: str) -> str:
    """`file` as its import name's path ('transformers/models/qwen2/modeling_qwen2.py'):
    named by the module it imports as (`sys.modules`), else relative to the import root it
    lies under, so the IR's locations, and the model file's bytes, do not depend on where
    Python, the packages, the venv or the checkout are. This package's own files are named
    under 'toptpu/'. A file under no import root is kept."""
    named = _import_name_path(file)
    if named is not None:
        return named
    path = os.path.abspath(file)
    for root, prefix in _import_roots():
        if path.startswith(root + os.sep):
            return prefix + os.path.relpath(path, root).replace(os.sep, "/")
    return file


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path)


def tensor_name(node: torch.fx.Node, suffix: str = "") -> str:
    """The location name of the Top op built for `node`: module path + FX node name."""
    path = _module_path(node)
    base = f"{path}.{node.name}" if path else node.name
    return f"{base}.{suffix}" if suffix else base


@dataclass
class Importer:
    """State of one import; builders call `emit` to append ops to the function."""

    store: WeightStore
    weight_prefix: str = ""
    block: Block = field(default_factory=Block)
    env: dict[torch.fx.Node, Any] = field(default_factory=dict)
    node: torch.fx.Node | None = None
    _loc_counter: int = 0

    # ------------------------------------------------------------------ helpers for builders
    def loc_name(self, suffix: str = "") -> str:
        assert self.node is not None
        return tensor_name(self.node, suffix)

    def emit(self, op: Operation, suffix: str = "") -> Operation:
        assert self.node is not None
        file, line, _ = source_line(self.node)
        op.location = make_loc(self.loc_name(suffix), file and portable_path(file), line)
        for r in op.results:
            r.name_hint = _sanitize(self.node.name if not suffix else f"{self.node.name}_{suffix}")
        self.block.add_op(op)
        return op

    def value(self, arg: Any) -> SSAValue:
        v = self.env[arg] if isinstance(arg, torch.fx.Node) else arg
        if isinstance(v, ConstValue):
            return self.materialize(v)
        if not isinstance(v, SSAValue):
            raise ImportError_(f"expected a tensor for argument {arg!r}, got {type(v).__name__}")
        return v

    def is_const(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and isinstance(self.env.get(arg), ConstValue)

    def materialize(self, c: ConstValue) -> SSAValue:
        if c.ssa is None:
            arr = c.array
            op: Operation
            if arr.size <= MAX_INLINE_CONSTANT:
                op = top.ConstantOp(arr)
            else:
                name = self.store.unique_name(f"{self.weight_prefix}const.{c.name}")
                self.store[name] = arr
                op = top.WeightOp(name, tensor(arr.shape, element_type_of_numpy(arr.dtype)))
            self.emit(op, "const")
            c.ssa = op.results[0]
        return c.ssa

    def out_type(self, i: int | None = None) -> TensorType:
        assert self.node is not None
        val = self.node.meta["val"]
        if i is not None:
            val = val[i]
        return tensor(tuple(int(d) for d in val.shape), elem_of_torch(val.dtype))

    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.out_type().get_shape())

    def cast_to(self, v: SSAValue, elem: Attribute, suffix: str = "cast") -> SSAValue:
        t = v.type
        assert isinstance(t, TensorType)
        if t.element_type == elem:
            return v
        op = top.CastOp(v, elem)
        return self.emit(op, suffix).results[0]

    def reshape(self, v: SSAValue, shape: Sequence[int], suffix: str = "reshape") -> SSAValue:
        if shape_of(v) == tuple(shape):
            return v
        return self.emit(top.ReshapeOp(v, shape), suffix).results[0]

    def permute(self, v: SSAValue, order: Sequence[int], suffix: str = "permute") -> SSAValue:
        if list(order) == list(range(len(order))):
            return v
        return self.emit(top.PermuteOp(v, order), suffix).results[0]


@dataclass
class ConstValue:
    """A value known at import time (no input or weight feeds it)."""

    array: np.ndarray
    name: str
    ssa: SSAValue | None = None


def _sanitize(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return s if re.match(r"[A-Za-z_]", s) else f"v{s}"


# =========================================================================== builders

#: what a builder gives for its node: the node's value, the values of its tuple result, or
#: None (a node with no value: an assert)
Built: TypeAlias = "SSAValue | tuple[SSAValue, ...] | None"
Builder = Callable[[Importer, torch.fx.Node], Built]
#: aten op overload (or Python operator) -> its builder
ATEN_BUILDERS: dict[object, Builder] = {}


def builds(*targets: object) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        for t in targets:
            ATEN_BUILDERS[t] = fn
        return fn

    return deco


def _arg(node: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _int_arg(node: torch.fx.Node, i: int) -> int:
    """Positional argument `i` of `node`, an `int` of its aten schema."""
    a = node.args[i]
    assert isinstance(a, int), f"{node.target}: argument {i} is {a!r}, not an int"
    return a


def _list_arg(node: torch.fx.Node, i: int) -> list[Any]:
    """Positional argument `i` of `node`, a list (`int[]`, `Tensor[]`) of its aten schema."""
    a = node.args[i]
    assert isinstance(a, list | tuple), f"{node.target}: argument {i} is {a!r}, not a list"
    return list(a)


@builds(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
        aten.sym_constrain_range_for_size.default)
def _skip(im: Importer, node: torch.fx.Node) -> Built:
    return None


@builds(aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
        aten.dropout.default, aten.lift_fresh_copy.default, aten.to.device,
        aten.feature_dropout.default)
def _identity(im: Importer, node: torch.fx.Node) -> Built:
    x = node.args[0]
    assert isinstance(x, torch.fx.Node), f"{node.target}: argument 0 is {x!r}, not a tensor"
    return im.env[x]


@builds(aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default)
def _to(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    return im.cast_to(x, im.out_type().element_type, "")


def _elementwise_operands(im: Importer, node: torch.fx.Node, args: Sequence[Any]) -> list[SSAValue]:
    elem = im.out_type().element_type
    return [im.cast_to(im.value(a), elem, f"cast{i}") for i, a in enumerate(args)]


def _schema_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by their names in its aten op's schema, defaults filled in."""
    values: dict[str, Any] = {}
    # the ignore below: an aten op overload's target (not a str)
    for i, arg in enumerate(node.target._schema.arguments):  # type: ignore[union-attr]
        if i < len(node.args) and not arg.kwarg_only:
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    return values


def builds_from_schema(op: Callable[..., Operation], *targets: Any,
                       renamed: Mapping[str, str] | None = None,
                       fixed: Mapping[str, object] | None = None) -> None:
    """Import each aten op of `targets` as `op`, read from its schema: its tensor arguments
    are the op's operands (in order, cast to the result's element type: an elementwise op),
    its other arguments the keywords of the op's constructor of the same names (`renamed`:
    schema name -> keyword), `fixed` keywords the aten op has no argument for (relu6's
    bounds). A schema that does not fit the constructor fails here, when the module is
    imported; a value the op refuses (a computed number, a NaN bound) is an
    `UnsupportedOpError` naming the aten op and the op's reason."""
    renamed, fixed = dict(renamed or {}), dict(fixed or {})
    accepted = set(inspect.signature(op).parameters)
    for target in targets:
        for arg in target._schema.arguments:
            if isinstance(arg.type, torch.TensorType):
                continue
            if isinstance(arg.type, torch.OptionalType):
                kind = arg.type.getElementType()
            else:
                kind = arg.type
            keyword = renamed.get(arg.name, arg.name)
            if not isinstance(kind, torch.NumberType | torch.FloatType | torch.IntType
                              | torch.BoolType | torch.StringType):
                raise TypeError(f"builds_from_schema: {target} argument {arg.name} is a "
                                f"{arg.type}; write a builder for it")
            if keyword not in accepted:
                raise TypeError(f"builds_from_schema: {target} argument {arg.name} is no "
                                f"keyword of {getattr(op, '__name__', op)}")
    for target in targets:
        ATEN_BUILDERS[target] = functools.partial(_build_from_schema, op, renamed, fixed)


def _build_from_schema(op: Callable[..., Operation], renamed: Mapping[str, str],
                       fixed: Mapping[str, object], im: Importer, node: torch.fx.Node) -> Built:
    values = _schema_arguments(node)
    tensors: list[Any] = []
    params: dict[str, object] = dict(fixed)
    # the ignore below: an aten op overload's target (not a str)
    for arg in node.target._schema.arguments:  # type: ignore[union-attr]
        value = values.get(arg.name)
        if isinstance(arg.type, torch.TensorType):
            tensors.append(value)
        elif isinstance(value, torch.fx.Node):
            raise UnsupportedOpError(f"{arg.name} is computed ({value.name}); give a number")
        else:
            params[renamed.get(arg.name, arg.name)] = value
    operands = _elementwise_operands(im, node, tensors)
    try:
        built = op(*operands, **params)
    except (VerifyException, TypeError, ValueError) as e:
        raise UnsupportedOpError(str(e)) from None
    return im.emit(built).results[0]


def _scalar(a: Any) -> float | None:
    if isinstance(a, bool):
        return float(a)
    if isinstance(a, int | float):
        return float(a)
    return None


def _binary(kind: str, tensor_op: type[top.BinaryOp], const_op: type[top.ConstBinaryOp]) -> Builder:
    def build(im: Importer, node: torch.fx.Node) -> Built:
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            if _scalar(b) is not None:
                b = _scalar(b) * alpha  # type: ignore[operator]  # a number, checked above
            else:
                raise UnsupportedOpError(f"aten.{kind} with alpha={alpha}")
        sa, sb = _scalar(a), _scalar(b)
        if sb is not None:
            (x,) = _elementwise_operands(im, node, [a])
            return im.emit(const_op(x, sb)).results[0]
        if sa is not None:
            (x,) = _elementwise_operands(im, node, [b])
            if kind in ("add", "mul"):
                return im.emit(const_op(x, sa)).results[0]
            return im.emit(const_op(x, sa, reverse=True)).results[0]
        x, y = _elementwise_operands(im, node, [a, b])
        return im.emit(tensor_op(x, y)).results[0]

    return build


for _kind, _top, _const in (
    ("add", top.AddOp, top.AddConstOp),
    ("sub", top.SubOp, top.SubConstOp),
    ("mul", top.MulOp, top.MulConstOp),
    ("div", top.DivOp, top.DivConstOp),
):
    _b = _binary(_kind, _top, _const)
    for _suffix in ("Tensor", "Scalar"):
        ATEN_BUILDERS[getattr(getattr(aten, _kind), _suffix)] = _b


@builds(aten.rsub.Scalar)
def _rsub(im: Importer, node: torch.fx.Node) -> Built:
    (x,) = _elementwise_operands(im, node, [node.args[0]])
    c = _scalar(node.args[1])
    assert c is not None
    return im.emit(top.SubConstOp(x, c, reverse=True)).results[0]


@builds(aten.neg.default)
def _neg(im: Importer, node: torch.fx.Node) -> Built:
    (x,) = _elementwise_operands(im, node, [node.args[0]])
    return im.emit(top.MulConstOp(x, -1.0)).results[0]


@builds(aten.maximum.default, aten.minimum.default)
def _maxmin(im: Importer, node: torch.fx.Node) -> Built:
    x, y = _elementwise_operands(im, node, node.args[:2])
    cls = top.MaxOp if node.target == aten.maximum.default else top.MinOp
    return im.emit(cls(x, y)).results[0]


_UNARY: dict[Any, type[top.UnaryOp]] = {
    aten.rsqrt.default: top.RsqrtOp,
    aten.sqrt.default: top.SqrtOp,
    aten.exp.default: top.ExpOp,
    aten.cos.default: top.CosOp,
    aten.sin.default: top.SinOp,
    aten.tanh.default: top.TanhOp,
    aten.sigmoid.default: top.SigmoidOp,
    aten.silu.default: top.SiluOp,
    aten.relu.default: top.ReluOp,
}


@builds(*_UNARY)
def _unary(im: Importer, node: torch.fx.Node) -> Built:
    (x,) = _elementwise_operands(im, node, [node.args[0]])
    return im.emit(_UNARY[node.target](x)).results[0]


@builds(aten.softplus.default)
def _softplus(im: Importer, node: torch.fx.Node) -> Built:
    """F.softplus with torch's defaults (beta 1, threshold 20), the ones `top.softplus`
    computes; other parameters are refused."""
    beta, threshold = _arg(node, 1, "beta", 1.0), _arg(node, 2, "threshold", 20.0)
    if beta != 1 or threshold != 20:
        raise UnsupportedOpError(f"aten.softplus with beta={beta}, threshold={threshold} "
                                 "(top.softplus is beta=1, threshold=20)")
    (x,) = _elementwise_operands(im, node, [node.args[0]])
    return im.emit(top.SoftplusOp(x)).results[0]


@builds(aten.gelu.default)
def _gelu(im: Importer, node: torch.fx.Node) -> Built:
    (x,) = _elementwise_operands(im, node, [node.args[0]])
    try:
        approx = GeluApproximation.parse(str(node.kwargs.get("approximate", "none")))
    except ValueError as e:
        raise UnsupportedOpError(f"aten.gelu: {e}") from None
    return im.emit(top.GeluOp(x, approx)).results[0]


builds_from_schema(top.PowOp, aten.pow.Tensor_Scalar)
builds_from_schema(top.ClampOp, aten.clamp.default, aten.clip.default, aten.clamp_min.default,
                   aten.clamp_max.default)
builds_from_schema(top.ClampOp, aten.hardtanh.default, renamed={"min_val": "min", "max_val": "max"})
builds_from_schema(top.ClampOp, aten.relu6.default, fixed={"min": 0.0, "max": 6.0})


def _compare(pred: ComparePredicate) -> Builder:
    def build(im: Importer, node: torch.fx.Node) -> Built:
        a, b = node.args[0], node.args[1]
        x = im.value(a)
        if _scalar(b) is not None:
            arr = np.array(_scalar(b)).astype(
                np.float32 if "f" in str(x.type) else np.int64
            )

            t = x.type
            assert isinstance(t, TensorType)
            c = im.emit(top.ConstantOp(arr.astype(numpy_dtype(t.element_type)).reshape(())),
                        "rhs")
            y: SSAValue = c.results[0]
        else:
            y = im.value(b)
        return im.emit(top.CompareOp(x, y, pred)).results[0]

    return build


for _p in ComparePredicate:  # aten.eq, aten.ne, ... are named like the predicates
    for _suffix in ("Tensor", "Scalar"):
        ATEN_BUILDERS[getattr(getattr(aten, _p.value), _suffix)] = _compare(_p)


@builds(aten.where.self)
def _where(im: Importer, node: torch.fx.Node) -> Built:
    c = im.value(node.args[0])
    x, y = _elementwise_operands(im, node, node.args[1:3])
    return im.emit(top.WhereOp(c, x, y)).results[0]


@builds(aten.masked_fill.Scalar)
def _masked_fill(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    m = im.value(node.args[1])
    v = _scalar(node.args[2])
    assert v is not None

    t = x.type
    assert isinstance(t, TensorType)
    c = im.emit(top.ConstantOp(np.array(v).astype(numpy_dtype(t.element_type)).reshape(())),
                "fill")
    return im.emit(top.WhereOp(m, c.results[0], x)).results[0]


@builds(aten.linear.default)
def _linear(im: Importer, node: torch.fx.Node) -> Built:
    x, w = im.value(node.args[0]), im.value(node.args[1])
    b = im.value(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    op = top.MatMulOp(x, w, b, transpose_b=True)
    return im.emit(op).results[0]


@builds(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(im: Importer, node: torch.fx.Node) -> Built:
    a, b = im.value(node.args[0]), im.value(node.args[1])
    if len(shape_of(a)) == 1 or len(shape_of(b)) == 1:
        raise UnsupportedOpError("matmul with a rank-1 operand")
    return im.emit(top.MatMulOp(a, b)).results[0]


@builds(aten.addmm.default)
def _addmm(im: Importer, node: torch.fx.Node) -> Built:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError("aten.addmm with beta/alpha != 1")
    bias, a, b = (im.value(x) for x in node.args[:3])
    if len(shape_of(bias)) != 1:
        mm = im.emit(top.MatMulOp(a, b), "mm").results[0]
        return im.emit(top.AddOp(mm, bias)).results[0]
    return im.emit(top.MatMulOp(a, b, bias)).results[0]


@builds(aten.t.default)
def _t(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    if len(shape_of(x)) < 2:
        return x
    return im.permute(x, [1, 0], "")


@builds(aten.transpose.int)
def _transpose(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    r = len(shape_of(x))
    d0, d1 = _int_arg(node, 1) % r, _int_arg(node, 2) % r
    order = list(range(r))
    order[d0], order[d1] = order[d1], order[d0]
    return im.permute(x, order, "")


@builds(aten.permute.default)
def _permute(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    r = len(shape_of(x))
    return im.permute(x, [d % r for d in _list_arg(node, 1)], "")


@builds(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
        aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
        aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default)
def _reshape(im: Importer, node: torch.fx.Node) -> Built:
    return im.reshape(im.value(node.args[0]), im.out_shape(), "")


@builds(aten.expand.default, aten.expand_as.default)
def _expand(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = im.out_shape()
    if shape_of(x) == shape:
        return x
    return im.emit(top.ExpandOp(x, shape)).results[0]


@builds(aten.cat.default, aten.concat.default)
def _cat(im: Importer, node: torch.fx.Node) -> Built:
    xs = _elementwise_operands(im, node, _list_arg(node, 0))
    xs = [x for x in xs if 0 not in shape_of(x)]
    dim = _arg(node, 1, "dim", 0)
    if len(xs) == 1:
        return xs[0]
    return im.emit(top.ConcatOp(xs, dim % len(shape_of(xs[0])))).results[0]


def _norm_slice(size: int, start: Any, end: Any, step: Any) -> tuple[int, int, int]:
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    step = 1 if step is None else int(step)
    if start < 0:
        start += size
    if end < 0:
        end += size
    # torch slicing semantics: bounds beyond the axis mean "to the edge"
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def _slice_value(im: Importer, x: SSAValue, dim: int, start: int, end: int, step: int,
                 suffix: str = "") -> SSAValue:
    shape = shape_of(x)
    if start == 0 and end == shape[dim] and step == 1:
        return x
    return im.emit(top.SliceOp(x, dim, start, end, step), suffix).results[0]


@builds(aten.slice.Tensor)
def _slice(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = shape_of(x)
    dim = _arg(node, 1, "dim", 0) % len(shape)
    s, e, st = _norm_slice(shape[dim], _arg(node, 2, "start"), _arg(node, 3, "end"),
                           _arg(node, 4, "step", 1))
    return _slice_value(im, x, dim, s, e, st)


@builds(aten.select.int)
def _select(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = shape_of(x)
    dim = _int_arg(node, 1) % len(shape)
    idx = _int_arg(node, 2) % shape[dim]
    y = _slice_value(im, x, dim, idx, idx + 1, 1, "slice")
    return im.reshape(y, im.out_shape(), "")


def _split_sizes(size: int, split: Any) -> list[int]:
    if isinstance(split, int):
        return [min(split, size - i) for i in range(0, size, split)]
    return [int(s) for s in split]


@builds(aten.split.Tensor, aten.split_with_sizes.default, aten.split.sizes)
def _split(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = shape_of(x)
    dim = _arg(node, 2, "dim", 0) % len(shape)
    outs, start = [], 0
    for i, n in enumerate(_split_sizes(shape[dim], node.args[1])):
        outs.append(_slice_value(im, x, dim, start, start + n, 1, f"part{i}"))
        start += n
    return tuple(outs)


@builds(aten.chunk.default)
def _chunk(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = shape_of(x)
    dim = _arg(node, 2, "dim", 0) % len(shape)
    per = math.ceil(shape[dim] / node.args[1])
    outs, start = [], 0
    for i, n in enumerate(_split_sizes(shape[dim], per)):
        outs.append(_slice_value(im, x, dim, start, start + n, 1, f"part{i}"))
        start += n
    return tuple(outs)


@builds(aten.unbind.int)
def _unbind(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    shape = shape_of(x)
    dim = _arg(node, 1, "dim", 0) % len(shape)
    rest = [d for i, d in enumerate(shape) if i != dim]
    return tuple(
        im.reshape(_slice_value(im, x, dim, i, i + 1, 1, f"part{i}"), rest, f"part{i}.reshape")
        for i in range(shape[dim])
    )


def _reduce(mode: ReduceMode) -> Builder:
    def build(im: Importer, node: torch.fx.Node) -> Built:
        x = im.value(node.args[0])
        r = len(shape_of(x))
        dims = _arg(node, 1, "dim", None)
        if dims is None or dims == []:
            dims = list(range(r))
        elif isinstance(dims, int):
            dims = [dims]
        keep = bool(_arg(node, 2, "keepdim", False))
        x = im.cast_to(x, im.out_type().element_type)
        return im.emit(top.ReduceOp(x, mode, [d % r for d in dims], keep)).results[0]

    return build


ATEN_BUILDERS[aten.mean.dim] = _reduce(ReduceMode.MEAN)
ATEN_BUILDERS[aten.sum.dim_IntList] = _reduce(ReduceMode.SUM)
ATEN_BUILDERS[aten.amax.default] = _reduce(ReduceMode.MAX)
ATEN_BUILDERS[aten.amin.default] = _reduce(ReduceMode.MIN)


@builds(aten.mean.default, aten.sum.default)
def _reduce_all(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    mode = ReduceMode.MEAN if node.target == aten.mean.default else ReduceMode.SUM
    return im.emit(top.ReduceOp(x, mode, range(len(shape_of(x))), False)).results[0]


@builds(aten.softmax.int, aten._softmax.default)
def _softmax(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    x = im.cast_to(x, im.out_type().element_type)
    dim = _int_arg(node, 1) % len(shape_of(x))
    return im.emit(top.SoftmaxOp(x, dim)).results[0]


@builds(aten.layer_norm.default)
def _layer_norm(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    nshape = _list_arg(node, 1)
    w = _arg(node, 2, "weight")
    b = _arg(node, 3, "bias")
    eps = _arg(node, 4, "eps", 1e-5)
    op = top.LayerNormOp(x, im.value(w) if w is not None else None,
                         im.value(b) if b is not None else None,
                         eps=eps, axis=len(shape_of(x)) - len(nshape))
    return im.emit(op).results[0]


@builds(aten.rms_norm.default)
def _rms_norm(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    if len(_list_arg(node, 1)) != 1:
        raise UnsupportedOpError("aten.rms_norm over more than the last axis")
    w = _arg(node, 2, "weight")
    eps = _arg(node, 3, "eps")
    if eps is None:
        eps = float(torch.finfo(node.meta["val"].dtype).eps)
    return im.emit(top.RmsNormOp(x, im.value(w) if w is not None else None, eps)).results[0]


@builds(aten.embedding.default)
def _embedding(im: Importer, node: torch.fx.Node) -> Built:
    w, idx = im.value(node.args[0]), im.value(node.args[1])
    return im.emit(top.GatherOp(w, idx, 0)).results[0]


@builds(aten.index_select.default)
def _index_select(im: Importer, node: torch.fx.Node) -> Built:
    x, dim, idx = im.value(node.args[0]), _int_arg(node, 1), im.value(node.args[2])
    dim %= len(shape_of(x))
    return im.emit(top.GatherOp(x, idx, dim)).results[0]


@builds(aten.topk.default)
def _topk(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    k = _int_arg(node, 1)
    dim = _arg(node, 2, "dim", -1) % len(shape_of(x))
    largest = _arg(node, 3, "largest", True)
    op = im.emit(top.TopKOp(x, k, dim, largest=largest))
    idx = im.cast_to(op.results[1], elem_of_torch(node.meta["val"][1].dtype), "indices")
    return (op.results[0], idx)


@builds(aten.scatter.src)
def _scatter(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    dim = _int_arg(node, 1) % len(shape_of(x))
    idx, src = im.value(node.args[2]), im.value(node.args[3])
    if _arg(node, 4, "reduce") is not None:
        raise UnsupportedOpError("aten.scatter with a reduction")
    src = im.cast_to(src, im.out_type().element_type, "updates")
    return im.emit(top.ScatterOp(x, idx, src, dim)).results[0]


@builds(aten.cumsum.default)
def _cumsum(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    x = im.cast_to(x, im.out_type().element_type)
    dim = _int_arg(node, 1) % len(shape_of(x))
    return im.emit(top.CumSumOp(x, dim)).results[0]


@builds(aten.argmax.default)
def _argmax(im: Importer, node: torch.fx.Node) -> Built:
    x = im.value(node.args[0])
    dim = _arg(node, 1, "dim")
    if dim is None:
        x = im.reshape(x, [math.prod(shape_of(x))], "flat")
        dim = 0
    dim %= len(shape_of(x))
    op = im.emit(top.TopKOp(x, 1, dim), "topk")
    idx = im.cast_to(op.results[1], im.out_type().element_type, "indices")
    return im.reshape(idx, im.out_shape(), "")


@builds(aten.conv2d.default, aten.conv2d.padding, aten.convolution.default)
def _conv2d(im: Importer, node: torch.fx.Node) -> Built:
    x, w = im.value(node.args[0]), im.value(node.args[1])
    b = _arg(node, 2, "bias")
    stride = list(_arg(node, 3, "stride", [1, 1]))
    padding = _arg(node, 4, "padding", [0, 0])
    dilation = list(_arg(node, 5, "dilation", [1, 1]))
    if node.target == aten.convolution.default:
        if node.args[6]:
            raise UnsupportedOpError("transposed convolution")
        groups = _int_arg(node, 8)
    else:
        groups = _arg(node, 6, "groups", 1)
    if len(shape_of(x)) != 4:
        raise UnsupportedOpError("only 2-D convolution is supported")
    stride = stride * 2 if len(stride) == 1 else stride
    dilation = dilation * 2 if len(dilation) == 1 else dilation
    if padding == "valid":
        padding = [0, 0]
    elif padding == "same":  # stride 1 (torch's rule): pad (k - 1) * dilation, symmetric
        total = [(k - 1) * d for k, d in zip(shape_of(w)[2:], dilation, strict=True)]
        if any(t % 2 for t in total):
            raise UnsupportedOpError("conv2d padding='same' with an even kernel (asymmetric "
                                     "padding)")
        padding = [t // 2 for t in total]
    elif isinstance(padding, str):
        raise UnsupportedOpError(f"conv2d padding='{padding}'")
    padding = list(padding) * 2 if len(padding) == 1 else list(padding)
    pads = [padding[0], padding[1], padding[0], padding[1]]
    op = top.Conv2dOp(x, w, im.value(b) if b is not None else None, strides=stride, pads=pads,
                      dilations=dilation, groups=groups)
    return im.emit(op).results[0]


@builds(aten.scaled_dot_product_attention.default)
def _sdpa(im: Importer, node: torch.fx.Node) -> Built:
    """torch layout [B, H, S, D] -> sequence-major top.attention between permutes.

    A GQA repeat (k expanded to the query heads) is left in place here; the fuse pass
    folds it into kv_heads.
    """
    q, k, v = (im.value(a) for a in node.args[:3])
    mask_arg = _arg(node, 3, "attn_mask")
    if _arg(node, 4, "dropout_p", 0.0):
        raise UnsupportedOpError("scaled_dot_product_attention with dropout")
    causal = bool(_arg(node, 5, "is_causal", False))
    scale = _arg(node, 6, "scale")
    gqa = bool(node.kwargs.get("enable_gqa", False))
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if len(qs) != 4:
        raise UnsupportedOpError("scaled_dot_product_attention on tensors of rank != 4")
    b, hq, sq, d = qs
    hkv = ks[1]
    if hkv != hq and not gqa:
        raise UnsupportedOpError("sdpa with different q/k head counts needs enable_gqa")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    mask = None
    if mask_arg is not None:
        mask = im.value(mask_arg)
        mt = mask.type
        assert isinstance(mt, TensorType)
        if mt.element_type == elem_of_torch(torch.bool):
            dt = numpy_dtype(elem_of_torch(node.meta["val"].dtype))
            zero = im.emit(top.ConstantOp(np.zeros((), dt)), "mask_zero").results[0]
            neg = im.emit(top.ConstantOp(np.array(np.finfo(np.float32).min).astype(dt)),
                          "mask_neg").results[0]
            mask = im.emit(top.WhereOp(mask, zero, neg), "mask").results[0]
        ms = shape_of(mask)
        if len(ms) < 4:
            mask = im.reshape(mask, (1,) * (4 - len(ms)) + ms, "mask4d")
        mask = im.cast_to(mask, elem_of_torch(node.meta["val"].dtype), "mask_cast")
    qt = im.permute(q, [0, 2, 1, 3], "q")
    kt = im.permute(k, [0, 2, 1, 3], "k")
    vt = im.permute(v, [0, 2, 1, 3], "v")
    att = im.emit(top.AttentionOp(qt, kt, vt, mask, scale=scale, q_heads=hq, kv_heads=hkv,
                                  head_dim=d, causal=causal)).results[0]
    del vs
    return im.permute(att, [0, 2, 1, 3], "out")


@builds(torch.ops.toptpu.causal_conv1d.default)
def _causal_conv1d(im: Importer, node: torch.fx.Node) -> Built:
    """`toptpu::causal_conv1d` (frontends.linear_attention_ops) -> top.causal_conv1d; its
    two results are taken apart by the getitem nodes that follow it."""
    x, w = im.value(node.args[0]), im.value(node.args[1])
    state_arg = _arg(node, 2, "state")
    valid = im.value(_arg(node, 3, "valid"))
    state = None if state_arg is None else im.value(state_arg)
    op = im.emit(top.CausalConv1dOp(x, w, state, valid))
    return tuple(im.cast_to(r, im.out_type(i).element_type, f"out{i}")
                 for i, r in enumerate(op.results))


@builds(torch.ops.toptpu.gated_delta_rule.default)
def _gated_delta_rule(im: Importer, node: torch.fx.Node) -> Built:
    """`toptpu::gated_delta_rule` (frontends.linear_attention_ops) -> top.gated_delta_rule;
    a state of another float type is cast to f32 first (the definition computes in f32)."""
    q, k, v, g, beta = (im.value(a) for a in node.args[:5])
    state_arg = _arg(node, 5, "state")
    scale = _scalar(_arg(node, 6, "scale"))
    if scale is None:
        raise UnsupportedOpError("toptpu.gated_delta_rule needs a constant float scale")
    state = None if state_arg is None else im.cast_to(im.value(state_arg),
                                                      elem_of_torch(torch.float32), "state")
    op = im.emit(top.GatedDeltaRuleOp(q, k, v, g, beta, state, scale=scale))
    return tuple(im.cast_to(r, im.out_type(i).element_type, f"out{i}")
                 for i, r in enumerate(op.results))


@builds(torch.ops.toptpu.moe_route.default)
def _moe_route(im: Importer, node: torch.fx.Node) -> Any:
    """`toptpu::moe_route` (frontends.moe_ops) -> top.moe_route; its weights and indices
    are taken apart by the getitem nodes that follow it."""
    logits = im.value(node.args[0])
    top_k, normalize = _arg(node, 1, "top_k"), _arg(node, 2, "normalize")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not isinstance(normalize,
                                                                               bool):
        raise UnsupportedOpError("toptpu.moe_route needs a constant top_k and normalize")
    valid_arg = _arg(node, 3, "valid")
    valid = None if valid_arg is None else im.value(valid_arg)
    op = im.emit(top.MoeRouteOp(logits, valid, k=top_k, normalize=normalize))
    return tuple(im.cast_to(r, im.out_type(i).element_type, f"out{i}")
                 for i, r in enumerate(op.results))


def _stacked_weight(im: Importer, name: str, make: Callable[[], np.ndarray]) -> SSAValue:
    """A top.weight of the experts' stacked tensor `name`, put in the store once (`make`)."""
    if name not in im.store:
        im.store[name] = make()
    arr = im.store[name]
    op = top.WeightOp(name, tensor(arr.shape, element_type_of_numpy(arr.dtype)))
    im.emit(op, name.rsplit(".", 1)[1])
    op.location = make_loc(name)
    return op.results[0]


@builds(torch.ops.toptpu.moe_experts.default)
def _moe_experts(im: Importer, node: torch.fx.Node) -> Any:
    """`toptpu::moe_experts` (frontends.moe_ops: transformers' fused [E, 2I, H] gate|up)
    -> top.moe_experts on the gate and up halves, each stacked by expert under its name
    (`frontends.moe.split_names`: '…experts.gate_up_proj' -> '…experts.gate_proj',
    '…experts.up_proj'), which every layer's weights derive the same way."""
    x, gate_up, down, weights, indices = (im.value(a) for a in node.args[:5])
    fused = top.weight_name(gate_up)
    names = moe.split_names(fused) if fused is not None else None
    if fused is None or names is None:
        raise UnsupportedOpError("toptpu.moe_experts needs the experts' fused weight "
                                 "(…experts.gate_up_proj) as its gate_up")
    inter = shape_of(gate_up)[1] // 2
    stored = fused

    def half(h: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            whole = im.store[stored]
            part = whole[:, h * inter:(h + 1) * inter]
            # all zeros (the estimate's placeholders, a streaming compile's placeholder
            # experts, on untouched pages): zeros on untouched pages, not E x I x H written
            if im.store.placeholders or not whole.any():
                return np.zeros(part.shape, part.dtype)
            return part
        return make

    gate = _stacked_weight(im, names[0], half(0))
    up = _stacked_weight(im, names[1], half(1))
    op = im.emit(top.MoeExpertsOp(x, gate, up, down, weights, indices))
    return im.cast_to(op.results[0], im.out_type().element_type)


@builds(torch.ops.toptpu.moe_experts_list.default)
def _moe_experts_list(im: Importer, node: torch.fx.Node) -> Any:
    """`toptpu::moe_experts_list` (a block whose experts are a list of modules) ->
    top.moe_experts on the experts' gate, up and down weights each stacked once, at import,
    under the name the experts' stacked tensors have (`frontends.moe.stacked_name`:
    'layer.mlp.experts.3.gate_proj.weight' -> 'layer.mlp.experts.gate_proj')."""
    x, weights, indices = im.value(node.args[0]), im.value(node.args[4]), im.value(node.args[5])
    def stack(names: list[str]) -> Callable[[], np.ndarray]:
        return lambda: np.stack([im.store[n] for n in names])

    stacked: list[SSAValue] = []
    for part in node.args[1:4]:
        assert isinstance(part, list | tuple)
        found = [top.weight_name(im.value(a)) for a in part]
        names = [n for n in found if n is not None]
        hits = [moe.stacked_name(n) for n in names]
        targets = {h[0] for h in hits if h is not None}
        if len(names) != len(found) or None in hits or len(targets) != 1:
            raise UnsupportedOpError("toptpu.moe_experts_list needs the experts' own weights "
                                     "(…experts.N.gate_proj.weight …), named alike")
        stacked.append(_stacked_weight(im, targets.pop(), stack(names)))
    gate, up, down = stacked
    op = im.emit(top.MoeExpertsOp(x, gate, up, down, weights, indices))
    return im.cast_to(op.results[0], im.out_type().element_type)


# =========================================================================== driver

_CONST_FACTORIES = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.scalar_tensor.default, aten.empty.memory_format,
    aten.new_ones.default, aten.new_zeros.default, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default,
}


def _fold_with_torch(im: Importer, node: torch.fx.Node) -> ConstValue | None:
    """Evaluate `node` with torch when every tensor it reads is an import-time constant."""
    tensors = [a for a in node.all_input_nodes]
    like_ops = {aten.new_ones.default, aten.new_zeros.default, aten.full_like.default,
                aten.zeros_like.default, aten.ones_like.default}
    if node.target in like_ops:
        tensors = []  # only the shape/dtype of the source matter
    elif not all(im.is_const(t) for t in tensors):
        return None
    if not tensors and node.target not in _CONST_FACTORIES:
        return None

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            c = im.env.get(a)
            if isinstance(c, ConstValue):
                return torch.from_numpy(np.array(c.array))
            val = a.meta["val"]
            return torch.zeros(tuple(val.shape), dtype=val.dtype)
        if isinstance(a, list | tuple):
            return type(a)(conv(x) for x in a)
        return a

    args = conv(node.args)
    kwargs = {k: conv(v) for k, v in node.kwargs.items()}
    if "device" in kwargs:
        kwargs["device"] = "cpu"
    with torch.no_grad():
        assert callable(node.target), f"{node.target!r} is not an operator"
        res = node.target(*args, **kwargs)
    if not isinstance(res, torch.Tensor):
        return None
    return ConstValue(_torch_to_numpy(res), node.name)


def import_exported(
    ep: torch.export.ExportedProgram,
    *,
    module: torch.nn.Module | None = None,
    store: WeightStore | None = None,
    weight_prefix: str = "",
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    func_name: str = "main",
) -> tuple[ModuleOp, WeightStore]:
    """Translate an ExportedProgram into a Top module; weights go to `store`."""
    store = store if store is not None else WeightStore()
    sig = ep.graph_signature
    kinds = {spec.arg.name: spec for spec in sig.input_specs}
    buffers = dict(module.named_buffers()) if module is not None else {}
    state = ep.state_dict
    user_inputs: list[torch.fx.Node] = []
    im = Importer(store=store, weight_prefix=weight_prefix)
    arg_types: list[Attribute] = []
    nodes = list(ep.graph.nodes)
    for node in nodes:
        if node.op == "placeholder" and kinds[node.name].kind.name == "USER_INPUT":
            user_inputs.append(node)
            val = node.meta["val"]
            arg_types.append(tensor(tuple(val.shape), elem_of_torch(val.dtype)))
    im.block = Block(arg_types=arg_types)
    names = list(input_names) if input_names else [n.name for n in user_inputs]
    if len(names) != len(user_inputs):
        raise ImportError_(f"{len(user_inputs)} inputs but {len(names)} input names")
    for node, arg, name in zip(user_inputs, im.block.args, names, strict=True):
        arg.name_hint = _sanitize(name)
        im.env[node] = arg
    results: list[SSAValue] = []
    for node in nodes:
        im.node = node
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind.name == "USER_INPUT":
                continue
            target = spec.target
            assert target is not None
            if target in state:
                t = state[target]
            elif target in ep.constants:
                t = ep.constants[target]
            elif target in buffers:
                t = buffers[target]
            else:
                raise ImportError_(f"cannot find the tensor for '{target}' ({spec.kind.name})")
            if not isinstance(t, torch.Tensor):
                raise ImportError_(f"'{target}' is not a tensor ({type(t).__name__})")
            wname = f"{weight_prefix}{target}"
            if wname not in store:
                store[wname] = _torch_to_numpy(t)
            op = top.WeightOp(wname, tensor(tuple(t.shape), elem_of_torch(t.dtype)))
            im.emit(op)
            op.location = make_loc(wname)
            op.results[0].name_hint = _sanitize(target.split(".")[-2] + "_" + target.split(".")[-1]
                                                if "." in target else target)
            im.env[node] = op.results[0]
        elif node.op == "call_function":
            if node.target is operator.getitem:
                src = im.env[node.args[0]]
                im.env[node] = src[node.args[1]]
                continue
            folded = _fold_with_torch(im, node)
            if folded is not None:
                im.env[node] = folded
                continue
            builder = ATEN_BUILDERS.get(node.target)
            if builder is None:
                file, line, code = source_line(node)
                where = f" at {file}:{line}: `{code}`" if file else ""
                raise UnsupportedOpError(
                    f"unsupported aten op '{node.target}' (FX node '{node.name}'){where}. "
                    "Add a builder for it to toptpu.frontends.fx_importer.ATEN_BUILDERS."
                )
            try:
                im.env[node] = builder(im, node)
            except UnsupportedOpError as e:
                file, line, code = source_line(node)
                where = f" at {file}:{line}: `{code}`" if file else ""
                raise UnsupportedOpError(f"unsupported use of '{node.target}': {e}{where}") from e
        elif node.op == "output":
            outs = node.args[0]
            flat = list(outs) if isinstance(outs, list | tuple) else [outs]
            for o in flat:
                results.append(im.value(o))
        else:
            raise ImportError_(f"unexpected FX node kind '{node.op}' ({node.name})")
    onames = list(output_names) if output_names else [f"output{i}" for i in range(len(results))]
    if len(onames) != len(results):
        raise ImportError_(f"{len(results)} outputs but {len(onames)} output names")
    im.block.add_op(func.ReturnOp(*results))
    fn = func.FuncOp(
        func_name,
        ([a.type for a in im.block.args], [r.type for r in results]),
        Region(im.block),
        arg_attrs=name_dicts(names),
        res_attrs=name_dicts(onames),
    )
    mod = ModuleOp([fn])
    attach_store(mod, store)
    return mod, store


def import_module(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    kwargs: dict[str, Any] | None = None,
    store: WeightStore | None = None,
    weight_prefix: str = "",
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    func_name: str = "main",
) -> tuple[ModuleOp, WeightStore]:
    """torch.export `model` at the static shapes of `args` and import it into Top."""
    model = model.eval()
    with torch.no_grad():
        ep = torch.export.export(model, args, kwargs=kwargs, strict=False)
    return import_exported(ep, module=model, store=store, weight_prefix=weight_prefix,
                           input_names=input_names, output_names=output_names,
                           func_name=func_name)
