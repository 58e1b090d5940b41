"""GPTQ of a mixture-of-experts layer's routed experts (Qwen3-MoE, Qwen2-MoE).

transformers holds a layer's experts fused (`mlp.experts`: ``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], each expert ``act(x gate^T) * (x up^T) down^T`` on the tokens the
router sent it). Each expert is calibrated as three linears of its own, GPTQ's
sequential rule kept within the expert:

1. gate and up: the Hessian of the layer's tokens routed to that expert (the router's
   top-k choice, from the layer's inputs as the quantized layers before it and the
   quantized attention give them; the router itself stays float and is not changed);
2. down: the Hessian of ``act(x gate_q^T) * (x up_q^T)`` on the same tokens, the
   expert's gate and up already quantized.

An expert no calibration token chose has no Hessian: it is rounded to nearest on the same
grid (`grid.rtn`), and the calibration names it (`ExpertsResult.unrouted`, a progress line,
the checkpoint's ``quantization_config.calibration.rtn_experts``), never silently.

Each forward stops as soon as the experts' inputs are seen. The per-expert Hessians are
accumulated for as many experts at a time as fit in `hessian_bytes` (K x K float32 each;
more forwards where they do not all fit), so memory stays bounded by the layer, its
activations and that budget whatever the number of experts. The dequantized integers are
written into the fused parameters (the layer then computes with them); the integers are
exported one GPTQ linear per expert (``mlp.experts.E.gate_proj`` ..., the layout auto-round
writes and `frontends.quant` stacks back by expert).

AWQ of the experts is `awq`'s (its module doc); it reads them through the helpers here
(`expert_weight`: one expert's linear as a view of the fused parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from toptpu.weight_calibration.activations import LayerInputs, layer_inputs
from toptpu.weight_calibration.gptq import HessianAccumulator, gptq, prepare_hessian
from toptpu.weight_calibration.grid import CalibrationError, QuantizedWeights, QuantScheme, rtn

if TYPE_CHECKING:
    from toptpu.weight_calibration.layers import LayerRunner

#: the path of a MoE layer's MoE block (router, experts, shared expert) and fused experts
MOE_BLOCK = "mlp"
EXPERTS = f"{MOE_BLOCK}.experts"
#: the per-expert linears, in the order they are calibrated
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fused_experts(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's fused experts (module doc), or None for a layer without them."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if not isinstance(experts, torch.nn.Module) or not hasattr(experts, "gate_up_proj"):
        return None
    if getattr(experts, "is_transposed", False):
        raise CalibrationError("experts stored transposed ([E, H, 2I]) are not calibrated")
    return experts


def fused_parameter(experts: torch.nn.Module, name: str) -> torch.Tensor:
    """The fused experts' `gate_up_proj` or `down_proj`."""
    t = getattr(experts, name)
    assert isinstance(t, torch.Tensor)
    return t


def expert_shapes(experts: torch.nn.Module) -> tuple[int, int, int]:
    """(experts, intermediate I, hidden H)."""
    e, two_i, h = fused_parameter(experts, "gate_up_proj").shape
    return int(e), int(two_i) // 2, int(h)


def expert_weight(experts: torch.nn.Module, expert: int, proj: str) -> torch.Tensor:
    """A view of `expert`'s `proj` (`PROJECTIONS`) weight in the fused parameters: gate and
    up [I, H] (rows of ``gate_up_proj``), down [H, I]; writing it writes the layer's."""
    _, inter, _ = expert_shapes(experts)
    if proj == "down_proj":
        return fused_parameter(experts, "down_proj").data[expert]
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return fused_parameter(experts, "gate_up_proj").data[expert, rows]


def expert_linear(name: str, prefix: str = EXPERTS) -> tuple[int, str] | None:
    """(expert, projection) of a per-expert linear name ``{prefix}.E.gate_proj`` ..., or
    None for any other name."""
    head, _, rest = name.partition(prefix + ".")
    parts = rest.split(".")
    if head or len(parts) != 2 or not parts[0].isdigit() or parts[1] not in PROJECTIONS:
        return None
    return int(parts[0]), parts[1]


def expert_linears(experts: torch.nn.Module, prefix: str = EXPERTS) -> list[str]:
    """Every per-expert linear name of the fused `experts` (export order)."""
    return [f"{prefix}.{e}.{p}" for e in range(expert_shapes(experts)[0]) for p in PROJECTIONS]


def experts_fit(experts: torch.nn.Module, scheme: QuantScheme) -> bool:
    """Whether the GPTQ layout holds each expert's gate/up [I, H] and down [H, I]."""
    _, i, h = expert_shapes(experts)
    return scheme.fits(i, h) and scheme.fits(h, i)


@dataclass
class ExpertsResult:
    #: 'mlp.experts.E.gate_proj' ... -> its integers
    weights: dict[str, QuantizedWeights] = field(default_factory=dict)
    #: GPTQ's loss per expert linear
    losses: dict[str, float] = field(default_factory=dict)
    #: the experts no calibration token was routed to (rounded to nearest)
    unrouted: list[int] = field(default_factory=list)
    #: tokens routed to each expert
    tokens: list[int] = field(default_factory=list)


def routed_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, H], top-k expert indices [T, k]) of the experts' call."""
    names = ("hidden_states", "top_k_index")
    vals = [args[i] if len(args) > i else kwargs[n] for i, n in enumerate(names)]
    return vals[0], vals[1]


def routed_rows(index: torch.Tensor, expert: int) -> torch.Tensor:
    """The token rows routed to `expert` (ascending) by the top-k indices [T, k]."""
    return torch.nonzero((index == expert).any(-1)).reshape(-1)


def expert_intermediate(experts: torch.nn.Module, expert: int, x: torch.Tensor
                        ) -> torch.Tensor:
    """``act(x gate^T) * (x up^T)`` of `expert` on its rows `x` (down_proj's input), with
    the fused parameters as they are now."""
    gate_up = fused_parameter(experts, "gate_up_proj")[expert]
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    act = cast(Callable[[torch.Tensor], torch.Tensor], experts.act_fn)
    return act(gate) * up


def _accumulate(runner: LayerRunner, x: LayerInputs, experts: torch.nn.Module,
                chosen: list[int], width: int, dtype: str, down: bool
                ) -> dict[int, HessianAccumulator]:
    """The Hessians of `chosen` experts' gate/up inputs (or down's, `down`) over every
    calibration batch of `x` (each forward stopped at the experts)."""
    accs = {e: HessianAccumulator(width, dtype) for e in chosen}

    def hook(_m: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden, index = routed_inputs(args, kwargs)
        x = hidden.reshape(-1, hidden.shape[-1])
        for e, acc in accs.items():
            rows = routed_rows(index, e)
            if rows.numel():
                xe = x[rows]
                acc.add(expert_intermediate(experts, e, xe) if down else xe)

    runner.see_inputs(experts, x, hook, with_kwargs=True)
    return accs


@torch.no_grad()
def calibrate_experts(runner: LayerRunner, x: torch.Tensor | LayerInputs, experts: torch.nn.Module,
                      scheme: QuantScheme, method: str = "gptq", *, act_order: bool = True,
                      percdamp: float = 0.01, block_size: int = 128, dtype: str = "float32",
                      hessian_bytes: int = 1 << 28, prefix: str = EXPERTS,
                      ranges: str = "minmax") -> ExpertsResult:
    """The routed `experts` of the layer `runner` runs quantized (module doc) by GPTQ
    (`method` "gptq", on the layer's inputs `x`; its grids by `ranges`) or rounded to
    nearest ("rtn");
    afterwards the fused parameters hold the dequantized weights."""
    x = layer_inputs(x)
    n_exp, inter, hidden = expert_shapes(experts)
    if not experts_fit(experts, scheme):
        raise CalibrationError(f"{prefix}: experts of {inter} x {hidden} do not fit "
                               f"{scheme.bits}-bit groups of {scheme.group_length(hidden)} "
                               f"/ {scheme.group_length(inter)}")
    out = ExpertsResult(tokens=[0] * n_exp)
    gate_up = fused_parameter(experts, "gate_up_proj").data
    down_w = fused_parameter(experts, "down_proj").data

    def put(e: int, proj: str, qw: QuantizedWeights, loss: float | None) -> None:
        name = f"{prefix}.{e}.{proj}"
        out.weights[name] = qw
        if loss is not None:
            out.losses[name] = loss
        w = torch.from_numpy(qw.dequantize())
        if proj == "gate_proj":
            gate_up[e, :inter] = w
        elif proj == "up_proj":
            gate_up[e, inter:] = w
        else:
            down_w[e] = w

    def weight(e: int, proj: str) -> Any:
        w = {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:],
             "down_proj": down_w[e]}[proj]
        return w.detach().numpy()

    if method == "rtn":
        for e in range(n_exp):
            for proj in PROJECTIONS:
                put(e, proj, rtn(weight(e, proj), scheme), None)
        return out
    if method != "gptq":
        raise CalibrationError(f"experts are calibrated by gptq or rtn, not '{method}'")

    def one(e: int, acc: HessianAccumulator, projs: tuple[str, ...]) -> None:
        prepared = prepare_hessian(acc.hessian(), act_order=act_order, percdamp=percdamp)
        for proj in projs:
            res = gptq(weight(e, proj), prepared, scheme, act_order=act_order,
                       block_size=block_size, ranges=ranges)
            put(e, proj, res.weights, res.loss)

    for width, projs, down in ((hidden, ("gate_proj", "up_proj"), False),
                               (inter, ("down_proj",), True)):
        per_pass = max(1, hessian_bytes // (width * width * 4))
        for start in range(0, n_exp, per_pass):
            chosen = list(range(start, min(start + per_pass, n_exp)))
            accs = _accumulate(runner, x, experts, chosen, width, dtype, down)
            for e, acc in accs.items():
                if not down:
                    out.tokens[e] = acc.rows
                if acc.rows == 0:
                    if not down:
                        out.unrouted.append(e)
                    for proj in projs:
                        put(e, proj, rtn(weight(e, proj), scheme), None)
                else:
                    one(e, acc, projs)
            del accs
    return out
