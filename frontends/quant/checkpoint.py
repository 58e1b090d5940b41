"""Reading a pre-quantized checkpoint (GPTQ, AWQ, AutoRound): the entry points.

`read_quantized_checkpoint(model_dir)` reads a Hugging Face model directory (``config.json``
plus ``*.safetensors``, optionally sharded by ``model.safetensors.index.json``) whose
``quantization_config`` names a weight-only integer format, and returns every quantized
linear layer in one canonical, unpacked form (`QuantizedLinear`) next to the tensors that
stayed in floating point. `QuantizedLinear.dequantize` reproduces, bit-exactly in float32,
the weight the producing library defines: ``(q - zero) * scale`` with the scale stored in
its checkpoint dtype and cast to float32.

`open_quantized_checkpoint(model_dir, reader)` does every check of the same reader without
holding the tensors (a streaming compile): each quantized linear is checked from the shard
headers (`CheckpointReader`: fields, dtypes, shapes) and its small tensors (zero points,
g_idx) and described by a `QuantizedLayout`; `QuantizedCheckpoint.linear(name)` reads and
unpacks its integers when asked for. Both go through the one `_LayerReader`.

The formats differ in their packing format, their layout and their config's per-layer rules
(`gptq`, `awq`, `autoround`); what they share is in `common`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from toptpu.dialects.checkpoint_reader import CheckpointReader
from toptpu.frontends.quant import autoround, awq, gptq
from toptpu.frontends.quant.autoround import AUTOROUND_AWQ, AUTOROUND_GPTQ_V1, AutoRoundResolver
from toptpu.frontends.quant.awq import AWQ_FIELDS, AwqResolver, unpack_awq_columns
from toptpu.frontends.quant.common import (
    FLOAT_DTYPES,
    QUANT_ONLY_FIELDS,
    SUPPORTED_BITS,
    DictSource,
    LayerScheme,
    QuantizedCheckpointError,
    QuantizedLayout,
    QuantizedLinear,
    ReaderSource,
    SchemeResolver,
    TensorSource,
    is_model_file,
    load_json,
    load_tensors,
    read_quantization_config,
    unpack_int32_columns,
    unpack_int32_rows,
)
from toptpu.frontends.quant.gptq import GPTQ_FIELDS, GptqResolver

_SUPPORTED_QUANT_METHODS = ("gptq", "awq", "auto-round")
#: quant method -> its packing format and its per-layer rules
_PACKING_FORMAT: dict[str, Callable[[Path, Mapping[str, Any]], str]] = {
    "gptq": gptq.packing_format, "awq": awq.packing_format, "auto-round": autoround.packing_format,
}
_RESOLVER: dict[str, type[SchemeResolver]] = {
    "gptq": GptqResolver, "awq": AwqResolver, "auto-round": AutoRoundResolver,
}


def _normalize_quant_method(model_dir: Path, qc: Mapping[str, Any]) -> str:
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method in ("auto-round", "intel/auto-round"):
        return "auto-round"
    if method in ("gptq", "awq"):
        return method
    raise QuantizedCheckpointError(
        f"{model_dir}: quantization_config.quant_method={qc.get('quant_method')!r} is not "
        f"supported; supported: {', '.join(_SUPPORTED_QUANT_METHODS)} (convert the checkpoint to "
        "one of them, or load the float model and quantize it with -q)"
    )


def _is_awq_layout(fmt: str) -> bool:
    return fmt == "awq_gemm" or fmt in AUTOROUND_AWQ


def _stores_zero_minus_one(fmt: str) -> bool:
    return fmt == "gptq" or fmt in AUTOROUND_GPTQ_V1


# --------------------------------------------------------------------------------------------
# one quantized linear


class _LayerReader:
    """One quantized linear's tensors: `layout` checks everything the headers say (fields,
    dtypes, shapes against bits and group size) and the small tensors' values (zero points,
    g_idx); `read` then unpacks its integers."""

    def __init__(
        self,
        model_dir: Path,
        fmt: str,
        layer: str,
        tensors: Mapping[str, str],
        source: TensorSource,
        desc_act: bool = False,
    ):
        self.model_dir = model_dir
        self.desc_act = desc_act
        self.fmt = fmt
        self.layer = layer
        self.tensors = tensors
        self.source = source

    def error(self, fld: str, problem: str, fix: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(
            f"{self.model_dir}: layer '{self.layer}', field '{fld}': {problem}; {fix}"
        )

    def spec(
        self, fld: str, dtypes: tuple[np.dtype, ...], what: str
    ) -> tuple[tuple[int, ...], np.dtype]:
        if fld not in self.tensors:
            raise self.error(
                fld,
                f"tensor '{self.layer}.{fld}' is missing (a {self.fmt} layer needs {what})",
                "the checkpoint is incomplete or not in this format; re-export it",
            )
        shape, dtype = self.source.spec(self.tensors[fld])
        if dtype not in dtypes:
            raise self.error(
                fld,
                f"dtype {dtype} (expected {' or '.join(str(d) for d in dtypes)})",
                "the tensor is not in the layout the config names; re-export the checkpoint",
            )
        return shape, dtype

    def array(self, fld: str) -> np.ndarray:
        return self.source.array(self.tensors[fld])

    def shape(self, fld: str, shape: tuple[int, ...], expected: tuple[int, ...], why: str) -> None:
        if tuple(shape) != expected:
            raise self.error(
                fld,
                f"shape {list(shape)} but {why} requires {list(expected)}",
                "the tensor is mis-shaped for the configured bits/group_size; check the config or "
                "re-export the checkpoint",
            )

    def layout(self, scheme: LayerScheme) -> QuantizedLayout:
        """Check the layer (see the class doc) and say what it is."""
        bits = scheme.bits
        if bits not in SUPPORTED_BITS:
            raise self.error(
                "bits",
                f"{bits}-bit weights (from {scheme.source}) are not supported (supported: "
                f"{', '.join(map(str, SUPPORTED_BITS))})",
                "re-quantize the model to 4 or 8 bits",
            )
        awq = _is_awq_layout(self.fmt)
        if awq and bits != 4:
            raise self.error(
                "bits", f"{bits}-bit in the AWQ gemm layout", "AWQ gemm is defined for 4 bits only"
            )
        allowed = AWQ_FIELDS if awq else GPTQ_FIELDS
        extra = sorted(set(self.tensors) - allowed)
        if extra:
            raise self.error(
                extra[0],
                f"unexpected tensor(s) {', '.join(extra)} next to qweight (a kernel-specific, e.g. "
                "exllama or marlin, layout, or a float weight left beside the packed one)",
                f"only {', '.join(sorted(allowed))} are read for {self.fmt}; re-export the "
                "checkpoint in the plain layout",
            )
        int32 = (np.dtype(np.int32), np.dtype(np.uint32))
        per = 32 // bits
        qweight, _ = self.spec("qweight", int32, "a packed int32 qweight")
        qzeros, _ = self.spec("qzeros", int32, "packed int32 zero points")
        scales, _ = self.spec("scales", FLOAT_DTYPES, "float scales")
        if len(qweight) != 2:
            raise self.error("qweight", f"{len(qweight)}-d tensor", "expected a 2-d int32 tensor")
        if awq:
            k, n = int(qweight[0]), int(qweight[1]) * per
        else:
            k, n = int(qweight[0]) * per, int(qweight[1])
        gs = k if scheme.group_size in (-1, 0) else scheme.group_size
        if gs <= 0:
            raise self.error("group_size", f"{scheme.group_size}", "group_size must be -1 or > 0")
        has_g_idx = "g_idx" in self.tensors
        if not has_g_idx and self.desc_act:
            raise self.error(
                "g_idx",
                f"desc_act=true (act-order) but tensor '{self.layer}.g_idx' is missing",
                "act-order groups cannot be reconstructed without g_idx; re-export the checkpoint",
            )
        if not has_g_idx and k % gs:
            raise self.error(
                "group_size",
                f"group size {gs} does not divide in_features {k}",
                "the config does not match the tensors; fix group_size",
            )
        groups = math.ceil(k / gs)
        self.shape("scales", scales, (groups, n), f"in_features {k}, group_size {gs}, out {n}")
        self.shape(
            "qzeros", qzeros, (groups, n // per), f"{groups} groups, {n} outputs at {bits} bits"
        )
        layout = QuantizedLayout(
            self.layer, bits, gs, scheme.sym, k, n, False, dict(self.tensors), scheme.source
        )
        self.zeros(layout)
        act_order = self.g_idx(layout) is not None
        if "bias" in self.tensors:
            bias, dtype = self.source.spec(self.tensors["bias"])
            if dtype not in FLOAT_DTYPES:
                raise self.error("bias", f"dtype {dtype}", "bias must be a float tensor")
            self.shape("bias", bias, (n,), f"out_features {n}")
        return replace(layout, act_order=act_order)

    def zeros(self, layout: QuantizedLayout) -> np.ndarray:
        """The real zero points ``[N, G]`` (the format's offset resolved), checked against
        ``sym``."""
        bits = layout.bits
        qzeros = self.array("qzeros")
        if _is_awq_layout(self.fmt):
            zeros = unpack_awq_columns(qzeros, bits).T
        else:
            zeros = unpack_int32_columns(qzeros, bits).T
        zeros = np.ascontiguousarray(zeros)
        if _stores_zero_minus_one(self.fmt):
            z = zeros.astype(np.int32) + 1
            zeros = z.astype(np.uint8) if int(z.max(initial=0)) <= 255 else z

        if layout.sym and not np.all(zeros == (1 << (bits - 1))):
            bad = np.argwhere(zeros != (1 << (bits - 1)))[0]
            raise self.error(
                "qzeros",
                f"sym=true but zero point [{bad[0]}, {bad[1]}] is {int(zeros[bad[0], bad[1]])}, "
                f"not {1 << (bits - 1)} (wrong zero-point offset convention for "
                f"'{self.fmt}'?)",
                "check checkpoint_format/packing_format (gptq stores zero-1, gptq_v2 and plain "
                "auto_round store the zero) and sym in the config",
            )
        return zeros

    def g_idx(self, layout: QuantizedLayout) -> np.ndarray | None:
        """int32 ``[K]``: the group of each input channel when act-order permutes them (None
        when the groups are contiguous)."""
        if "g_idx" not in self.tensors:
            return None
        k, gs = layout.in_features, layout.group_size
        groups = math.ceil(k / gs)
        g_idx_raw = self.array("g_idx")
        if g_idx_raw.dtype.kind not in "iu":
            raise self.error("g_idx", f"dtype {g_idx_raw.dtype}", "g_idx must be integer")
        self.shape("g_idx", g_idx_raw.shape, (k,), f"in_features {k}")
        gi = g_idx_raw.astype(np.int64)
        if gi.size and (gi.min() < 0 or gi.max() >= groups):
            raise self.error(
                "g_idx",
                f"group indices span [{gi.min()}, {gi.max()}] but there are {groups} groups",
                "g_idx does not match scales/qzeros; re-export the checkpoint",
            )
        if np.array_equal(gi, np.arange(k) // gs):
            return None
        return gi.astype(np.int32)

    def read(self, layout: QuantizedLayout) -> QuantizedLinear:
        """The layer's tensors, unpacked (`layout` as `layout()` made it)."""
        qweight = self.array("qweight")
        if _is_awq_layout(self.fmt):
            q = unpack_awq_columns(qweight, layout.bits).T
        else:
            q = unpack_int32_rows(qweight, layout.bits).T
        bias = self.array("bias") if "bias" in self.tensors else None
        return QuantizedLinear(
            name=self.layer,
            bits=layout.bits,
            group_size=layout.group_size,
            qweight=np.ascontiguousarray(q),
            scales=np.ascontiguousarray(self.array("scales").T),
            zeros=self.zeros(layout),
            g_idx=self.g_idx(layout),
            bias=None if bias is None else np.array(bias),
            sym=layout.sym,
        )


# --------------------------------------------------------------------------------------------
# the checkpoint


@dataclass
class QuantizedCheckpoint:
    """A pre-quantized HF checkpoint: config, float tensors and quantized linears by name."""

    model_dir: Path
    config: dict[str, Any]
    quantization_config: dict[str, Any]
    #: normalised: "gptq", "awq" or "auto-round"
    quant_method: str
    #: on-disk layout: "gptq" (v1 zero offset), "gptq_v2", "awq_gemm",
    #: or AutoRound's packing_format ("auto_round:auto_gptq", "auto_round", ...)
    packing_format: str
    float_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)
    #: every quantized linear, checked, by module path (known before its integers are read)
    layouts: dict[str, QuantizedLayout] = field(default_factory=dict)
    #: the checkpoint tensors that are not part of a quantized linear
    float_names: list[str] = field(default_factory=list)
    #: where the tensors are read from (`linear`)
    source: TensorSource | None = None
    desc_act: bool = False

    def linear(self, name: str) -> QuantizedLinear | None:
        """The quantized linear `name` (a module path), unpacked: the one in `linears`, else
        read from `source` now; None for a module that is not quantized."""
        if name in self.linears:
            return self.linears[name]
        layout = self.layouts.get(name)
        if layout is None:
            return None
        if self.source is None:
            raise QuantizedCheckpointError(f"{self.model_dir}: layer '{name}' has no tensors")
        return _LayerReader(
            self.model_dir, self.packing_format, name, layout.tensors, self.source, self.desc_act
        ).read(layout)

    def stacked_experts(self, name: str) -> QuantizedLinear | None:
        """A mixture-of-experts layer's projection stacked by expert, as the nets read it
        ('model.layers.N.mlp.experts.gate_proj', `up_proj` or `down_proj`), from the
        per-expert linears the checkpoint quantizes ('…experts.E.gate_proj', the layout
        auto-round writes): one `QuantizedLinear` whose qweight, scales and zero points
        (or mins) have a leading expert axis. None when no expert of `name` is quantized.
        Experts quantized in different forms, some left float, or act-order experts are
        refused."""
        base, _, proj = name.rpartition(".")
        if not base.endswith("experts") or proj not in ("gate_proj", "up_proj", "down_proj"):
            return None
        layouts: list[QuantizedLayout] = []
        while (lay := self.layouts.get(f"{base}.{len(layouts)}.{proj}")) is not None:
            layouts.append(lay)
        if not layouts:
            return None
        n = len(layouts)
        floats = [k for k in self.float_names
                  if k.startswith(f"{base}.") and k.endswith(f".{proj}.weight")]
        if floats or f"{base}.{n + 1}.{proj}" in self.layouts:
            raise QuantizedCheckpointError(
                f"{self.model_dir}: the experts of '{base}' ({proj}) are partly quantized "
                f"(expert {n} is not); toptpu compiles a layer's experts in one form")
        forms = {(lay.bits, lay.group_size, lay.sym, lay.mins, lay.scale_dtype)
                 for lay in layouts}
        if len(forms) != 1:
            raise QuantizedCheckpointError(
                f"{self.model_dir}: the experts of '{base}' ({proj}) are quantized in "
                f"{len(forms)} different forms; toptpu compiles a layer's experts in one form")
        if any(lay.act_order for lay in layouts):
            raise QuantizedCheckpointError(
                f"{self.model_dir}: the experts of '{base}' ({proj}) are act-order (desc_act) "
                "quantized, which toptpu does not compile for experts; re-export without "
                "desc_act")
        linears = [self.linear(f"{base}.{e}.{proj}") for e in range(n)]
        assert all(lin is not None for lin in linears)  # every one has a layout
        first = linears[0]
        assert first is not None

        def stack(field_name: str) -> np.ndarray | None:
            parts = [getattr(lin, field_name) for lin in linears]
            return None if parts[0] is None else np.stack(parts)

        qweight, scales = stack("qweight"), stack("scales")
        assert qweight is not None and scales is not None
        return QuantizedLinear(name, first.bits, first.group_size, qweight, scales,
                               stack("zeros"), None, None, first.sym, stack("mins"))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of `dequantized_state_dict` (of an opened checkpoint, from the shard
        headers: nothing is read)."""
        source = self.source
        shapes = {name: tuple(int(d) for d in self.float_tensors[name].shape)
                  if source is None else source.spec(name)[0] for name in self.float_names}
        for name, layout in self.layouts.items():
            shapes[f"{name}.weight"] = (layout.out_features, layout.in_features)
            if "bias" in layout.tensors:
                shapes[f"{name}.bias"] = (layout.out_features,)
        return shapes

    def dequantized_state_dict(self) -> dict[str, np.ndarray]:
        """Float tensors plus ``<layer>.weight`` (float32) and ``<layer>.bias`` of every linear."""
        out = dict(self.float_tensors)
        for name, lin in self.linears.items():
            out[f"{name}.weight"] = lin.dequantize()
            if lin.bias is not None:
                out[f"{name}.bias"] = lin.bias
        return out


# --------------------------------------------------------------------------------------------
# entry points


def _root_and_config(model_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    root = Path(model_dir)
    if not root.is_dir():
        raise QuantizedCheckpointError(f"{root}: not a directory (expected a HF model directory)")
    config_path = root / "config.json"
    if not is_model_file(root, "config.json"):
        raise QuantizedCheckpointError(
            f"{root}: no config.json; not a Hugging Face model directory"
        )
    return root, load_json(config_path)


def read_quantized_checkpoint(model_dir: str | os.PathLike[str]) -> QuantizedCheckpoint:
    """Read a GPTQ / AWQ / AutoRound checkpoint directory into `QuantizedCheckpoint`, every
    tensor in memory (`linears`, `float_tensors`).

    Raises `QuantizedCheckpointError` (naming the layer, the field and the remedy) for
    anything that cannot be decoded exactly: unknown ``quant_method``, unsupported bits or
    packing layout, missing / mis-shaped / unexpected tensors, a config that contradicts
    the tensors.
    """
    root, config = _root_and_config(model_dir)
    ck = _open(root, config, lambda: DictSource(load_tensors(root)))
    source = ck.source
    assert source is not None  # _open reads the tensors of a directory it was given
    for name in ck.layouts:
        linear = ck.linear(name)
        assert linear is not None  # every name of `layouts` is a quantized linear
        ck.linears[name] = linear
    ck.float_tensors = {name: source.array(name) for name in ck.float_names}
    ck.source = None  # the packed integers go: `linears` holds them unpacked
    return ck


def open_quantized_checkpoint(
    model_dir: str | os.PathLike[str], reader: CheckpointReader
) -> QuantizedCheckpoint:
    """A GPTQ / AWQ / AutoRound checkpoint directory whose shards `reader` maps: every check
    of `read_quantized_checkpoint` done (config, schemes, fields, dtypes, shapes, zero points,
    g_idx), `layouts` filled, and each quantized linear read only when asked for
    (`QuantizedCheckpoint.linear`), its pages dropped from the resident set once checked."""
    root, config = _root_and_config(model_dir)
    return _open(root, config, lambda: ReaderSource(reader))


def _open(
    root: Path, config: dict[str, Any], make_source: Callable[[], TensorSource]
) -> QuantizedCheckpoint:
    """The checks and layouts of a checkpoint (see `open_quantized_checkpoint`); the config
    is checked before `make_source` gives the tensors."""
    qc = read_quantization_config(root, config)
    method = _normalize_quant_method(root, qc)
    fmt = _PACKING_FORMAT[method](root, qc)
    resolver = _RESOLVER[method](root, qc)
    desc_act = method == "gptq" and bool(qc.get("desc_act"))
    source = make_source()

    # group tensors by module: "<module>.<field>"
    modules: dict[str, dict[str, str]] = {}
    for key in source.names():
        module, _, fld = key.rpartition(".")
        modules.setdefault(module, {})[fld] = key
    quant_modules = sorted(m for m, fields in modules.items() if "qweight" in fields and m)
    for module, fields in modules.items():
        if "qweight" not in fields and fields.keys() & (QUANT_ONLY_FIELDS - {"scales"}):
            fld = sorted(fields.keys() & QUANT_ONLY_FIELDS)[0]
            raise QuantizedCheckpointError(
                f"{root}: layer '{module}', field 'qweight': tensor '{module}.qweight' is missing "
                f"but '{module}.{fld}' is present; the checkpoint is incomplete or in a "
                "kernel-specific layout, re-export it"
            )
    known_layers = [m for m in modules if m]

    layouts: dict[str, QuantizedLayout] = {}
    consumed: set[str] = set()
    for module in quant_modules:
        scheme, where = resolver.resolve(module, known_layers)
        if scheme is None:
            raise QuantizedCheckpointError(
                f"{root}: layer '{module}', field 'qweight': the layer is packed but the "
                f"quantization_config keeps it in float ({where}); the config and the tensors "
                "disagree, fix the config"
            )
        reader = _LayerReader(root, fmt, module, modules[module], source, desc_act)
        layouts[module] = reader.layout(scheme)
        source.release()
        consumed.update(modules[module].values())

    # a layer the config names explicitly as quantized must not be stored in float
    explicit: list[str] = list(resolver.extra)
    for module in explicit:
        if module in modules and module not in layouts and "weight" in modules[module]:
            scheme, _ = resolver.resolve(module, known_layers)
            if scheme is not None:
                raise QuantizedCheckpointError(
                    f"{root}: layer '{module}', field 'qweight': extra_config quantizes it to "
                    f"{scheme.bits} bits but only a float '{module}.weight' is stored; fix the "
                    "config or re-export the checkpoint"
                )

    float_names = [k for k in source.names() if k not in consumed]
    for key in float_names:
        if source.spec(key)[1].kind in "iu" and key.endswith(".weight"):
            raise QuantizedCheckpointError(
                f"{root}: tensor '{key}' is an integer weight outside any GPTQ/AWQ layer; "
                "the layout is not recognised"
            )
    return QuantizedCheckpoint(
        model_dir=root,
        config=config,
        quantization_config=qc,
        quant_method=method,
        packing_format=fmt,
        layouts=layouts,
        float_names=float_names,
        source=source,
        desc_act=desc_act,
    )
