"""tensor-parallel{devices=N chip=...}: one net cut into the program every one of N devices
runs on its own piece of the weights (Megatron-style, TPU-MLIR's DevParallel method), with
the collectives the pieces need placed as `dev` ops.

The pass runs on Top IR after `top-pipeline` (attention fused). It propagates how each value
is split over the devices (`toptpu.dialects.sharding.Split`; a value without one is whole on
every device), op by op in program order, and rewrites each op for its local piece:

- a **matmul** with a weight `b` on a whole input is *column parallel*: `b` (and the bias)
  is cut along its output features, so each device computes its share of the outputs
  (split along the last axis). The projections feeding an attention are cut by heads: q in
  N pieces, k and v in N pieces when the KV heads divide among the devices, else in as many
  pieces as there are KV heads, each replicated on N / kv_heads devices (a model with 2 KV
  heads on 4 devices: devices 0 and 1 share KV head 0); any other such matmul in N pieces
  when N divides its outputs (the MLP's gate and up, the lm_head by vocabulary);
- a matmul whose input is split along its contraction axis (N pieces) is *row parallel*:
  `b` is cut along its inputs, each device holds a partial sum, and a `dev.all_reduce`
  follows it (its bias is added after the sum, once);
- `top.attention` on heads split q / k / v keeps its heads' share (`q_heads / N`,
  `kv_heads / pieces`); its history operands (the KV cache, function arguments) are cut the
  same way, so every device holds only its KV heads' cache;
- reshape, permute, rope, norms over an unsplit axis, elementwise ops and casts follow the
  split of their input (a reshape maps the split axis when the pieces stay contiguous);
- `top.topk` with k = 1 over a split axis (the greedy head on the lm_head's split logits) is
  *merged across devices*: each device takes the top-1 of its piece and makes its index
  global (the piece's offset is a one-element shard weight,
  `tp.offsets.<size>x<pieces>@shard0-<pieces>`), a `dev.all_gather` brings every device's
  value and index together, and a second top-1 over them picks the winner (ties: the lowest
  device, so the lowest id, as one device's argmax);
- any other op given a split value gets it whole first (`dev.all_gather`: the sample head
  gathers the logits, since its repetition penalty reads any id's logit).

A function argument may ask to be split (`dev.split` on it, its type the whole tensor's):
the pass cuts its type and propagates from it (the heads take the lm_head's split logits
so). Each shard weight is a new `top.weight` named `W@shard<axis>-<pieces>`; device 0's piece is
added to the weight store under that name (the compiler cuts every device's piece the same
way, `sharding.take_piece`). Function arguments and results that end up split carry
`dev.split` (the runtime binds each device its piece). A collective's `algorithm` is the one
`toptpu.backend.target.link.best_algorithm` finds cheaper on `chip`'s link for its bytes.

Every device runs the same program; what differs is its weights and its pieces of the
split inputs. Ops whose values cannot be cut as the model needs (heads that do not divide)
are a `ShardingError` naming the op and the counts.

**expert-parallel{devices=N chip=...}** (`ExpertParallelPass`, `--parallel ep`) cuts only a
mixture of experts' experts, with the same building blocks: every `top.moe_experts` reads
its E/N experts (gate, up and down cut along axis 0, `W@shard0-<N>`: device d holds experts
[d E/N, (d+1) E/N)), the routing indices are made local on each device — minus the device's
first expert (a one-element shard weight, `tp.offsets.<E/N>x<N>@shard0-<N>`, as the
merged top-1's), any index outside [0, E/N) (another device's expert, or a padded row's -1)
made -1, which adds nothing — and a `dev.all_reduce` sums the devices' partial results
after it. Everything else (attention, norms, the router, a shared expert) stays whole and
is computed on every device alike; no net input or output is split. A pre-quantized
checkpoint's tensors of a stacked projection (`passes.quantize.checkpoint_key` annexes:
integers, scales, zero points or mins, each stacked by expert) are cut along E with it, so
the lowering takes each device's experts' integers as they are. A token's k may exceed
E/N: the local op's slots naming other devices' experts are -1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType
from xdsl.ir import Attribute, BlockArgument, Operation, OpResult, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from toptpu.backend.target.chips import DEFAULT_CHIP, get_chip
from toptpu.backend.target.cost import nbytes
from toptpu.backend.target.link import best_algorithm
from toptpu.dialects import dev, top
from toptpu.dialects.common import (
    ComparePredicate,
    ShapedOp,
    elem_of,
    i32,
    ints_value_attr,
    norm_axis,
    read_bool,
    read_float,
    read_int,
    read_ints,
    shape_of,
)
from toptpu.dialects.naming import op_name, set_name
from toptpu.dialects.sharding import (
    ShardingError,
    Split,
    arg_split,
    set_arg_split,
    set_result_split,
    shard_name,
    take_piece,
)
from toptpu.dialects.top import weight_name
from toptpu.dialects.weight_store import WeightStore, weights_of
from toptpu.passes.quantize import checkpoint_key
from toptpu.passes.util import producer, require_level

#: a pre-quantized checkpoint's tensors of a weight (`passes.quantize.CHECKPOINT_TAG`); all
#: but `meta` (bits and group size) stacked by expert for a MoE projection
CHECKPOINT_FIELDS = ("qweight", "scales", "zeros", "mins", "meta")

#: ops a projection's output passes through on its way into an attention (traced back)
_TRACE_THROUGH = (top.ReshapeOp, top.PermuteOp, top.RopeOp, top.RmsNormOp, top.CastOp)


def offsets_name(size: int, pieces: int) -> str:
    """The weight of every piece's first index along an axis of `size` cut in `pieces`."""
    return f"tp.offsets.{size}x{pieces}"


@dataclass
class _Sharder:
    fn: func.FuncOp
    store: WeightStore
    devices: int
    chip_name: str

    def __post_init__(self) -> None:
        self.split: dict[SSAValue, Split] = {}
        #: split values gathered whole so far (one all-gather serves every later use)
        self.whole: dict[SSAValue, SSAValue] = {}
        #: shard weights made so far, by name (one op serves every later use)
        self.shards: dict[str, SSAValue] = {}
        #: projections feeding an attention -> how many pieces their outputs are cut in
        self.pieces: dict[Operation, int] = {}
        self.chip = get_chip(self.chip_name)
        self.rewriter = Rewriter()

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        block = self.fn.body.block
        for i, arg in enumerate(block.args):
            s = arg_split(self.fn, i)
            if s is not None:  # asked for: the argument's type is the whole's, now cut
                t = arg.type
                assert isinstance(t, TensorType)
                arg._type = TensorType(t.element_type,  # noqa: SLF001 - signature change
                                       s.part_shape(shape_of(t)))
                self.split[arg] = s
        self.plan_heads()
        for op in list(block.ops):
            if isinstance(op, func.ReturnOp):
                self.finish(op)
            elif not (isinstance(op, ShapedOp) and op.SOURCE):
                self.visit(op)
        for op in list(block.ops):  # the whole weights the shards replaced
            if op.results and weight_name(op.results[0]) is not None \
                    and not op.results[0].uses:
                self.rewriter.erase_op(op)

    def finish(self, ret: func.ReturnOp) -> None:
        for i, v in enumerate(ret.operands):
            set_result_split(self.fn, i, self.split.get(v))
        self.fn.function_type = FunctionType.from_lists(
            [a.type for a in self.fn.body.block.args], [v.type for v in ret.operands])

    # ------------------------------------------------------------------ planning
    def plan_heads(self) -> None:
        """How many pieces each projection feeding an attention is cut in (by heads)."""
        n = self.devices
        for att in [o for o in self.fn.walk() if isinstance(o, top.AttentionOp)]:
            q_heads, kv_heads = read_int(att.q_heads), read_int(att.kv_heads)
            where = op_name(att) or att.name
            if q_heads % n:
                raise ShardingError(f"{where}: {q_heads} query heads do not divide among "
                                    f"{n} devices")
            kv_pieces = self.kv_pieces(kv_heads, where)
            for value, pieces in ((att.q, n), (att.k, kv_pieces), (att.v, kv_pieces)):
                mm = self.projection(value)
                if mm is None:
                    raise ShardingError(f"{where}: no projection (a matmul with a weight) "
                                        "feeds its q/k/v through reshape, permute, rope or a "
                                        "norm: this attention cannot be cut by heads")
                if self.pieces.get(mm, pieces) != pieces:
                    raise ShardingError(f"{op_name(mm)} feeds attention heads cut two ways")
                self.pieces[mm] = pieces

    def kv_pieces(self, kv_heads: int, where: str) -> int:
        n = self.devices
        if kv_heads % n == 0:
            return n
        if n % kv_heads == 0:
            return kv_heads  # each KV head replicated on n / kv_heads devices
        raise ShardingError(f"{where}: {kv_heads} KV heads and {n} devices: neither divides "
                            "the other, so the KV heads cannot be spread or replicated evenly")

    @staticmethod
    def projection(v: SSAValue) -> top.MatMulOp | None:
        while True:
            mm = producer(v, top.MatMulOp)
            if mm is not None:
                return mm if producer(mm.rhs, top.WeightOp) is not None else None
            owner = v.owner if isinstance(v, OpResult) else None
            if not isinstance(owner, _TRACE_THROUGH):
                return None
            v = owner.operands[0]

    # ------------------------------------------------------------------ rewriting
    # `visit` has a rule per op class that needs one (the op's class picks it, as xDSL's
    # op_type_rewrite_pattern does); any other op follows its input's split when it is
    # elementwise (`ShapedOp.ELEMENTWISE`) and takes its inputs whole otherwise
    @functools.singledispatchmethod
    def visit(self, op: Operation) -> None:
        if isinstance(op, ShapedOp) and op.ELEMENTWISE:
            self.follow(op, reduced_axis=None)
        else:
            self.gather_inputs(op)

    @visit.register
    def _row_local(self, op: top.RopeOp | top.RmsNormOp) -> None:
        """rope and rms_norm mix their last axis only."""
        self.follow(op, reduced_axis=len(shape_of(op.output)) - 1)

    @visit.register
    def _softmax(self, op: top.SoftmaxOp) -> None:
        self.follow(op, reduced_axis=norm_axis(read_int(op.axis), len(shape_of(op.input))))

    @visit.register
    def matmul(self, op: top.MatMulOp) -> None:
        w = producer(op.rhs, top.WeightOp)
        x_split = self.split.get(op.lhs)
        if w is None or read_bool(op.transpose_a):
            self.gather_inputs(op)
            return
        tb = read_bool(op.transpose_b)
        rank = len(shape_of(op.lhs))
        b_shape = shape_of(op.rhs)
        n_axis, k_axis = (0, 1) if tb else (1, 0)
        if len(b_shape) != 2:
            self.gather_inputs(op)
            return
        if x_split is None:  # column parallel
            pieces = self.pieces.get(op, self.devices)
            if b_shape[n_axis] % pieces:
                return  # stays whole on every device
            rhs = self.shard_weight(w, Split(n_axis, pieces), op)
            bias = None
            if op.bias is not None:
                bw = producer(op.bias, top.WeightOp)
                if bw is None:
                    raise ShardingError(f"{op_name(op)}: a bias that is not a weight")
                bias = self.shard_weight(bw, Split(len(shape_of(op.bias)) - 1, pieces), op)
            new = self.rebuild(op, [op.lhs, rhs, bias])
            self.split[new.results[0]] = Split(rank - 1, pieces)
            return
        if x_split.axis == rank - 1 and x_split.pieces == self.devices:  # row parallel
            rhs = self.shard_weight(w, Split(k_axis, self.devices), op)
            new = self.rebuild(op, [op.lhs, rhs, None])
            total = self.all_reduce(new.results[0], op)
            out = total
            if op.bias is not None:
                add = top.AddOp.build([total, op.bias])
                set_name(add, f"{op_name(op)}.bias", like=op)
                assert isinstance(total.owner, Operation)  # the all-reduce
                self.rewriter.insert_op(add, InsertPoint.after(total.owner))
                out = add.results[0]
            new.results[0].replace_uses_with_if(out, lambda u: u.operation is not total.owner)
            return
        self.gather_inputs(op)

    @visit.register
    def attention(self, op: top.AttentionOp) -> None:
        n = self.devices
        kv_pieces = self.kv_pieces(read_int(op.kv_heads), op_name(op) or op.name)
        want = {op.q: Split(2, n), op.k: Split(2, kv_pieces), op.v: Split(2, kv_pieces)}
        if any(self.split.get(v) != s for v, s in want.items()):
            raise ShardingError(f"{op_name(op)}: q/k/v are not cut by heads as planned")
        if op.mask is not None and self.split.get(op.mask) is not None:
            raise ShardingError(f"{op_name(op)}: a mask split over the devices")
        history = []
        for h in (op.history_k, op.history_v):
            if h is not None:
                self.claim_arg(h, Split(2, kv_pieces), op)
            history.append(h)
        new = type(op)(op.q, op.k, op.v, op.mask, *history, scale=read_float(op.scale),
                       q_heads=read_int(op.q_heads) // n,
                       kv_heads=read_int(op.kv_heads) // kv_pieces,
                       head_dim=read_int(op.head_dim), causal=read_bool(op.causal))
        self.replace(op, new)
        self.split[new.results[0]] = Split(2, n)

    def claim_arg(self, v: SSAValue, split: Split, user: Operation) -> None:
        """Cut a function argument (a KV cache): each device binds its piece."""
        have = self.split.get(v)
        if have == split:
            return
        if have is not None or not isinstance(v, BlockArgument):
            raise ShardingError(f"{op_name(user)}: its history operand is not a whole "
                                "function argument to cut by heads")
        if any(u.operation is not user for u in v.uses):
            raise ShardingError(f"{op_name(user)}: the KV cache argument has other users")
        t = v.type
        assert isinstance(t, TensorType)
        v._type = TensorType(t.element_type, split.part_shape(shape_of(t)))  # noqa: SLF001
        set_arg_split(self.fn, v.index, split)
        self.split[v] = split

    @visit.register
    def reshape(self, op: top.ReshapeOp) -> None:
        s = self.split.get(op.input)
        if s is None:
            return
        src, dst = s.whole_shape(shape_of(op.input)), tuple(read_ints(op.shape))
        axis = _reshaped_axis(src, dst, s)
        if axis is None:
            self.gather_inputs(op)
            return
        out = Split(axis, s.pieces)
        local = list(out.part_shape(dst))
        new = type(op).build([op.input], {**_attrs(op), "shape": _ints(local)})
        self.replace(op, new)
        self.split[new.results[0]] = out

    @visit.register
    def permute(self, op: top.PermuteOp) -> None:
        s = self.split.get(op.input)
        if s is None:
            return
        order = read_ints(op.order)
        new = type(op).build([op.input], _attrs(op))
        self.replace(op, new)
        self.split[new.results[0]] = Split(order.index(s.axis), s.pieces)

    def follow(self, op: Operation, reduced_axis: int | None) -> None:
        """An op computed piece by piece when its split operands share one split, its other
        operands broadcast along that axis, and the split is not the axis it reduces over
        (`reduced_axis`, of its result; None: none)."""
        splits = {self.split[v] for v in op.operands if v in self.split}
        if not splits:
            return
        if len(splits) > 1:
            self.gather_inputs(op)
            return
        s = splits.pop()
        rank = len(shape_of(op.results[0]))
        if s.axis == reduced_axis:
            self.gather_inputs(op)
            return
        operands: list[SSAValue] = []
        for v in op.operands:
            if v in self.split:
                operands.append(v)
                continue
            shape = shape_of(v)
            axis = s.axis - (rank - len(shape))
            if axis < 0 or shape[axis] == 1:
                operands.append(v)  # broadcast along the split axis
                continue
            w = producer(v, top.WeightOp)
            if w is None:
                self.gather_inputs(op)
                return
            operands.append(self.shard_weight(w, Split(axis, s.pieces), op))
        # the ignore below: an op of groups
        new = type(op).build(_groups(op, operands), _attrs(op))  # type: ignore[attr-defined]
        self.replace(op, new)
        for r in new.results:
            self.split[r] = s

    @visit.register
    def topk(self, op: top.TopKOp) -> None:
        """The top-1 over a split axis, merged across the devices."""
        s = self.split.get(op.input)
        if s is None:
            self.gather_inputs(op)
            return
        shape = shape_of(op.input)  # the local piece's
        axis = read_int(op.axis) % len(shape)
        if (read_int(op.k) != 1 or s.axis != axis or s.pieces != self.devices
                or any(d != 1 for i, d in enumerate(shape) if i != axis)
                or not read_bool(op.largest, True)):
            self.gather_inputs(op)
            return
        n, name = self.devices, op_name(op) or "topk"
        local = type(op).build([op.input], _attrs(op))
        set_name(local, f"{name}.local", like=op)
        size = shape[axis]
        base = offsets_name(size, n)
        self.store[base] = (np.arange(n, dtype=np.int32) * size)
        off = self.new_weight(shard_name(base, Split(0, n)), (1,), i32, op,
                              take_piece(self.store[base], Split(0, n), 0, n))
        index = top.AddOp.build([local.results[1], off])
        set_name(index, f"{name}.global_index", like=op)
        gv = self.gather(local.results[0], Split(axis, n), name + ".values")
        gi = self.gather(index.results[0], Split(axis, n), name + ".indices")
        best = type(op).build([gv.results[0]], _attrs(op))
        set_name(best, f"{name}.merge", like=op)
        pick = top.GatherOp(gi.results[0], best.results[1], axis)
        set_name(pick, f"{name}.winner", like=op)
        token = top.ReshapeOp(pick.output, list(shape_of(op.results[1])))
        set_name(token, name, like=op)
        self.rewriter.insert_op([local, index, gv, gi, best, pick, token], InsertPoint.before(op))
        op.results[0].replace_all_uses_with(best.results[0])
        op.results[1].replace_all_uses_with(token.output)
        self.rewriter.erase_op(op)

    def gather_inputs(self, op: Operation) -> None:
        """Give `op` the whole of every split operand (an all-gather before it)."""
        for i, v in enumerate(op.operands):
            s = self.split.get(v)
            if s is None:
                continue
            if s.pieces != self.devices:
                raise ShardingError(f"{op_name(op) or op.name} needs the whole of a tensor "
                                    f"cut in {s.pieces} pieces replicated over "
                                    f"{self.devices} devices")
            if v not in self.whole:
                g = self.gather(v, s, f"{_value_label(v)}.gather")
                self.rewriter.insert_op(g, InsertPoint.before(op))
                self.whole[v] = g.results[0]
            op.operands[i] = self.whole[v]

    # ------------------------------------------------------------------ building blocks
    def shard_weight(self, w: top.WeightOp, split: Split, user: Operation) -> SSAValue:
        """A new `top.weight` of `w`'s piece (device 0's in the store), read by `user`."""
        name = shard_name(w.tensor_name, split)
        if name in self.shards:
            return self.shards[name]
        if name not in self.store:
            self.store[name] = np.ascontiguousarray(
                take_piece(self.store[w.tensor_name], split, 0, self.devices))
        part = split.part_shape(tuple(shape_of(w.output)))
        v = self.new_weight(name, part, elem_of(w.output), user)
        v.name_hint = f"{w.output.name_hint or 'weight'}_shard"
        self.shards[name] = v
        return v

    def new_weight(self, name: str, shape: tuple[int, ...], elem: Attribute, user: Operation,
                   value: np.ndarray | None = None) -> SSAValue:
        if value is not None and name not in self.store:
            self.store[name] = np.ascontiguousarray(value)
        op = top.WeightOp(name, TensorType(elem, shape))
        set_name(op, name)
        self.rewriter.insert_op(op, InsertPoint.before(user))
        return op.output

    def all_reduce(self, partial: SSAValue, user: Operation) -> SSAValue:
        alg = best_algorithm(self.chip, "all_reduce", self.devices, nbytes(partial))
        op = dev.AllReduceOp(partial, self.devices, alg)
        set_name(op, f"{op_name(user) or user.name}.all_reduce", like=user)
        op.output.name_hint = f"{partial.name_hint or 'partial'}_sum"
        assert isinstance(partial.owner, Operation)  # the rebuilt op's result
        self.rewriter.insert_op(op, InsertPoint.after(partial.owner))
        return op.output

    def gather(self, v: SSAValue, s: Split, name: str) -> dev.AllGatherOp:
        whole = nbytes(v) * s.pieces
        alg = best_algorithm(self.chip, "all_gather", self.devices, whole)
        op = dev.AllGatherOp(v, s.axis, self.devices, alg)
        set_name(op, name)
        op.output.name_hint = f"{v.name_hint or 'part'}_whole"
        return op

    def rebuild(self, op: top.MatMulOp, operands: list[SSAValue | None]) -> Operation:
        new = type(op).build(operands, _attrs(op))
        self.replace(op, new)
        return new

    def replace(self, op: Operation, new: Operation) -> None:
        new.location = op.location
        for old, r in zip(op.results, new.results, strict=True):
            r.name_hint = old.name_hint
        self.rewriter.replace_op(op, new)


def _attrs(op: Operation) -> dict[str, Attribute]:
    return {k: v for k, v in op.attributes.items() if k != "operandSegmentSizes"}


def _groups(op: Operation, operands: list[SSAValue]) -> list[SSAValue | None]:
    """`operands` (the op's operands, in order) as its operand groups (absent optional
    operands as None)."""
    groups: list[SSAValue | None] = []
    it = iter(operands)
    for g in op.operand_groups():  # type: ignore[attr-defined]  # an op of operand groups
        groups.append(None if g is None else next(it))
    return groups


def _ints(values: list[int]) -> Attribute:
    return ints_value_attr("shape", values)


def _value_label(v: SSAValue) -> str:
    if isinstance(v, OpResult):
        return op_name(v.owner) or v.owner.name
    return v.name_hint or "input"


def _reshaped_axis(src: tuple[int, ...], dst: tuple[int, ...], s: Split) -> int | None:
    """The axis of `dst` that carries `src`'s split axis when every piece stays one
    contiguous block: the elements before it match and it divides into the pieces."""
    before = int(np.prod(src[:s.axis]))
    for b in range(len(dst)):
        if int(np.prod(dst[:b])) == before and dst[b] % s.pieces == 0 and dst[b] > 1:
            inner_src = src[s.axis] // s.pieces * int(np.prod(src[s.axis + 1:]))
            inner_dst = dst[b] // s.pieces * int(np.prod(dst[b + 1:]))
            if inner_src == inner_dst:
                return b
    return None


@dataclass(frozen=True)
class TensorParallelPass(ModulePass):
    """Cut every function for `devices` devices (tensor parallel), collectives placed."""

    name = "tensor-parallel"

    devices: int = 2
    chip: str = DEFAULT_CHIP

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        if self.devices < 2:
            raise ShardingError(f"tensor-parallel needs at least 2 devices, not {self.devices}")
        store = weights_of(ctx, op)
        for fn in [f for f in op.ops if isinstance(f, func.FuncOp)]:
            _Sharder(fn, store, self.devices, self.chip).run()


# ====================================================================== expert parallel


@dataclass
class _ExpertSharder(_Sharder):
    """Cuts a function's experts over the devices (see the module doc), nothing else."""

    def run(self) -> None:
        for experts in [o for o in self.fn.body.block.ops if isinstance(o, top.MoeExpertsOp)]:
            self.experts(experts)
        for op in list(self.fn.body.block.ops):  # the whole experts the shards replaced
            if op.results and weight_name(op.results[0]) is not None \
                    and not op.results[0].uses:
                self.rewriter.erase_op(op)

    def experts(self, op: top.MoeExpertsOp) -> None:
        n, e = self.devices, op.experts
        where = op_name(op) or op.name
        if e % n:
            raise ShardingError(f"{where}: {e} experts do not divide among {n} devices")
        stacked = [producer(v, top.WeightOp) for v in (op.gate, op.up, op.down)]
        if any(w is None for w in stacked):
            raise ShardingError(f"{where}: its experts are not weights (top.weight) to cut "
                                "over the devices")
        if elem_of(op.indices) != i32:
            raise ShardingError(f"{where}: its indices are {elem_of(op.indices)}, not the "
                                "router's i32")
        gate, up, down = (self.shard_experts(w, op) for w in stacked if w)
        per = e // n
        base = offsets_name(per, n)
        self.store[base] = np.arange(n, dtype=np.int32) * per
        first = self.new_weight(shard_name(base, Split(0, n)), (1,), i32, op,
                                take_piece(self.store[base], Split(0, n), 0, n))
        const = {v: top.ConstantOp(np.array([v], np.int32)) for v in (per, -1)}
        rel = top.SubOp.build([op.indices, first])
        mine = top.CompareOp(rel.results[0], const[per].output, ComparePredicate.LT)
        kept = top.WhereOp(mine.output, rel.results[0], const[-1].output)
        local = top.ClampOp(kept.output, min=-1)
        name = f"{where}.local_indices"
        first.name_hint = "first_expert"
        for o, label in ((const[per], "experts_per_device"), (const[-1], "nowhere"),
                         (rel, "relative_indices"), (mine, "held"),
                         (kept, "held_or_nowhere"), (local, "")):
            set_name(o, f"{name}.{label}" if label else name, like=op)
            o.results[0].name_hint = label or "local_indices"
        self.rewriter.insert_op([*const.values(), rel, mine, kept, local],
                                InsertPoint.before(op))
        new = type(op)(op.x, gate, up, down, op.weights, local.output)
        self.replace(op, new)
        total = self.all_reduce(new.output, new)
        new.output.replace_uses_with_if(total, lambda u: u.operation is not total.owner)

    def shard_experts(self, w: top.WeightOp, op: top.MoeExpertsOp) -> SSAValue:
        """The device's experts of a stacked projection (cut along E); a pre-quantized
        checkpoint's tensors of it (`passes.quantize.checkpoint_key` annexes: the integers,
        scales, zero points or mins, each stacked by expert) cut alike, so the lowering
        takes the device's experts' integers as they are."""
        split = Split(0, self.devices)
        cut = self.shard_weight(w, split, op)
        shard = shard_name(w.tensor_name, split)
        if checkpoint_key(w.tensor_name, "g_idx") in self.store:
            raise ShardingError(f"{op_name(op) or op.name}: its experts are act-order "
                                "(g_idx), which toptpu does not take for experts")
        for field in CHECKPOINT_FIELDS:
            key = checkpoint_key(w.tensor_name, field)
            if key in self.store and checkpoint_key(shard, field) not in self.store:
                whole = self.store[key]
                self.store[checkpoint_key(shard, field)] = whole if field == "meta" else \
                    np.ascontiguousarray(take_piece(whole, split, 0, self.devices))
        return cut


@dataclass(frozen=True)
class ExpertParallelPass(ModulePass):
    """Cut every function's experts over `devices` devices (expert parallel), an all-reduce
    after each experts op."""

    name = "expert-parallel"

    devices: int = 2
    chip: str = DEFAULT_CHIP

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        require_level(op, "top", self.name)
        if self.devices < 2:
            raise ShardingError(f"expert-parallel needs at least 2 devices, not {self.devices}")
        store = weights_of(ctx, op)
        for fn in [f for f in op.ops if isinstance(f, func.FuncOp)]:
            _ExpertSharder(fn, store, self.devices, self.chip).run()
