"""Tiny VLM directories, compiled model files, test images and the transformers references
shared by the VLM tests (saved/compiled once per session, shared between pytest-xdist
workers through a file lock, as `llm_fixtures` does)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from filelock import FileLock
from llm_fixtures import shared_dir

#: the test image of each family: InternVL 2x2 tiles + thumbnail (20 image tokens),
#: MiniCPM-V a source image and a 1x3 slice grid (24 image tokens); MiniCPM-V with its
#: Qwen3.5 text model a source image and a 2x2 slice grid (20 image tokens: two rows of
#: slices, so 4.7's canvas pins the newline between them)
IMAGE_SIZE = {"internvl": (130, 125), "minicpmv": (150, 260), "minicpmv4_6": (300, 200),
              "minicpmv4_7": (300, 200)}  # (height, width)
#: a prompt that, with the image tokens, spans several prefill chunks of 16
PROMPT = "Describe the image. What is the capital of France?"


def vlm_dir(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    from toptpu.frontends.hf_loader import quiet_transformers
    from toptpu.frontends.tiny_vlms import save_tiny_vlm

    path = os.path.join(shared_dir(tmp_path_factory), f"vlm-{family}")
    with FileLock(path + ".lock"):
        if not os.path.exists(os.path.join(path, "done")):
            with quiet_transformers():
                save_tiny_vlm(path, family)
            open(os.path.join(path, "done"), "w").close()
    return path


def vlm_file(tmp_path_factory: pytest.TempPathFactory, family: str, mode: str = "f32",
             seq: int = 160, input_len: int = 16, **kwargs: Any) -> str:
    """The tiny VLM of `family` compiled to a model file (compile kwargs in the name)."""
    from toptpu.compiler import compile as compile_model

    model_dir = vlm_dir(tmp_path_factory, family)
    extra = "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
    path = os.path.join(shared_dir(tmp_path_factory),
                        f"vlm-{family}-{mode}-s{seq}-l{input_len}{extra}.toptpu")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            compile_model(model_dir, path, mode=mode, seq_length=seq,
                          max_input_length=input_len, progress=None, **kwargs)
    return path


def make_image(height: int, width: int, seed: int = 0) -> Any:
    """A deterministic RGB test picture: colour gradients, a disc and some noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = 255.0 * ((x - width / 2) ** 2 + (y - height / 2) ** 2 < (min(height, width) / 3) ** 2)
    img = np.stack([r, g, b], -1) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def image_path(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    h, w = IMAGE_SIZE[family]
    path = os.path.join(shared_dir(tmp_path_factory), f"image-{h}x{w}.png")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            make_image(h, w).save(path)
    return path


_HF: dict[str, Any] = {}


def hf_vlm(model_dir: str) -> Any:
    """The saved VLM loaded back by transformers (float32)."""
    if model_dir not in _HF:
        import torch
        import transformers

        from toptpu.frontends.hf_loader import quiet_transformers
        from toptpu.frontends.vlm import VLM_CLASSES

        cls = getattr(transformers, VLM_CLASSES[
            transformers.AutoConfig.from_pretrained(model_dir).model_type])
        with quiet_transformers():
            _HF[model_dir] = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF[model_dir]


def hf_image_inputs(model_dir: str, path: str) -> tuple[dict[str, Any], str]:
    """What the model's own processing gives for one image: the model inputs (pixel values
    from its Pillow image processor, loaded from preprocessor_config.json) and the text of
    its placeholder (the processor's own `replace_image_token`; the processor object itself
    needs a torchvision video processor, which does not install beside torch 2.13)."""
    from types import SimpleNamespace

    import torch
    import transformers
    from PIL import Image
    from transformers.models.internvl.processing_internvl import InternVLProcessor
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor

    model = hf_vlm(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    image = Image.open(path)
    if model.config.model_type == "internvl":
        proc = transformers.GotOcr2ImageProcessorPil.from_pretrained(model_dir)
        out = proc(image, crop_to_patches=True, return_tensors=None)  # as InternVLProcessor
        layout = SimpleNamespace(start_image_token=tok.start_image_token,
                                 end_image_token=tok.end_image_token,
                                 image_token=tok.context_image_token,
                                 image_seq_length=model.config.image_seq_length)
        text = InternVLProcessor.replace_image_token(layout, out, 0)
        return {"pixel_values": torch.tensor(np.stack(out["pixel_values"]))}, text
    proc = transformers.MiniCPMV4_6ImageProcessorPil.from_pretrained(model_dir)
    out = proc(image, return_tensors=None)
    layout = SimpleNamespace(slice_mode=proc.slice_mode, image_token=tok.image_token,
                             image_start_token=tok.image_start_token,
                             image_end_token=tok.image_end_token,
                             slice_start_token=tok.slice_start_token,
                             slice_end_token=tok.slice_end_token)
    text = MiniCPMV4_6Processor.replace_image_token(layout, out, 0, image_token_divisor=16)
    text = f"{tok.image_id_start_token}0{tok.image_id_end_token}{text}"  # use_image_id
    return {"pixel_values": torch.tensor(out["pixel_values"]),
            "target_sizes": torch.tensor(out["target_sizes"])}, text


def hf_image_features(model_dir: str, inputs: dict[str, Any]) -> np.ndarray:
    """The model's own `get_image_features`: all image rows [n, H] in placeholder order."""
    import torch

    with torch.no_grad():
        feats = hf_vlm(model_dir).get_image_features(**inputs).pooler_output
    if isinstance(feats, list | tuple):
        return torch.cat(list(feats)).numpy()
    return feats.reshape(-1, feats.shape[-1]).numpy()


def hf_generate(model_dir: str, ids: list[int], inputs: dict[str, Any], n: int,
                canvas: bool = True) -> list[int]:
    """transformers greedy `generate` with the image inputs. A MiniCPM-V 4.7 gets the
    `mm_token_type_ids` its processor returns by default (1 for the image tokens), so that
    it lays out its canvas positions; `canvas` False leaves them out (transformers then
    falls back to one text position per token, with a warning)."""
    import torch

    model = hf_vlm(model_dir)
    extra = {}
    if canvas and model.config.model_type == "minicpmv4_7":
        image = model.config.image_token_id
        extra["mm_token_type_ids"] = torch.tensor([[int(i == image) for i in ids]])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             **inputs, **extra)
    return out[0, len(ids):].tolist()
