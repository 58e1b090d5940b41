"""`toptpu estimate` of a Qwen vision-language model (Qwen2.5-VL, Qwen3-VL, Qwen3.5) from its
config.json alone: the text model's estimate (`toptpu.estimate`, its full-attention nets
with M-RoPE positions [3, n]) plus the vision side, charged as the runtime charges it.

- The `vit` net over the patch budget (`--max-pixels W,H` or `--max-patches`, as
  `toptpu compile` takes them) is compiled with placeholder weights in the vision mode
  (`--vision-quantize`, default the activation type of `-q`) and timed by the chip's cost
  model. One image (or video) is one run: every vit input written to the chip, the net, its
  rows (and Qwen3-VL's DeepStack rows) read back (`VisionEncoder._run`).
- The time to first token with one image at the full budget: the vit, then the prompt's
  prefill (`StepModel.prefill`) of the image's tokens between a few text tokens, each
  chunk's image rows written over its embeddings (`Runtime._put_image_rows`), and for
  Qwen3-VL after each of the first text layers of a chunk that holds image rows its
  DeepStack rows written and `deepstack_add` run; then the token's choice.

The numbers are those the machine charges a model file of the same shapes (tested against
`toptpu run` on a compiled model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from toptpu.backend.contract import (
    DEEPSTACK_NET,
    VISION_NET,
    ModelDirFileError,
    read_model_file,
)
from toptpu.backend.runtime.accounting import (
    Charge,
    Costs,
    StepModel,
    merged,
    net_costs,
    total,
    transfer_costs,
)
from toptpu.backend.runtime.machine import command_costs
from toptpu.backend.target.chips import Chip
from toptpu.backend.target.cost import NetTiming, net_timing
from toptpu.dialects.common import QuantMode
from toptpu.dialects.weight_store import WeightStore
from toptpu.errors import CompileError, one_line_reason
from toptpu.net_compiler import NetPlan, compile_net
from toptpu.request import CompileRequest

#: text tokens of the estimate's prompt around the image: '<|im_start|>user\n<|vision_start|>'
#: before it, '<|vision_end|>' and a short question and the assistant's turn after it
TEXT_BEFORE = 4
TEXT_AFTER = 16


@dataclass
class VisionCosts:
    """The vision side of a Qwen VLM as the runtime runs it, timed on a chip."""

    chip: Chip
    budget: int  # patches per image
    tokens: int  # merged rows per image at the budget (image tokens)
    levels: int  # DeepStack levels
    mode: QuantMode  # the vit net's
    vit: NetTiming
    vit_io: dict[str, int]  # input name -> bytes written per run
    out_io: dict[str, int]  # output name -> bytes read per run
    deepstack: NetTiming | None
    deepstack_bytes: int  # one chunk's DeepStack rows written per level
    row_bytes: int  # one image row over the embeddings (hidden x activation bytes)
    weight_bytes: int

    def image_charges(self) -> list[Charge]:
        """One image (or video) through the vit: its inputs up, the run, its rows down."""
        up = [Charge("transfer", f"{n} to the chip", 1, transfer_costs(self.chip, b))
              for n, b in self.vit_io.items()]
        down = [Charge("transfer", f"{n} to the host", 1, transfer_costs(self.chip, b))
                for n, b in self.out_io.items()]
        return [*up, Charge("net", VISION_NET, 1, net_costs(self.chip, self.vit)), *down]

    def image(self) -> Costs:
        return total(self.image_charges())

    def prefill_charges(self, chunk: int, before: int, tokens: int) -> list[Charge]:
        """What image rows add to the prefill of a prompt with `tokens` image tokens after
        `before` text tokens, in chunks of `chunk`: each chunk's rows written, and Qwen3-VL's
        DeepStack rows and `deepstack_add` per level."""
        out: list[Charge] = []
        start = before
        end = before + tokens
        while start < end:
            stop = min(end, (start // chunk + 1) * chunk)
            out.append(Charge("transfer", "image rows to the chip", 1,
                              transfer_costs(self.chip, (stop - start) * self.row_bytes)))
            if self.deepstack is not None:
                for _ in range(self.levels):
                    out += [Charge("transfer", "deepstack rows to the chip", 1,
                                   transfer_costs(self.chip, self.deepstack_bytes)),
                            Charge("net", DEEPSTACK_NET, 1,
                                   net_costs(self.chip, self.deepstack))]
            start = stop
        return merged(out)

    def to_json(self) -> dict[str, Any]:
        return {"budget_patches": self.budget, "image_tokens": self.tokens,
                "deepstack_levels": self.levels, "mode": self.mode.value,
                "weight_bytes": self.weight_bytes,
                "vit": {"seconds": self.vit.seconds(self.chip), "bound": self.vit.bound,
                        "dma_bytes": self.vit.dma_bytes, "flops": self.vit.flops},
                "image": self.image().to_json()}


def vlm_config(config_dir: str) -> Any | None:
    """The transformers config of a Qwen VLM directory (None: not one)."""
    from toptpu.frontends.qwen_vl import QWEN_VL_CLASSES

    try:
        raw = json.loads(read_model_file(config_dir, "config.json") or b"{}")
    except (ValueError, ModelDirFileError, RecursionError, OSError):
        return None  # the text path reports it
    if not isinstance(raw, dict) or raw.get("model_type") not in QWEN_VL_CLASSES:
        return None
    from transformers import AutoConfig

    from toptpu.frontends.hf_loader import ModelLoadError

    try:
        return AutoConfig.from_pretrained(config_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"transformers cannot read {config_dir}/config.json: "
                             f"{one_line_reason(e)}") from e


def budget_of(config: Any, max_pixels: tuple[int, int] | None, max_patches: int | None
              ) -> int:
    """The vit net's patch budget as `toptpu compile` sets it."""
    from toptpu.frontends.qwen_vl import DEFAULT_MAX_PIXELS

    vc = config.vision_config
    patch, unit = int(vc.patch_size), int(vc.spatial_merge_size) ** 2
    if max_patches is not None:
        if max_patches % unit:
            raise CompileError(f"--max-patches {max_patches} must be a multiple of {unit}")
        return max_patches
    wid, hgt = max_pixels or DEFAULT_MAX_PIXELS
    budget = wid * hgt // (patch * patch) // unit * unit
    if budget < unit:
        raise CompileError(f"--max-pixels {wid},{hgt} holds less than one merged token")
    return budget


def vision_costs(config: Any, request: CompileRequest, budget: int) -> VisionCosts:
    """Compile the vit (in the request's vision mode) and `deepstack_add` (in its mode) of
    `config` with placeholder weights, each as `toptpu compile` compiles it
    (`net_compiler.compile_net`), and time them on the request's chip (see the module
    doc)."""
    from toptpu.frontends.vlm import deepstack_spec, placeholder_vision, qwen_vit_spec

    text_mode = request.fixed_mode("toptpu estimate")
    vit_mode = request.vision_mode_for(text_mode)
    chip, shapes = request.chip, request.shapes
    visual = placeholder_vision(config)
    store = WeightStore()
    vit = compile_net(NetPlan(qwen_vit_spec(visual, config.vision_config, budget), vit_mode),
                      request, store).program
    assert vit is not None
    levels = len(getattr(visual, "deepstack_visual_indexes", None) or ())
    width = int(config.text_config.hidden_size)
    act = text_mode.activation
    deep = None
    if levels:
        program = compile_net(NetPlan(deepstack_spec(width, shapes, act), text_mode), request,
                              store).program
        assert program is not None
        deep = net_timing(command_costs(program.commands), chip)
    act_bytes = {"f32": 4, "f16": 2, "bf16": 2}[act]
    return VisionCosts(
        chip, budget, budget // int(config.vision_config.spatial_merge_size) ** 2, levels,
        vit_mode, net_timing(command_costs(vit.commands), chip),
        {s.name: s.nbytes for s in vit.inputs}, {s.name: s.nbytes for s in vit.outputs},
        deep, shapes.max_input_length * width * act_bytes, width * act_bytes,
        sum(w.nbytes for w in vit.weights.values()))


@dataclass
class VlmEstimate:
    """A Qwen VLM's estimate: the text model's (`toptpu.estimate.Estimate`) and one image."""

    text: Any  # toptpu.estimate.Estimate
    vision: VisionCosts
    image_first_token: Costs  # the vit, then the prefill of the image prompt and the choice
    image_prompt_tokens: int

    @property
    def vision_s(self) -> float:
        return self.vision.image().total_s

    @property
    def ttft_with_image_s(self) -> float:
        return self.vision_s + self.image_first_token.total_s

    def to_json(self) -> dict[str, Any]:
        out = self.text.to_json()
        out["vision"] = {**self.vision.to_json(),
                         "image_prompt_tokens": self.image_prompt_tokens,
                         "first_token_after_vision": self.image_first_token.to_json(),
                         "modelled_ttft_with_image_s": self.ttft_with_image_s}
        return out


def estimate_vlm(text_est: Any, vision: VisionCosts, sampler: str) -> VlmEstimate:
    """Time to first token of a prompt with one image at the full budget (see the module
    doc) beside the text model's estimate."""
    compiled = text_est.compiled
    tokens = TEXT_BEFORE + vision.tokens + TEXT_AFTER
    if tokens > compiled.shapes.seq_length:
        raise CompileError(
            f"an image at the budget of {vision.budget} patches takes {vision.tokens} tokens: "
            f"with the prompt around it {tokens}, more than --seq-length "
            f"{compiled.shapes.seq_length}; raise --seq-length or lower --max-pixels")
    steps = StepModel(text_est.chip, compiled.io(), text_est.nets, compiled.model.num_layers)
    deepstack = range(TEXT_BEFORE, TEXT_BEFORE + vision.tokens) \
        if vision.deepstack is not None else range(0)  # those chunks run at L (`Runtime`)
    charges = [*steps.first_token_charges(tokens, sampler, deepstack),
               *vision.prefill_charges(steps.chunk, TEXT_BEFORE, vision.tokens)]
    return VlmEstimate(text_est, vision, total(merged(charges)), tokens)


def summary_lines(est: VlmEstimate) -> list[str]:
    v = est.vision
    where = ("" if not v.levels else
             f"; DeepStack: {v.levels} levels, deepstack_add "
             f"{v.deepstack.seconds(v.chip) * 1e3:.3f} ms a run" if v.deepstack else "")
    return [
        f"vision: vit over {v.budget} patches ({v.tokens} image tokens) in {v.mode}, "
        f"weights {v.weight_bytes / 1e6:.1f} MB: {est.vision_s * 1e3:.2f} ms per image "
        f"modelled ({v.vit.bound}-bound, {v.vit.flops / 1e9:.1f} GFLOP{where})",
        f"time to first token with one image ({est.image_prompt_tokens}-token prompt): "
        f"{est.ttft_with_image_s * 1e3:.2f} ms modelled (vision "
        f"{est.vision_s * 1e3:.2f} ms + prefill and choice "
        f"{est.image_first_token.total_s * 1e3:.2f} ms)",
    ]


def text_placeholder_builder(config: Any) -> Any:
    """How the text model of a Qwen VLM config is built (None: its causal LM class)."""
    from toptpu.frontends.qwen_vl import QWEN_VL_TEXT_TYPES, text_model_shell

    return text_model_shell if config.model_type in QWEN_VL_TEXT_TYPES else None


def checked_text_config(config: Any, where: str) -> Any:
    """The text config of a Qwen VLM, checked as `toptpu compile` checks it."""
    from toptpu.frontends.hf_loader import check_config
    from toptpu.frontends.qwen_vl import QWEN_VL_TEXT_TYPES

    tc = config.text_config
    check_config(tc, f"{where} (text_config)", family=QWEN_VL_TEXT_TYPES.get(tc.model_type))
    return tc
