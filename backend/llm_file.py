"""The LLM model file: what `toptpu compile` writes and every executor reads.

It is a `toptpu.backend.model_file` container (magic, version, JSON header, checksummed
sections written atomically). This module fixes the LLM conventions on top of it.

Sections:

- `ir:<net>`: the net's Tpu IR, xDSL generic form (with `loc("name")` debug info). The
  `top.weight_store` module attribute is removed: weights come from the blob below.
- `tokenizer:<file>`: the tokenizer files (`tokenizer.json`, `tokenizer_config.json`,
  `chat_template.jinja`, ...), byte for byte.
- `weights`: ONE weight blob, laid out as

      [shared tensors][layer 0 chunk][layer 1 chunk] ... [layer N-1 chunk]

  Every tensor starts at a multiple of `alignment` (64) bytes. Every layer chunk has the
  identical internal layout: the same tensor names at the same offsets relative to the
  chunk base `layer_base + i * layer_stride`, so a per-layer net binds layer i's weights
  by one base address.

Header keys (besides the container's own `format_version` and `sections`):

- `kind`: "toptpu-llm", `llm_format`: 1
- `chip`, `mode` (quantization mode), `group_size`, `symmetric`
- `shapes`: `seq_length`, `max_input_length`, `max_history` (informational: runtimes read
  the static shapes back from the nets' IO shapes)
- `model`: `family`, `num_layers`, `hidden_size`, `num_heads`, `num_kv_heads`,
  `head_dim`, `vocab_size`, `qk_norm`, `tied_embeddings`, `config` (the HF config dict)
- `generation`: `eos_token_ids`, `stop_strings`, `pad_token_id`, `bos_token_id`,
  `do_sample`, `temperature`, `top_k`, `top_p`, `repetition_penalty`
- `tokenizer`: `files` (names; each in section `tokenizer:<name>`)
- `nets`: name -> `inputs`/`outputs` (lists of {name, shape, dtype: numpy dtype name}),
  `per_layer`, `ir` (section name), `weights` (the tensor names the net reads), `streams`
  (section `stream:<net>`: the machine's command streams, a backend.codegen.Program with
  the grouped Tpu IR), `consts` (section `const:<net>`: its constant pool), `commands`
- `weights`: `section`, `alignment`, `size`, `shared` / `layer` (name -> {offset, shape,
  dtype, nbytes}; `layer` offsets are relative to a chunk base), `layer_base`,
  `layer_stride`, `num_layers`
- `compile`: provenance (source, seconds, toptpu version)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np
from xdsl.dialects.builtin import ModuleOp

from toptpu.backend.executor import NetInfo, TensorSpec
from toptpu.backend.model_file import ModelFile, ModelFileError, write_model_file

KIND = "toptpu-llm"
LLM_FORMAT = 1
WEIGHTS_SECTION = "weights"
WEIGHT_ALIGN = 64


def ir_section(net: str) -> str:
    return f"ir:{net}"


def tokenizer_section(name: str) -> str:
    return f"tokenizer:{name}"


def align(n: int, a: int = WEIGHT_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the weight blob (offset relative to its region)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "shape": list(self.shape), "dtype": self.dtype,
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WeightEntry:
        return cls(int(d["offset"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


@dataclass
class WeightLayout:
    """Offsets of every tensor in the blob: shared region, then N identical layer chunks."""

    shared: dict[str, WeightEntry]
    layer: dict[str, WeightEntry]
    layer_base: int
    layer_stride: int
    num_layers: int

    @classmethod
    def plan(cls, shared: Mapping[str, tuple[tuple[int, ...], str]],
             layer: Mapping[str, tuple[tuple[int, ...], str]], num_layers: int) -> WeightLayout:
        """Lay out tensors given as name -> (shape, dtype) (in the order given)."""

        def place(items: Mapping[str, tuple[tuple[int, ...], str]]
                  ) -> tuple[dict[str, WeightEntry], int]:
            out, off = {}, 0
            for name, (shape, dtype) in items.items():
                e = WeightEntry(off, tuple(shape), dtype)
                out[name] = e
                off = align(off + e.nbytes)
            return out, off

        sh, sh_size = place(shared)
        ly, ly_size = place(layer)
        return cls(sh, ly, align(sh_size), align(ly_size), num_layers)

    @property
    def size(self) -> int:
        return self.layer_base + self.layer_stride * self.num_layers

    def layer_offset(self, layer: int, name: str) -> int:
        return self.layer_base + layer * self.layer_stride + self.layer[name].offset

    def to_json(self) -> dict[str, Any]:
        return {"section": WEIGHTS_SECTION, "alignment": WEIGHT_ALIGN, "size": self.size,
                "shared": {k: e.to_json() for k, e in self.shared.items()},
                "layer": {k: e.to_json() for k, e in self.layer.items()},
                "layer_base": self.layer_base, "layer_stride": self.layer_stride,
                "num_layers": self.num_layers}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WeightLayout:
        return cls({k: WeightEntry.from_json(v) for k, v in d["shared"].items()},
                   {k: WeightEntry.from_json(v) for k, v in d["layer"].items()},
                   int(d["layer_base"]), int(d["layer_stride"]), int(d["num_layers"]))


def write_llm_file(path: str, header: Mapping[str, Any], irs: Mapping[str, str],
                   tokenizer_files: Mapping[str, bytes], blob: np.ndarray,
                   extra_sections: Mapping[str, bytes] | None = None) -> None:
    """Write the model file atomically (see the module doc for the layout).
    `extra_sections` adds more named sections (e.g. a net's command streams, named by its
    header entry `nets.<net>.streams`)."""
    sections: dict[str, bytes | memoryview] = {}
    for net, text in irs.items():
        sections[ir_section(net)] = text.encode()
    for name, data in tokenizer_files.items():
        sections[tokenizer_section(name)] = data
    sections.update(extra_sections or {})
    sections[WEIGHTS_SECTION] = memoryview(np.ascontiguousarray(blob, dtype=np.uint8))
    write_model_file(path, header, sections)


def _spec(d: Mapping[str, Any]) -> TensorSpec:
    return TensorSpec(str(d["name"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


class LlmFile:
    """A loaded, validated LLM model file (memory mapped)."""

    def __init__(self, path: str, verify_checksums: bool = True) -> None:
        self.path = path
        self.file = ModelFile(path, verify_checksums)
        self.header: dict[str, Any] = self.file.header
        try:
            self._validate()
        except ModelFileError:
            self.file.close()
            raise
        except (KeyError, TypeError, ValueError) as e:
            self.file.close()
            raise ModelFileError(f"'{path}' has an incomplete LLM header ({e!r}); recompile "
                                 "it with `toptpu compile`") from e

    def _err(self, msg: str) -> ModelFileError:
        return ModelFileError(f"'{self.path}': {msg}")

    def _validate(self) -> None:
        h = self.header
        if h.get("kind") != KIND:
            raise self._err(f"not an LLM model file (kind {h.get('kind')!r}); compile one with "
                            "`toptpu compile MODEL_DIR`")
        if int(h.get("llm_format", 0)) != LLM_FORMAT:
            raise self._err(f"LLM format {h.get('llm_format')} is not {LLM_FORMAT}; recompile")
        self.layout = WeightLayout.from_json(h["weights"])
        blob = self.file.sections.get(WEIGHTS_SECTION)
        if blob is None:
            raise self._err("has no weight blob section")
        if self.layout.size > blob.size:
            raise self._err(f"the weight table needs {self.layout.size} bytes, the blob has "
                            f"{blob.size}")
        for region, entries, limit in (("shared", self.layout.shared, self.layout.layer_base),
                                       ("layer", self.layout.layer, self.layout.layer_stride)):
            for name, e in entries.items():
                if e.offset % WEIGHT_ALIGN or e.offset + e.nbytes > limit:
                    raise self._err(f"{region} weight '{name}' at {e.offset} (+{e.nbytes}) is "
                                    f"misaligned or outside its region of {limit} bytes")
        for net, d in h["nets"].items():
            if d["ir"] not in self.file.sections:
                raise self._err(f"net '{net}' has no IR section '{d['ir']}'")
            table = self.layout.layer if d["per_layer"] else {}
            for w in d["weights"]:
                if w not in self.layout.shared and w not in table:
                    raise self._err(f"net '{net}' reads weight '{w}', which the weight table "
                                    "does not have")
        for name in h["tokenizer"]["files"]:
            if tokenizer_section(name) not in self.file.sections:
                raise self._err(f"tokenizer file '{name}' is missing")

    # ------------------------------------------------------------------ access
    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def net_infos(self) -> dict[str, NetInfo]:
        return {name: NetInfo(name, tuple(_spec(s) for s in d["inputs"]),
                              tuple(_spec(s) for s in d["outputs"]), bool(d["per_layer"]))
                for name, d in self.header["nets"].items()}

    def net_ir(self, net: str) -> str:
        if net not in self.header["nets"]:
            raise self._err(f"has no net '{net}'")
        return self.file.read(self.header["nets"][net]["ir"]).decode()

    def net_module(self, net: str) -> ModuleOp:
        from toptpu.dialects.ir_text import parse_ir

        return parse_ir(self.net_ir(net), f"{self.path}:{net}")

    def _blob(self) -> np.ndarray:
        return np.frombuffer(self.file.view(WEIGHTS_SECTION), np.uint8)

    def _view(self, blob: np.ndarray, offset: int, e: WeightEntry) -> np.ndarray:
        return blob[offset:offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.shape)

    def shared_weights(self) -> dict[str, np.ndarray]:
        """Zero-copy, read-only views of the shared tensors."""
        blob = self._blob()
        return {n: self._view(blob, e.offset, e) for n, e in self.layout.shared.items()}

    def layer_weights(self, layer: int) -> dict[str, np.ndarray]:
        """Zero-copy views of layer `layer`'s chunk."""
        if not 0 <= layer < self.num_layers:
            raise self._err(f"has {self.num_layers} layers, not layer {layer}")
        blob = self._blob()
        base = self.layout.layer_base + layer * self.layout.layer_stride
        return {n: self._view(blob, base + e.offset, e) for n, e in self.layout.layer.items()}

    def tokenizer_files(self) -> dict[str, bytes]:
        return {n: self.file.read(tokenizer_section(n)) for n in self.header["tokenizer"]["files"]}

    def close(self) -> None:
        """Unmap the file; while zero-copy weight views are alive the mapping stays until
        they are garbage collected."""
        try:
            self.file.close()
        except BufferError:
            pass
