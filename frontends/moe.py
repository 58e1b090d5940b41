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

The nets read the experts as transformers 5's module holds them, whatever the form:
`<layer>.mlp.experts.gate_up_proj` and `<layer>.mlp.experts.down_proj` (`STACKED`). The
importer stacks a per-expert module's tensors under those names (`stack_expert_weights`),
and every layer's are found the same way (`expert_tensor`): from a module's fused
parameters, from its per-expert linears, or from a checkpoint's tensors in the hub layout
that `save_pretrained` writes (`model.layers.N.mlp.experts.E.gate_proj.weight`, one tensor
per expert and projection: transformers' own `qwen2_moe` conversion stacks them by expert
and concatenates gate and up), one layer at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toptpu.errors import ToptpuError

#: the stacked experts' tensors the nets read, by the name transformers 5's module gives
#: them (after the layer's prefix): projection -> the per-expert linears it stacks, in the
#: order concatenated along axis 1
STACKED: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.experts.down_proj": ("down_proj",),
}


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


def is_moe_block(mlp: torch.nn.Module) -> bool:
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


def moe_shape(mlp: torch.nn.Module) -> MoeShape:
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


def _per_expert(mlp: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-expert block's weights stacked as the fused module holds them."""
    experts = mlp.experts
    gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    down = torch.stack([e.down_proj.weight for e in experts])
    return gate_up, down


def moe_forward(mlp: torch.nn.Module, shape: MoeShape, x: torch.Tensor,
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


def stacked_key(key: str) -> str | None:
    """The `STACKED` name a per-layer key ends with ('mlp.experts.gate_up_proj'), None
    for another key."""
    for name in STACKED:
        if key == name or key.endswith("." + name):
            return name
    return None


_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|"
                     r"down_proj)\.weight$")


def stacked_name(name: str) -> tuple[str, int, str] | None:
    """A hub-layout expert tensor's name -> (the stacked name it goes into, its expert, its
    projection): 'model.layers.3.mlp.experts.7.up_proj.weight' ->
    ('model.layers.3.mlp.experts.gate_up_proj', 7, 'up_proj'); None for another name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    proj = m["proj"]
    stacked = "gate_up_proj" if proj in ("gate_proj", "up_proj") else "down_proj"
    return f"{m['prefix']}.experts.{stacked}", int(m["e"]), proj


def stacked_shapes(tensors: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]],
                                                                  list[str]]:
    """A checkpoint's tensors (name -> shape) with its hub-layout experts replaced by the
    stacked tensors they make ([E, 2I, H] gate_up_proj, [E, H, I] down_proj), and the
    problems found (an expert or projection missing, experts of unequal shapes)."""
    out: dict[str, tuple[int, ...]] = {}
    groups: dict[str, dict[tuple[int, str], tuple[int, ...]]] = {}
    for name, shape in tensors.items():
        hit = stacked_name(name)
        if hit is None:
            out[name] = shape
        else:
            groups.setdefault(hit[0], {})[(hit[1], hit[2])] = shape
    problems = []
    for name, parts in sorted(groups.items()):
        projs = STACKED[f"mlp.experts.{name.rsplit('.', 1)[1]}"]
        n = 1 + max(e for e, _ in parts)
        missing = [f"{name.removesuffix(name.rsplit('.', 1)[1])}{e}.{p}.weight"
                   for e in range(n) for p in projs if (e, p) not in parts]
        shapes = {parts[(e, p)] for e in range(n) for p in projs if (e, p) in parts}
        if missing:
            problems.append(f"missing expert tensors: {', '.join(missing[:4])}"
                            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
            continue
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            problems.append(f"the experts of {name} have unequal or non-2-D shapes "
                            f"{sorted(shapes)[:3]}")
            continue
        rows, cols = next(iter(shapes))
        out[name] = (n, rows * len(projs), cols)
    return out, problems


def hub_expert_names(name: str, experts: int) -> list[list[str]] | None:
    """The hub-layout tensors a stacked tensor is made of ('…mlp.experts.gate_up_proj'):
    per projection, its E experts' names in order; None for another name."""
    for stacked, projs in STACKED.items():
        if name.endswith("." + stacked.rsplit(".", 1)[1]) and ".experts." in name:
            base = name.rsplit(".", 1)[0]
            return [[f"{base}.{e}.{p}.weight" for e in range(experts)] for p in projs]
    return None


def assemble_stacked(name: str, experts: int, read: Callable[[str], np.ndarray]
                     ) -> np.ndarray:
    """The stacked tensor `name` from its hub-layout tensors, each read by `read` (float32)
    and copied into place one at a time: [E, 2I, H] (each expert's gate rows, then its up
    rows) or [E, H, I]."""
    groups = hub_expert_names(name, experts)
    assert groups is not None, name
    out: np.ndarray | None = None
    for p, names in enumerate(groups):
        for e, part in enumerate(names):
            a = read(part)
            if out is None:
                out = np.empty((experts, a.shape[0] * len(groups), a.shape[1]), np.float32)
            out[e, p * a.shape[0]:(p + 1) * a.shape[0]] = a
    assert out is not None
    return out


def expert_count(names: Iterable[str], stacked: str) -> int:
    """How many experts the hub-layout tensors of `stacked` in `names` hold."""
    count = 0
    for name in names:
        hit = stacked_name(name)
        if hit is not None and hit[0] == stacked:
            count = max(count, hit[1] + 1)
    return count


def module_expert_tensor(layer: torch.nn.Module, key: str) -> torch.Tensor | None:
    """A stacked experts' tensor (`STACKED` key) of a decoder layer module in either form;
    None when the layer has no MoE block there."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not is_moe_block(mlp) or stacked_key(key) != key:
        return None
    if isinstance(getattr(mlp.experts, "gate_up_proj", None), torch.Tensor):
        return getattr(mlp.experts, key.rsplit(".", 1)[1])
    gate_up, down = _per_expert(mlp)
    return gate_up if key.endswith("gate_up_proj") else down
