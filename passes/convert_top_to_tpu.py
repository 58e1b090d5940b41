"""convert-top-to-tpu{mode=..., group-size=..., symmetric=..., keep-float=...}

Lowers Top to Tpu, making the chip's type decisions:

- `mode` f32 | f16 | bf16 | w8f16 | w8bf16 | w4f16 | w4bf16 | w8f32 | w4f32: the activation
  (storage) type and, for the w* modes, the weight bits of matmuls with a weight operand.
- float function inputs/outputs take the activation type; integer ones keep theirs. With
  `keep-input-types` float inputs keep their imported type (the sampling heads compile in
  f32 and take the logits in the model's activation type).
- matmul weights are quantized round-to-nearest into `tpu.a16_matmul` (w8 symmetric per
  channel; w4 asymmetric per group of `group-size`, or symmetric with `symmetric=true`);
  a weight whose pre-quantized checkpoint tensors are in the store (see
  `passes.quantize.checkpoint_key`) uses exactly those, and in a pre-quantized model the
  weights the quantizer left at full precision stay float;
  matmuls whose weight also feeds a gather (tied embeddings) or whose weight name contains
  one of `keep-float` (default "lm_head") stay in the activation type.
- norms, softmax, attention and rope compute in f32 (`compute = f32`); norm weights and
  matmul biases are stored in f32.
- linear attention: softplus, causal_conv1d and gated_delta_rule compute in f32; the conv
  weight [C, K] is stored f32 (never quantized); the delta rule's recurrent state (its
  state operand, new_state result, and a function argument feeding that operand) is f32
  in every mode; the conv state takes the activation type.
- the position subgraph (float ops computed only from integer inputs and weights, e.g. the
  rotary angles) stays in f32: rope reads its cos/sin in f32.
- casts are inserted only where an operand's type differs from what its consumer needs;
  redundant casts fold away.

One generic pattern lowers every op to its Tpu twin (`tpu.TPU_OF_TOP`; a plugin's op, its
plugin-registered twin: `plugin_ops.twin_of`) by what the op declares
(`ShapedOp.tpu_operand_storage`, `tpu_result_storage`, `TPU_COMPUTES_F32`); matmul
(weight quantization into `tpu.a16_matmul`), cast (its target type is the mode's) and the
collectives have patterns of their own. They share a `Lowering` (mode, weight store,
caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType, f32
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)
from xdsl.rewriter import InsertPoint
from xdsl.transforms.dead_code_elimination import region_dce

from toptpu.dialects import dev, top, tpu
from toptpu.dialects.common import (
    DEFAULT_GROUP_SIZE,
    QuantMode,
    ShapedOp,
    Storage,
    constant_value,
    dtype_from_name,
    dtype_name,
    elem_of,
    element_type_of_numpy,
    i64_attr,
    is_float,
    numpy_dtype,
    read_bool,
    shape_of,
    str_attr,
    tensor,
)
from toptpu.dialects.naming import op_name, set_name
from toptpu.dialects.plugin_ops import twin_of
from toptpu.dialects.weight_store import WeightStore, weights_of
from toptpu.errors import ToptpuError
from toptpu.passes.quantize import (
    CHECKPOINT_MODEL,
    QuantizationError,
    checkpoint_parts_of_store,
    placeholder_quantized,
    quantize_rtn,
    resolve_group_size,
)
from toptpu.passes.util import named_like, producer, require_level

#: qweight, scales, zeros (or None), mins (or None), the act-order permutation (or None),
#: bits, group size
CheckpointWeights = tuple[SSAValue, SSAValue, "SSAValue | None", "SSAValue | None",
                          "SSAValue | None", int, int]


class ConversionError(ToptpuError, ValueError):
    pass


def quant_mode(mode: str) -> QuantMode:
    """The mode called `mode`; ConversionError naming the choices if there is none."""
    named = QuantMode.named(mode)
    if named is None:
        raise ConversionError(
            f"unknown quantization mode '{mode}'; choose one of {', '.join(QuantMode.names())}"
        )
    return named


def parse_mode(mode: str) -> tuple[Attribute, int | None]:
    """The activations' element type and the weight bits of `mode` (see `quant_mode`)."""
    m = quant_mode(mode)
    return dtype_from_name(m.activation), m.weight_bits


def _index_derived_ops(fn: func.FuncOp) -> set[Operation]:
    """Float ops computed only from integer values, weights and constants (position math)."""
    derived: set[SSAValue] = set()
    ops: set[Operation] = set()
    for arg in fn.body.block.args:
        if not is_float(elem_of(arg)):
            derived.add(arg)
    for op in fn.body.block.ops:
        if not op.results or (isinstance(op, ShapedOp) and (op.SOURCE or op.INDEXES_TABLE)):
            continue  # a gather reads data by index: its result is not position math
        inputs = list(op.operands)
        sources = [v for v in inputs if not is_source(v)]
        if sources and all(v in derived for v in sources):
            for r in op.results:
                derived.add(r)
            if any(is_float(elem_of(r)) for r in op.results):
                ops.add(op)
    return ops


def is_source(v: SSAValue) -> bool:
    """Whether `v` is given to the net (a weight's, a constant's) rather than computed."""
    owner = producer(v, ShapedOp)
    return owner is not None and owner.SOURCE


@dataclass
class Lowering:
    """Shared state of the conversion patterns."""

    act: Attribute
    bits: int | None
    group_size: int
    symmetric: bool | None
    keep_float: tuple[str, ...]
    store: WeightStore
    index_ops: set[Operation] = field(default_factory=set)
    _weights: dict[tuple[str, str], SSAValue] = field(default_factory=dict)
    _quantized: dict[tuple[str, str], tuple[SSAValue, SSAValue, SSAValue | None, int, int]] = (
        field(default_factory=dict))

    # ------------------------------------------------------------------ types
    def result_elem(self, op: Operation, t: Attribute) -> Attribute:
        if not is_float(t):
            return t
        return f32 if op in self.index_ops else self.act

    def wants(self, op: Operation) -> Attribute:
        """The float type `op`'s float operands must have."""
        return f32 if op in self.index_ops else self.act

    def storage_type(self, op: Operation, storage: Storage) -> Attribute | None:
        """The element type a float value `op` types as `storage` takes (None: its own)."""
        if storage == Storage.KEEP:
            return None
        return f32 if storage == Storage.F32 else self.wants(op)

    # ------------------------------------------------------------------ operands
    def weight(self, top_weight: top.WeightOp, elem: Attribute, rewriter: PatternRewriter
               ) -> SSAValue:
        """A tpu.weight holding `top_weight`'s tensor converted to `elem` (cached)."""
        src = top_weight.tensor_name
        key = (src, dtype_name(elem))
        if key in self._weights:
            return self._weights[key]
        arr = self.store[src]
        want = numpy_dtype(elem)
        name = src if arr.dtype == want else f"{src}:{dtype_name(elem)}"
        if name not in self.store:
            self.store[name] = self.store.derive(arr.shape, want, lambda: arr.astype(want))
        op = tpu.WeightOp(
            attributes={"name": str_attr(name), "source": str_attr(src), "part": str_attr("data")},
            result_types=[tensor(arr.shape, elem)],
        )
        set_name(op, name)
        op.results[0].name_hint = top_weight.results[0].name_hint
        rewriter.insert(op, InsertPoint.after(top_weight))
        self._weights[key] = op.results[0]
        return op.results[0]

    def quantized_weight(self, top_weight: top.WeightOp, rewriter: PatternRewriter
                         ) -> tuple[SSAValue, SSAValue, SSAValue | None, int, int]:
        assert self.bits is not None
        src = top_weight.tensor_name
        w = self.store[src]
        k = w.shape[-1]
        sym = self.symmetric if self.symmetric is not None else (self.bits == 8)
        gs = resolve_group_size(k, self.group_size, self.bits)
        tag = f"q{self.bits}g{gs}{'s' if sym else 'a'}:{dtype_name(self.act)}"
        key = (src, tag)
        if key in self._quantized:
            return self._quantized[key]
        if self.store.placeholders:  # zeros of the shapes one row's quantization has
            qw = placeholder_quantized(w, self.bits, gs, sym, numpy_dtype(self.act))
        else:
            qw = quantize_rtn(w, self.bits, gs, sym, numpy_dtype(self.act))
        parts = {"qweight": qw.qweight, "scales": qw.scales}
        if qw.zeros is not None:
            parts["zeros"] = qw.zeros
        values: dict[str, SSAValue] = {}
        anchor: Operation = top_weight
        for part, arr in parts.items():
            name = f"{src}:{tag}.{part}"
            self.store[name] = arr
            elem = tpu_elem_of_numpy(arr.dtype)
            op = tpu.WeightOp(
                attributes={"name": str_attr(name), "source": str_attr(src),
                            "part": str_attr(part)},
                result_types=[tensor(arr.shape, elem)],
            )
            set_name(op, name)
            rewriter.insert(op, InsertPoint.after(anchor))
            anchor = op
            values[part] = op.results[0]
        result = (values["qweight"], values["scales"], values.get("zeros"), self.bits, gs)
        self._quantized[key] = result
        return result

    def checkpoint_weight(self, top_weight: top.WeightOp, rewriter: PatternRewriter
                          ) -> CheckpointWeights | None:
        """The tpu.weights of a pre-quantized checkpoint layer (None when the store has no
        checkpoint tensors for this weight): exactly its integers, scales and zeros (or
        mins)."""
        src = top_weight.tensor_name
        key = (src, "checkpoint")
        if key in self._quantized:
            return self._quantized[key]  # type: ignore[return-value]  # a checkpoint entry
        parts = checkpoint_parts_of_store(self.store, src)
        if parts is None:
            return None
        bits, gs = (int(x) for x in parts.pop("meta"))
        values: dict[str, SSAValue] = {}
        anchor: Operation = top_weight
        for part, arr in parts.items():
            name = f"{src}:ckpt.{part}"
            self.store[name] = arr
            op = tpu.WeightOp(
                attributes={"name": str_attr(name), "source": str_attr(src),
                            "part": str_attr(f"checkpoint.{part}")},
                result_types=[tensor(arr.shape, tpu_elem_of_numpy(arr.dtype))],
            )
            set_name(op, name)
            rewriter.insert(op, InsertPoint.after(anchor))
            anchor = op
            values[part] = op.results[0]
        result = (values["qweight"], values["scales"], values.get("zeros"),
                  values.get("mins"), values.get("perm"), bits, gs)
        self._quantized[key] = result  # type: ignore[assignment]  # a checkpoint entry
        return result

    def operand(self, v: SSAValue, elem: Attribute | None, user: Operation,
                rewriter: PatternRewriter, tag: str = "") -> SSAValue:
        """`v` as a Tpu value of element type `elem` (None: keep the type)."""
        if (w := producer(v, top.WeightOp)) is not None:
            target = elem if elem is not None and is_float(elem_of(v)) else elem_of(v)
            return self.weight(w, target, rewriter)
        if (c := producer(v, top.ConstantOp)) is not None:
            arr = constant_value(c.value)
            target = elem if elem is not None and is_float(elem_of(v)) else elem_of(v)
            new = tpu.ConstantOp(arr.astype(numpy_dtype(target)))
            named_like(new, c)
            rewriter.insert(new, InsertPoint.before(user))
            return new.output
        if elem is None or elem_of(v) == elem or not is_float(elem_of(v)):
            return v
        cast = tpu.CastOp.build([v], {"dtype": elem, "compute": elem})
        named_like(cast, user, f".{tag or 'in'}_cast")
        rewriter.insert(cast, InsertPoint.before(user))
        return cast.output

    def keep_matmul_float(self, w: top.WeightOp) -> bool:
        if any(k and k in w.tensor_name for k in self.keep_float):
            return True
        if any(isinstance(u.operation, ShapedOp) and u.operation.INDEXES_TABLE
               for u in w.output.uses):
            return True
        # a matmul whose result a FLOAT_PRODUCER reads first (the MoE router's logits)
        return any(isinstance(r.operation, ShapedOp) and r.operation.FLOAT_PRODUCER
                   and r.index == 0 for u in w.output.uses for res in u.operation.results
                   for r in res.uses)


def tpu_elem_of_numpy(dt: np.dtype) -> Attribute:
    return element_type_of_numpy(dt)


def _attrs(op: Operation) -> dict[str, Attribute]:
    return {k: v for k, v in op.attributes.items() if k != "operandSegmentSizes"}


def _result_types(lw: Lowering, op: ShapedOp) -> list[Attribute]:
    """The Tpu op's result types: the storage `op` declares for each (`tpu_result_storage`)
    in this mode; integer results keep their type."""
    out: list[Attribute] = []
    for r, storage in zip(op.results, op.tpu_result_storage(), strict=True):
        t = r.type
        assert isinstance(t, TensorType)
        elem = t.element_type
        if is_float(elem) and storage != Storage.KEEP:
            elem = f32 if storage == Storage.F32 else lw.result_elem(op, elem)
        out.append(tensor(shape_of(t), elem))
    return out


class LoweringPattern(RewritePattern):
    def __init__(self, lw: Lowering) -> None:
        self.lw = lw

    def emit(self, op: ShapedOp, operands: Sequence[SSAValue | Sequence[SSAValue] | None],
             rewriter: PatternRewriter, compute: Attribute | None = None,
             attrs: dict[str, Attribute] | None = None) -> None:
        """Replace `op` by its Tpu twin over `operands`, with `op`'s attributes (or
        `attrs`), its result types in this mode and `compute` (default: the op's
        declaration, f32 or its result's type)."""
        cls = twin_of(type(op))
        assert cls is not None, op.name
        a = _attrs(op) if attrs is None else attrs
        types = _result_types(self.lw, op)
        a["compute"] = compute or (f32 if op.TPU_COMPUTES_F32 else elem_of(types[0]))
        new = cls.build(operands, a, types)
        named_like(new, op)
        rewriter.replace(op, new)

    def lower(self, op: ShapedOp, rewriter: PatternRewriter) -> None:
        """Lower `op` to its twin as it declares: each operand in the type of its
        `Storage` (`tpu_operand_storage`), cast where it differs."""
        lw = self.lw
        groups = op.operand_groups()
        names = _operand_names(op)
        values: list[SSAValue | None] = [
            None if v is None else lw.operand(v, lw.storage_type(op, storage), op, rewriter,
                                              name)
            for v, storage, name in zip(groups, op.tpu_operand_storage(), names,
                                        strict=True)]
        self.emit(op, op.grouped(values), rewriter)


def _operand_names(op: ShapedOp) -> list[str]:
    """A name per operand in `operand_groups` order (its field; a variadic one's numbered),
    for the casts inserted before it."""
    names: list[str] = []
    for fname, _ in type(op).get_irdl_definition().operands:
        val = getattr(op, fname)
        if val is None or isinstance(val, SSAValue):
            names.append(fname)
        else:
            names.extend(f"{fname}{i}" for i in range(len(val)))
    return names


class LowerToTwin(LoweringPattern):
    """Every Top op other than the sources (weights and constants, lowered where they are
    used) to its Tpu twin, typed as it declares (`LoweringPattern.lower`)."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if twin_of(type(op)) is None or not isinstance(op, ShapedOp) or op.SOURCE:
            return
        self.lower(op, rewriter)


class LowerCast(LoweringPattern):
    """cast: to the type its target has in this mode; none where the operand has it."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.CastOp, rewriter: PatternRewriter) -> None:
        lw = self.lw
        x = lw.operand(op.input, None, op, rewriter)
        target = lw.result_elem(op, elem_of(op.output))
        if elem_of(x) == target:
            rewriter.replace(op, [], [x])
            return
        attrs = {"dtype": target}
        self.emit(op, [x], rewriter, compute=target, attrs=attrs)


class LowerMatMul(LoweringPattern):
    """matmul with a 2-D weight: quantized (a16_matmul) or in the activation type;
    activation x activation matmuls stay matmuls. Biases are f32."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MatMulOp, rewriter: PatternRewriter) -> None:
        lw = self.lw
        want = lw.wants(op)
        w = producer(op.rhs, top.WeightOp)
        if (w is None or not read_bool(op.transpose_b) or read_bool(op.transpose_a)
                or len(shape_of(op.rhs)) != 2):
            self.lower(op, rewriter)
            return
        try:
            ckpt = lw.checkpoint_weight(w, rewriter)
        except QuantizationError as e:
            raise ConversionError(f"{op_name(op) or op.name}: {e}") from e
        if ckpt is None and not (lw.bits is not None and op not in lw.index_ops
                                 and CHECKPOINT_MODEL not in lw.store
                                 and not lw.keep_matmul_float(w)):
            self.lower(op, rewriter)
            return
        x = lw.operand(op.lhs, want, op, rewriter, "x")
        bias = lw.operand(op.bias, f32, op, rewriter, "bias") if op.bias is not None else None
        mins = None
        if ckpt is not None:
            if lw.bits is None:
                raise ConversionError(
                    f"'{w.tensor_name}' comes pre-quantized from the checkpoint: use a "
                    "weight-only mode (-q auto, w4bf16, w4f16, w4f32, ...) so its integers "
                    "are used as they are")
            q, s, z, mins, perm, bits, gs = ckpt
            if perm is not None:  # act-order: gather the input channels group by group
                rank = len(shape_of(x))
                g = tpu.GatherOp.build([x, perm], {"axis": i64_attr(rank - 1),
                                                  "compute": elem_of(x)})
                named_like(g, op, ".act_order")
                rewriter.insert(g, InsertPoint.before(op))
                x = g.results[0]
        else:
            try:
                q, s, z, bits, gs = lw.quantized_weight(w, rewriter)
            except QuantizationError as e:
                raise ConversionError(f"{op_name(op) or op.name}: {e}") from e
        (rt,) = _result_types(lw, op)
        assert isinstance(rt, TensorType)
        new = tpu.A16MatMulOp(x, q, s, z, bias, weight_bits=bits, group_size=gs,
                              result_type=rt, mins=mins)
        named_like(new, op)
        rewriter.replace(op, new)


class LowerMoeExperts(LoweringPattern):
    """moe_experts: in a weight-only mode (or a pre-quantized model whose experts come
    quantized) the stacked experts are quantized expert by expert into
    `tpu.a16_moe_experts` (each projection's groups along its input dimension, the
    parameters of the mode's `a16_matmul`s); else its float twin."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.MoeExpertsOp, rewriter: PatternRewriter) -> None:
        lw = self.lw
        where = op_name(op) or op.name
        maybe = [producer(v, top.WeightOp) for v in (op.gate, op.up, op.down)]
        stacked = [w for w in maybe if w is not None]
        if len(stacked) != 3 or op in lw.index_ops:
            self.lower(op, rewriter)
            return
        projections: list[tuple[SSAValue, SSAValue, SSAValue | None, SSAValue | None]] = []
        bits: list[int] = []
        groups: list[int] = []
        if CHECKPOINT_MODEL in lw.store:  # pre-quantized: the checkpoint's experts as they are
            try:
                ckpts = [lw.checkpoint_weight(w, rewriter) for w in stacked]
            except QuantizationError as e:
                raise ConversionError(f"{where}: {e}") from e
            if all(c is None for c in ckpts):  # left float by the quantizer
                self.lower(op, rewriter)
                return
            if lw.bits is None:
                raise ConversionError(
                    f"'{stacked[0].tensor_name}' comes pre-quantized from the checkpoint: use "
                    "a weight-only mode (-q auto, w4bf16, w4f16, w4f32, ...) so its integers "
                    "are used as they are")
            for w, c in zip(stacked, ckpts, strict=True):
                if c is None or c[4] is not None:
                    raise ConversionError(
                        f"{where}: '{w.tensor_name}' is "
                        f"{'float' if c is None else 'act-order'} in the checkpoint while "
                        "the other experts' projections are quantized; toptpu compiles a "
                        "layer's experts quantized alike")
                q, s, z, m, _, b, gs = c
                projections.append((q, s, z, m))
                bits.append(b)
                groups.append(gs)
        elif lw.bits is None or any(lw.keep_matmul_float(w) for w in stacked):
            self.lower(op, rewriter)
            return
        else:
            for w in stacked:
                try:
                    q, s, z, b, gs = lw.quantized_weight(w, rewriter)
                except QuantizationError as e:
                    raise ConversionError(f"{where}: {w.tensor_name}: {e}") from e
                projections.append((q, s, z, None))
                bits.append(b)
                groups.append(gs)
        storage = op.tpu_operand_storage()
        x = lw.operand(op.x, lw.storage_type(op, storage[0]), op, rewriter, "x")
        weights = lw.operand(op.weights, lw.storage_type(op, storage[4]), op, rewriter,
                             "weights")
        indices = lw.operand(op.indices, None, op, rewriter, "indices")
        (rt,) = _result_types(lw, op)
        assert isinstance(rt, TensorType)
        new = tpu.A16MoeExpertsOp(x, projections, weights, indices, weight_bits=bits,
                                  group_size=groups, result_type=rt)
        named_like(new, op)
        rewriter.replace(op, new)


class LowerCollective(LoweringPattern):
    """A collective (`dev.*`) stays, over its operand as lowered: a float in the activation
    type (the partial sums of a bf16 row-parallel matmul are summed in bf16, as the
    devices hold them)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: dev.CollectiveOp, rewriter: PatternRewriter) -> None:
        x = op.input
        want = self.lw.wants(op) if is_float(elem_of(x)) else None
        x = self.lw.operand(x, want, op, rewriter)
        if x is op.input and type(op).infer([x], op.attributes) == [op.output.type]:
            return  # already lowered
        new = type(op).build([x], _attrs(op))
        named_like(new, op)
        rewriter.replace(op, new)


def f32_args(fn: func.FuncOp) -> set[SSAValue]:
    """The function arguments an op stores in f32 whatever the mode (`Storage.F32`: a
    gated_delta_rule's recurrent state): they keep f32, as the op has them (the runtime
    binds the state argument and the returned new_state to one f32 buffer). (An argument
    of another type reaches such an operand through a cast the importer made, and takes
    the activation type like any other.)"""
    out: set[SSAValue] = set()
    for arg in fn.body.block.args:
        for use in arg.uses:
            op = use.operation
            if isinstance(op, ShapedOp):
                present = [s for v, s in zip(op.operand_groups(), op.tpu_operand_storage(),
                                             strict=True) if v is not None]
                if present[use.index] == Storage.F32:
                    out.add(arg)
    return out


class FoldRedundantCasts(RewritePattern):
    """cast to the same type; cast(cast(x)) through a wider float back to x's type."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: top.CastBase, rewriter: PatternRewriter) -> None:
        # (run after the lowering: every cast is a Tpu one)
        if op.input.type == op.output.type:
            rewriter.replace(op, [], [op.input])
            return
        inner = producer(op.input, tpu.CastOp)
        if inner is None:
            return
        src, mid, dst = elem_of(inner.input), elem_of(inner.output), elem_of(op.output)
        if src == dst and dtype_name(mid) == "f32" and is_float(src):
            rewriter.replace(op, [], [inner.input])


def lowering_patterns(lw: Lowering) -> list[RewritePattern]:
    return [LowerMatMul(lw), LowerMoeExperts(lw), LowerCast(lw), LowerToTwin(lw),
            LowerCollective(lw)]


@dataclass(frozen=True)
class ConvertTopToTpuPass(ModulePass):
    """Lower Top to Tpu in a quantization mode (f32, f16, bf16, w8*/w4*)."""

    name = "convert-top-to-tpu"

    mode: str = "f32"
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool | None = None
    keep_float: str = "lm_head"
    keep_input_types: bool = False

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        act, bits = parse_mode(self.mode)
        store = weights_of(ctx, op)
        for fn in [f for f in op.ops if isinstance(f, func.FuncOp)]:
            lw = Lowering(act, bits, self.group_size, self.symmetric,
                          tuple(k.strip() for k in self.keep_float.split(",")), store,
                          _index_derived_ops(fn))
            states = f32_args(fn)
            for arg in fn.body.block.args:
                t = arg.type
                if (isinstance(t, TensorType) and is_float(t.element_type)
                        and not self.keep_input_types):
                    elem = f32 if arg in states else act
                    arg._type = tensor(shape_of(t), elem)  # noqa: SLF001 - signature change
            walker = PatternRewriteWalker(GreedyRewritePatternApplier(lowering_patterns(lw)),
                                          apply_recursively=False)
            walker.rewrite_region(fn.body)  # this function only, with its own Lowering
            ret = fn.body.block.last_op
            assert isinstance(ret, func.ReturnOp)
            rewriter_ops = list(ret.operands)
            for i, v in enumerate(rewriter_ops):
                if (w := producer(v, top.WeightOp)) is not None or producer(v, top.ConstantOp):
                    raise ConversionError(
                        f"output {i} of @{fn.sym_name.data} is a weight/constant "
                        f"({op_name(w) if w else 'constant'}); return a computed value"
                    )
            leftover = [o.name for o in fn.body.walk() if o.name.startswith("top.")
                        and not (isinstance(o, ShapedOp) and o.SOURCE)]
            if leftover:
                raise ConversionError(f"no Tpu lowering for {sorted(set(leftover))}")
            fn.function_type = FunctionType.from_lists(
                [a.type for a in fn.body.block.args], [v.type for v in ret.operands])
        PatternRewriteWalker(GreedyRewritePatternApplier([FoldRedundantCasts()]),
                             post_walk_func=region_dce).rewrite_module(op)
        for o in list(op.walk()):  # the Top sources the lowering left unused
            if (o.name.startswith("top.") and isinstance(o, ShapedOp) and o.SOURCE
                    and not o.results[0].uses):
                o.detach()
                o.erase()
