"""The model families toptpu compiles, in one table (as TPU-MLIR's `LLM_CONVERTERS`): a
family is one entry here and one module beside this one.

- Text families (`base.TextFamily`, data): `decoder` (Qwen2, Qwen3, Llama), `qwen3_5`
  (the hybrid of full and linear attention) and `moe` (Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE:
  mixtures of experts).
- Vision families (`base.VisionFamily`, a class each): `internvl`, `minicpmv`, `qwen_vl`.
  Each carries its `vision` header section (which keys, their checks), its host side
  (preprocessing an image, the prompt text standing for it, the prompt's layout: image rows
  and positions) and what its compile side needs (model types, the transformers classes,
  the image processor, its tokens); the torch side of compiling it is
  `toptpu.frontends.vlm`'s `VISION_MODELS` entry for it.

Family names and model types are resolved here and nowhere else: everything else holds a
family object and asks it (`tests/test_families.py` checks that no other module compares
them). Torch-free: the runtime imports this package.
"""

from __future__ import annotations

from toptpu.errors import GenerationError
from toptpu.families import internvl, minicpmv, qwen_vl
from toptpu.families.base import TextFamily, VisionFamily
from toptpu.families.decoder import LLAMA, QWEN2, QWEN3
from toptpu.families.moe import QWEN2_MOE, QWEN3_5_MOE, QWEN3_MOE
from toptpu.families.qwen3_5 import QWEN3_5

#: the text families, by the name model files carry
TEXT_FAMILIES: dict[str, TextFamily] = {f.name: f for f in (QWEN2, QWEN3, LLAMA, QWEN3_5,
                                                                 QWEN3_MOE, QWEN2_MOE,
                                                                 QWEN3_5_MOE)}
#: the vision families, by the name model files carry (`vision.kind`)
VISION_FAMILIES: dict[str, VisionFamily] = {
    f.name: f for f in (internvl.FAMILY, minicpmv.FAMILY, qwen_vl.FAMILY)}

INTERNVL = internvl.FAMILY
MINICPMV = minicpmv.FAMILY
QWEN_VL = qwen_vl.FAMILY

#: text model_type -> its family
TEXT_MODEL_TYPES: dict[str, TextFamily] = {
    mt: f for f in TEXT_FAMILIES.values() for mt in f.model_types}
#: VLM model_type -> its vision family
VLM_MODEL_TYPES: dict[str, VisionFamily] = {
    mt: f for f in VISION_FAMILIES.values() for mt in f.model_types}
#: text model_type of a VLM that transformers has no causal LM for -> the text family whose
#: layers it has
VLM_TEXT_TYPES: dict[str, TextFamily] = {
    mt: f for f in TEXT_FAMILIES.values() for mt in f.vlm_text_types}


def text_family(name: str) -> TextFamily:
    """The text family model files call `name` (KeyError: none)."""
    return TEXT_FAMILIES[name]


def vision_family(name: str) -> VisionFamily:
    """The vision family model files call `name`; a GenerationError for an unknown one."""
    family = VISION_FAMILIES.get(name)
    if family is None:
        raise GenerationError(f"unknown vision family {name!r} (toptpu knows "
                              f"{', '.join(VISION_FAMILIES)}); recompile the model")
    return family


def text_family_of(model_type: object) -> TextFamily | None:
    """The text family of a transformers `model_type` (None: not one toptpu compiles)."""
    return TEXT_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


def vlm_family_of(model_type: object) -> VisionFamily | None:
    """The vision family of a VLM `model_type` (None: not a VLM toptpu compiles)."""
    return VLM_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None


#: every name and model type the table resolves (what no other module compares)
FAMILY_STRINGS = frozenset({*TEXT_FAMILIES, *VISION_FAMILIES, *TEXT_MODEL_TYPES,
                            *VLM_MODEL_TYPES, *VLM_TEXT_TYPES})
