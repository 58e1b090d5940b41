"""Sparse mixture-of-experts MLPs (Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE, Qwen3-VL-MoE) for the
splitter: transformers' MoE block recognized and run through the two custom ops of
`frontends.moe_ops` (the router's softmax/top-k and the experts: one Top op each), and the
experts' stacked tensors found for every layer, whatever form holds them.

A MoE block is recognized in two module forms:

- **fused** (transformers 5: `Qwen3MoeSparseMoeBlock` and its kin): `experts.gate_up_proj`
  [E, 2I, H] and `experts.down_proj` [E, H, I] (3-D parameters), the router
  `gate.weight` [E, H] with `gate.top_k` and `gate.norm_topk_prob` (Qwen3.5-MoE's and
  Qwen3-VL-MoE's routers always renormalize: no such attribute);
- **per expert** (transformers 4, and remote code): `experts` a `ModuleList` of E SwiGLU
  MLPs (`gate_proj`, `up_proj`, `down_proj` linears without bias), the router `gate` an
  `nn.Linear(H, E)`, `top_k` and `norm_topk_prob` on the block.

Both may carry a shared expert (Qwen2-MoE, Qwen3.5-MoE): `shared_expert` (a SwiGLU MLP),
scaled by `sigmoid(shared_expert_gate(x))` and added to the experts' sum; it is exported
as the ordinary ops it is made of.

The nets read each projection of the experts stacked by expert:
`<layer>.mlp.experts.gate_proj` and `…up_proj` [E, I, H], `…down_proj` [E, H, I] (apart,
so that a layer group can cut the intermediate axis of all three in reduction parts). The
importer makes them (the halves of a fused `gate_up_proj`, a list of modules' linears
stacked), and every layer's are found the same way (`expert_tensor`): from a module's
fused parameters, from its per-expert linears, or from a checkpoint's tensors — fused, or
in the hub layout that `save_pretrained` writes (`model.layers.N.mlp.experts.E.gate_proj
.weight`, one tensor per expert and projection) — one layer at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toptpu.errors import ToptpuError


class MoeError(ToptpuError, ValueError):
    """A mixture-of-experts block toptpu cannot compile as it is; the message says why."""


@dataclass(frozen=True)
class MoeShape:
    """What the nets need to know of a MoE block."""

    experts: int
    top_k: int
    normalize: bool
    hidden: int
    intermediate: int
    fused: bool  # transformers 5's 3-D parameters (else a ModuleList of experts)
    shared: bool  # a shared expert with its sigmoid gate


def is_moe_block(mlp: torch.nn.Module | None) -> bool:
    """Whether `mlp` is a sparse MoE block (experts and a router) rather than a dense MLP."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _linear_weight(module: Any, what: str) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or getattr(module, "bias", None) \
            is not None:
        raise MoeError(f"the MoE block's {what} is not a linear without bias "
                       f"({type(module).__name__}); toptpu cannot compile it")
    return w


def _check_silu(act: Any, where: str) -> None:
    """The experts' activation must be silu: SwiGLU is what the experts op computes."""
    from transformers.activations import SiLUActivation

    if not isinstance(act, torch.nn.SiLU | SiLUActivation):
        raise MoeError(f"the MoE experts of {where} use the activation {type(act).__name__}; "
                       "toptpu's experts op computes SwiGLU with silu")


def moe_shape(mlp: Any) -> MoeShape:
    """The shape of MoE block `mlp` in either form (see the module doc); a MoeError naming
    what does not fit (biased or transposed experts, another activation, a router that is
    no linear)."""
    experts, gate = mlp.experts, mlp.gate
    fused = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
    if fused:
        for flag in ("has_bias", "is_transposed"):
            if getattr(experts, flag, False):
                raise MoeError(f"the MoE experts of {type(experts).__name__} have {flag}; "
                               "toptpu compiles unbiased experts stored [E, 2I, H] / [E, H, I]")
        if not getattr(experts, "has_gate", True) or not getattr(experts, "is_concatenated",
                                                                 True):
            raise MoeError(f"the MoE experts of {type(experts).__name__} are not gate|up "
                           "concatenated SwiGLU MLPs; toptpu cannot compile them")
        _check_silu(getattr(experts, "act_fn", None), type(mlp).__name__)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        n, two_i, h = gate_up.shape
        if tuple(down.shape) != (n, h, two_i // 2):
            raise MoeError(f"the MoE experts' down_proj is {list(down.shape)}; it must be "
                           f"[{n}, {h}, {two_i // 2}]")
        router = gate.weight
        top_k = int(gate.top_k)
        normalize = bool(getattr(gate, "norm_topk_prob", True))
    else:
        if not isinstance(experts, torch.nn.ModuleList) or not len(experts):
            raise MoeError(f"the MoE block's experts ({type(experts).__name__}) are neither "
                           "3-D parameters (gate_up_proj, down_proj) nor a list of MLPs")
        first = experts[0]
        _check_silu(getattr(first, "act_fn", None), type(mlp).__name__)
        ws = [_linear_weight(getattr(first, p, None), f"expert 0's {p}")
              for p in ("gate_proj", "up_proj", "down_proj")]
        n, h = len(experts), ws[0].shape[1]
        two_i = 2 * ws[0].shape[0]
        router = _linear_weight(gate, "router (gate)")
        if not hasattr(mlp, "top_k"):
            raise MoeError(f"the MoE block {type(mlp).__name__} has no top_k")
        top_k = int(mlp.top_k)
        normalize = bool(getattr(mlp, "norm_topk_prob", True))
    if tuple(router.shape) != (n, h):
        raise MoeError(f"the MoE router is {list(router.shape)}; it must be [{n}, {h}] "
                       "(a row per expert)")
    if not 1 <= top_k <= n:
        raise MoeError(f"the MoE block routes each token to {top_k} of {n} experts")
    shared = hasattr(mlp, "shared_expert")
    if shared != hasattr(mlp, "shared_expert_gate"):
        raise MoeError(f"{type(mlp).__name__} has a shared expert without its gate (or a gate "
                       "without the expert); toptpu compiles Qwen2-MoE's shared expert")
    return MoeShape(n, top_k, normalize, int(h), int(two_i) // 2, fused, shared)


def moe_forward(mlp: Any, shape: MoeShape, x: torch.Tensor,
                valid: torch.Tensor | None) -> torch.Tensor:
    """The MoE block `mlp` on x [B, S, H] through the custom ops: its router linear, then
    `moe_route` (a padded row, `valid` <= 0, routes nowhere), `moe_experts`, then its shared
    expert scaled by its sigmoid gate."""
    from toptpu.frontends import moe_ops

    b, s, h = x.shape
    flat = x.reshape(-1, h)
    logits = F.linear(flat, mlp.gate.weight)
    weights, indices = moe_ops.moe_route(logits, shape.top_k, shape.normalize,
                                         None if valid is None else valid.reshape(-1))
    if shape.fused:
        y = moe_ops.moe_experts(flat, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                                weights, indices)
    else:
        experts = mlp.experts
        y = moe_ops.moe_experts_list(flat, [e.gate_proj.weight for e in experts],
                                     [e.up_proj.weight for e in experts],
                                     [e.down_proj.weight for e in experts], weights, indices)
    if shape.shared:
        y = y + torch.sigmoid(mlp.shared_expert_gate(flat)) * mlp.shared_expert(flat)
    return y.reshape(b, s, h)


class MoeMlp(torch.nn.Module):
    """A decoder layer's MLP as the nets compute it: a dense MLP as it is, a MoE block
    through `moe_forward` (`valid` [1, S]: which rows of the chunk are real, None: all)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.shape = moe_shape(mlp) if is_moe_block(mlp) else None

    @property
    def sparse(self) -> bool:
        return self.shape is not None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.shape is None:
            return self.mlp(x)
        return moe_forward(self.mlp, self.shape, x, valid)


# =========================================================================== stacked tensors

#: the projections of an expert, in the hub layout's names
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: transformers 5's fused module: gate and up concatenated along axis 1
FUSED_GATE_UP = "gate_up_proj"


def split_names(fused: str) -> tuple[str, str] | None:
    """The stacked gate and up names the nets read for a fused '…experts.gate_up_proj'
    ('…experts.gate_proj', '…experts.up_proj'); None for another name."""
    base, _, last = fused.rpartition(".")
    if last != FUSED_GATE_UP or not base.endswith("experts"):
        return None
    return f"{base}.gate_proj", f"{base}.up_proj"


_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|"
                     r"down_proj)\.weight$")


def stacked_name(name: str) -> tuple[str, int, str] | None:
    """A hub-layout expert tensor's name -> (the stacked tensor of its projection, its
    expert, its projection): 'model.layers.3.mlp.experts.7.up_proj.weight' ->
    ('model.layers.3.mlp.experts.up_proj', 7, 'up_proj'); None for another name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return f"{m['prefix']}.experts.{m['proj']}", int(m["e"]), m["proj"]


def stacked_shapes(tensors: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]],
                                                                  list[str]]:
    """A checkpoint's tensors (name -> shape) with its hub-layout experts replaced by the
    fused tensors transformers' module holds ([E, 2I, H] '…experts.gate_up_proj', [E, H, I]
    '…experts.down_proj'), and the problems found (an expert or projection missing,
    experts of unequal shapes)."""
    out: dict[str, tuple[int, ...]] = {}
    groups: dict[str, dict[tuple[int, str], tuple[int, ...]]] = {}
    for name, shape in tensors.items():
        hit = stacked_name(name)
        if hit is None:
            out[name] = shape
        else:
            groups.setdefault(hit[0].rpartition(".")[0], {})[(hit[1], hit[2])] = shape
    problems = []
    for base, parts in sorted(groups.items()):
        n = 1 + max(e for e, _ in parts)
        missing = [f"{base}.{e}.{p}.weight" for e in range(n) for p in PROJECTIONS
                   if (e, p) not in parts]
        if missing:
            problems.append(f"missing expert tensors: {', '.join(missing[:4])}"
                            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
            continue
        shapes = {p: {parts[(e, p)] for e in range(n)} for p in PROJECTIONS}
        if any(len(v) != 1 or len(next(iter(v))) != 2 for v in shapes.values()):
            problems.append(f"the experts of {base} have unequal or non-2-D shapes")
            continue
        (gate,), (up,), (down,) = (shapes[p] for p in PROJECTIONS)
        if gate != up or down != (gate[1], gate[0]):
            problems.append(f"the experts of {base} are not SwiGLU MLPs: gate {list(gate)}, "
                            f"up {list(up)}, down {list(down)}")
            continue
        out[f"{base}.{FUSED_GATE_UP}"] = (n, 2 * gate[0], gate[1])
        out[f"{base}.down_proj"] = (n, down[0], down[1])
    return out, problems


def _hub_count(base: str, proj: str, has: Callable[[str], bool]) -> int:
    """How many experts of `base` ('…experts') the source holds projection `proj` of in
    the hub layout (experts 0, 1, ... in a row)."""
    n = 0
    while has(f"{base}.{n}.{proj}.weight"):
        n += 1
    return n


def expert_tensor(name: str, has: Callable[[str], bool], read: Callable[[str], np.ndarray]
                  ) -> np.ndarray | None:
    """A stacked experts' tensor by its name — '…experts.gate_proj', '…experts.up_proj'
    ([E, I, H], what the nets read), '…experts.down_proj' ([E, H, I]) or
    '…experts.gate_up_proj' ([E, 2I, H], transformers' fused form) — from whichever form
    a source holds (`has`: the source has a tensor of that name, `read`: it in float32):
    the tensor itself, the fused gate|up cut in halves, or the hub layout's one tensor per
    expert stacked, one read at a time (transformers' own conversion of a `qwen2_moe`
    checkpoint stacks them by expert and concatenates gate and up). None: `name` is no
    experts' tensor or the source holds none of its forms."""
    if has(name):
        return read(name)
    base, _, proj = name.rpartition(".")
    if not base.endswith(".experts") and base != "experts":
        return None
    if proj in ("gate_proj", "up_proj") and has(f"{base}.{FUSED_GATE_UP}"):
        fused = read(f"{base}.{FUSED_GATE_UP}")
        inter = fused.shape[1] // 2
        half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return np.ascontiguousarray(fused[:, half])
    if proj == FUSED_GATE_UP:
        gate = expert_tensor(f"{base}.gate_proj", has, read)
        up = expert_tensor(f"{base}.up_proj", has, read)
        if gate is None or up is None:
            return None
        return np.concatenate([gate, up], axis=1)
    if proj not in PROJECTIONS:
        return None
    n = _hub_count(base, proj, has)
    if not n:
        return None
    out: np.ndarray | None = None
    for e in range(n):
        a = read(f"{base}.{e}.{proj}.weight")
        if out is None:
            out = np.empty((n, *a.shape), np.float32)
        out[e] = a
    return out


def has_expert_tensor(name: str, has: Callable[[str], bool]) -> bool:
    """`expert_tensor` would find `name` (without reading anything)."""
    if has(name):
        return True
    base, _, proj = name.rpartition(".")
    if not base.endswith(".experts") and base != "experts":
        return False
    if proj in ("gate_proj", "up_proj") and has(f"{base}.{FUSED_GATE_UP}"):
        return True
    if proj == FUSED_GATE_UP:
        return all(has_expert_tensor(f"{base}.{p}", has) for p in ("gate_proj", "up_proj"))
    return proj in PROJECTIONS and _hub_count(base, proj, has) > 0


#: the fused expert parameters, by the last part of their names
FUSED_PARAMETERS = (FUSED_GATE_UP, "down_proj")


def is_fused_parameter(name: str) -> bool:
    """'…mlp.experts.gate_up_proj' or '…mlp.experts.down_proj': a fused module's 3-D
    experts parameter."""
    base, _, last = name.rpartition(".")
    return last in FUSED_PARAMETERS and base.endswith(".experts")


class SwappedExperts:
    """A tensor reader (`frontends.streaming.TensorReader`) over `reader` whose tensors
    `names` are fused experts stored with their last two axes swapped — Qwen3-VL-MoE's
    published checkpoints hold `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], which
    transformers transposes on loading (its `Transpose(1, 2)` conversion) — given in the
    module's layout, [E, 2I, H] and [E, H, I]."""

    def __init__(self, reader: Any, names: set[str]) -> None:
        self.reader = reader
        self.names = names

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def tensor(self, name: str) -> np.ndarray:
        a = self.reader.tensor(name)
        return np.ascontiguousarray(a.swapaxes(1, 2)) if name in self.names else a

    def release(self) -> None:
        self.reader.release()

    def close(self) -> None:
        self.reader.close()
