"""A llama.cpp GGUF file (or a directory holding exactly one) as a streamed model.

The file is untrusted input, read as strictly as a safetensors checkpoint. `scan_gguf`
walks its whole header first, in pure Python over the mapped bytes, with every field
checked before it is used: the magic and version, the key/value and tensor counts against
the bytes left, every string length, every value type, the alignment, every tensor's
dimensions and type, and its data where llama.cpp requires it (`_tensor_infos`: each
tensor's offset where the one before it ends, aligned — no overlap, no gap —, inside the
file). Arrays are kept as `GGUFArray` (type, count, place), never read as a scalar, and
bounded before anything reads them (`check_arrays`: the tokenizer's arrays one element per
token and no more tokens than the embedding's rows, merges at most MERGES_PER_TOKEN a row,
every other array OTHER_ARRAY_ELEMENTS in all, the special token ids among the tokens, and
what reading them costs against the host's memory: gguf's reader, which transformers
uses, keeps ~1.6 KB per element). `check_metadata` then checks that what transformers maps
into the config and tokenizer is of its kind (a positive integer, a positive finite
number, a string, a bool: a one-element array, which transformers takes as its element,
is refused). Only then are the file's config and tokenizer read, as transformers' GGUF
loader maps them (`AutoConfig` / `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
llama and qwen2 metadata to their HF configs, the GGUF vocabulary to a `tokenizers`
tokenizer.json, its chat template and special ids), and the tensors by their names (names
are data: looked up in a fixed table, never used as paths). `gguf_text_config` gives the
sizes the compile request is checked against before that (the context length bounds
`--seq-length`).

The tensors stream like a safetensors checkpoint's (`frontends.streaming`): a skeleton with
layer 0 real and the embedding / lm_head as placeholders, every layer's tensors read from
the mapped file (`GGUFTensors.raw`: views of toptpu's own mapping, the file's size checked
before each read) one tensor at a time when its chunk is written, llama's q/k rows permuted
back from llama.cpp's rope layout (what transformers' `LlamaTensorProcessor` does). A
tensor with NaN or infinity (a quantized type's scales or mins) is refused, naming it.

Tensor types: F32, F16, BF16 as float; the decoder layers' linears of the types in
`EXACT_TYPES` exactly, as a pre-quantized checkpoint (`GGUFCheckpoint`, for
`tpu.a16_matmul`): the file's integers, its scales (f16, or f32 where a K-quant's f16
super-block scale times a 6- or 8-bit sub-block scale is exact in f32, not in f16) and its
integer zero points or float mins, in the form that gives `gguf.quants.dequantize` bit for
bit:

| type | storage | group | weight |
|---|---|---|---|
| Q8_0 | 8 bit, zero 128 | 32 | (q - 128) * d |
| Q4_0 | 4 bit, zero 8 | 32 | (q - 8) * d |
| Q5_0 | 8 bit (5 used), zero 16 | 32 | (q - 16) * d |
| Q4_1 | 4 bit, mins | 32 | q * d + m |
| Q5_1 | 8 bit (5 used), mins | 32 | q * d + m |
| Q4_K | 4 bit, mins | 32 | q * (d * sc) + (-(dmin * mc)) |
| Q5_K | 8 bit (5 used), mins | 32 | q * (d * sc) + (-(dmin * mc)) |
| Q6_K | 8 bit (6 used), zero 32 | 16 | (q - 32) * (d * sc) |

`-q auto` picks w{bits}f16 with the bits of most linears (a file of several types keeps
each linear's own form; layers that differ get nets of their own); an explicit `-q` of
those bits keeps them too (its activation type), one of other bits (a float mode included)
re-quantizes every linear from its dequantized weights. An embedding or lm_head of an exact
type is taken as float at its exactly dequantized values. Every other type (Q2_K, Q3_K,
IQ*, TQ*, MXFP4, ...) is refused, naming the tensor and its type, unless `dequantize` is
given: every quantized tensor is then dequantized with `gguf.quants.dequantize` (what
transformers does) and compiled in the requested mode.
"""

from __future__ import annotations

import copy
import math
import mmap
import os
import stat
import struct
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from toptpu.backend.contract import ModelDirFileError, model_file_path
from toptpu.dialects.host_memory import mem_available
from toptpu.dialects.output_file import note_input
from toptpu.errors import one_line_reason
from toptpu.frontends.hf_loader import (
    SUPPORTED_MODEL_TYPES,
    LoadedModel,
    ModelLoadError,
    check_config,
    check_config_values,
    check_tokenizer_files,
    expected_shapes,
    generation_settings,
    quiet_transformers,
    shape_mismatches,
)
from toptpu.frontends.llm import LAYER_PREFIX
from toptpu.frontends.quant import QuantizedLayout, QuantizedLinear
from toptpu.passes.convert_top_to_tpu import parse_mode

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
#: GGUF metadata value types: id -> (name, fixed size or 0 for string/array)
_VALUE_TYPES: dict[int, tuple[str, int]] = {
    0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
    5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 8: ("string", 0), 9: ("array", 0),
    10: ("uint64", 8), 11: ("int64", 8), 12: ("float64", 8),
}
_STRING, _ARRAY = 8, 9
#: longest key accepted, and most dimensions of a tensor
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4
#: GGUF types taken as float
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class ExactType:
    """How a GGUF block type is taken exactly by `tpu.a16_matmul` (module doc's table)."""

    bits: int  # storage bits of the integers (4: a nibble; 8: ui8)
    group: int  # input channels per scale
    zero: int | None  # the integer zero point, None for the scale-and-min form


#: GGUF types of a decoder layer's linears taken exactly (see the module doc)
EXACT_TYPES = {
    "Q8_0": ExactType(8, 32, 128), "Q4_0": ExactType(4, 32, 8), "Q5_0": ExactType(8, 32, 16),
    "Q4_1": ExactType(4, 32, None), "Q5_1": ExactType(8, 32, None),
    "Q4_K": ExactType(4, 32, None), "Q5_K": ExactType(8, 32, None),
    "Q6_K": ExactType(8, 16, 32),
}

#: a decoder layer's GGUF tensor name -> the HF parameter (llama / qwen2 / qwen3)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # mixture of experts (qwen2moe, qwen3moe): the router, the experts stacked by expert
    # (3-D: ggml's {H, I, E} is [E, I, H] here, the nets' own stacked form) and the
    # shared expert with its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: the experts' stacked tensors: their HF names are the nets' stacked ones (no '.weight')
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
#: GGUF architectures (general.architecture) toptpu compiles
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be read as given (the message names the file and field).
    The message is one line: names read from the file (keys, tensor names) may hold any
    character, so what is not printable is shown escaped."""

    def __init__(self, message: str) -> None:
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1]
                                 for ch in message))


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # HF (row-major) order: the reverse of GGUF's ne
    type_name: str  # GGMLQuantizationType name: F32, Q4_1, ...
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, checked but not read: its element type id, its element count and
    where its elements start in the file."""

    etype: int
    count: int
    offset: int

    @property
    def type_name(self) -> str:
        return _VALUE_TYPES[self.etype][0]

    def __repr__(self) -> str:
        return f"an array of {self.count} {self.type_name} element" + \
            ("" if self.count == 1 else "s")


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    fields: dict[str, Any]  # scalar and string values; arrays as `GGUFArray`
    tensors: dict[str, GGUFTensorInfo]
    data_start: int = 0  # where the tensor data starts (aligned)


def gguf_file_of(source: Any) -> str | None:
    """The GGUF file `source` names: a file starting with the GGUF magic (or named *.gguf),
    or a directory without config.json holding exactly one *.gguf file; None otherwise.
    A path named *.gguf that is missing or not a regular file (a FIFO, a device) is a
    GGUFError saying so (never mistaken for a model directory)."""
    if not isinstance(source, str | os.PathLike):
        return None
    path = os.fspath(source)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return None
        try:
            found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
        except OSError:
            return None
        if not found:
            return None
        if len(found) > 1:
            raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(found[:4])}): "
                            "pass the one to compile")
        try:  # a regular file of the directory (a link may point inside it only)
            inside = model_file_path(path, found[0])
        except ModelDirFileError as e:
            raise GGUFError(str(e)) from None
        assert inside is not None
        return inside
    if path.lower().endswith(".gguf"):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise GGUFError(f"the GGUF file '{path}' does not exist") from None
        except OSError as e:
            raise GGUFError(f"cannot read the GGUF file '{path}': {e.strerror or e}") from None
        if not stat.S_ISREG(mode):
            raise GGUFError(f"'{path}' is {_node_kind(mode)}, not a GGUF file: pass a "
                            "regular file")
        return path
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            return path if f.read(4) == GGUF_MAGIC else None
    except OSError:
        return None


def _node_kind(mode: int) -> str:
    """What a file that is not a regular file is, as a message names it."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


# --------------------------------------------------------------------------- header scan

#: the tokenizer's arrays: one element per token (tokens, scores, token types), or the BPE
#: merges; every other array is bounded by OTHER_ARRAY_ELEMENTS in all
TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
MERGES = "tokenizer.ggml.merges"
#: most elements of the arrays other than the tokenizer's, all together (real files hold a
#: few: rope sections, tags, languages)
OTHER_ARRAY_ELEMENTS = 1 << 16
#: most BPE merges per row of the embedding (Llama 3: 280147 merges, 128256 rows: 2.2)
MERGES_PER_TOKEN = 4
#: what reading one metadata array element costs in memory: gguf's reader (which
#: transformers uses for the config and the tokenizer) keeps a numpy view per element,
#: measured at 0.7 KB for a number and 1.6 KB for a string, and transformers a Python value
READ_BYTES_PER_ELEMENT = 2048
#: the share of the host's available memory the metadata may take while it is read
METADATA_MEMORY_SHARE = 0.5


class _Cursor:
    """Checked little-endian reads from the mapped file."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte {self.pos}): the GGUF file is "
                         "truncated or corrupt; re-download or re-convert it")

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} left")
        at = self.pos
        self.pos += n
        return at

    def unpack(self, fmt: str, what: str) -> Any:
        at = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, at)[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long, more than {limit}")
        at = self.take(n, what)
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def _value(c: _Cursor, vtype: int, key: str) -> Any:
    if vtype not in _VALUE_TYPES:
        raise c.fail(f"metadata '{key}' has unknown value type {vtype}")
    name, size = _VALUE_TYPES[vtype]
    if vtype == _STRING:
        return c.string(f"the value of '{key}'")
    if vtype == _ARRAY:
        etype = c.unpack("I", f"the element type of '{key}'")
        count = c.unpack("Q", f"the length of '{key}'")
        if etype not in _VALUE_TYPES or etype == _ARRAY:
            raise c.fail(f"metadata array '{key}' has element type {etype} (a scalar or "
                         "string type expected)")
        esize = _VALUE_TYPES[etype][1]
        if count * (esize or 8) > c.size - c.pos:  # a string takes at least its length
            raise c.fail(f"metadata array '{key}' claims {count} elements")
        at = c.pos
        if etype == _STRING:
            for i in range(count):
                n = c.unpack("Q", f"the length of '{key}'[{i}]")
                c.take(n, f"'{key}'[{i}]")
        else:
            c.take(count * esize, f"the elements of '{key}'")
        return GGUFArray(etype, count, at)
    fmt = {"uint8": "B", "int8": "b", "uint16": "H", "int16": "h", "uint32": "I",
           "int32": "i", "float32": "f", "bool": "?", "uint64": "Q", "int64": "q",
           "float64": "d"}[name]
    return c.unpack(fmt, f"the value of '{key}'")


def _open_mapped(path: str) -> mmap.mmap:
    """The regular file `path` mapped read-only (opened without blocking: a FIFO swapped
    in after the checks cannot hang)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"'{path}' is {_node_kind(st.st_mode)}, not a GGUF file: pass "
                                "a regular file")
            note_input(f.fileno())
            size = st.st_size
            if size < 24:
                raise GGUFError(f"{path}: {size} bytes, too short for a GGUF header")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror or e}") from None


def scan_gguf(path: str) -> GGUFHeader:
    """Read and check a GGUF file's whole header (see the module doc); a GGUFError naming
    the file and the field otherwise. Bounded by the file's size: every count is checked
    against the bytes left before anything is read for it; the arrays are bounded by the
    vocabulary the embedding really holds (`check_arrays`)."""
    buf = _open_mapped(path)
    try:
        c = _Cursor(buf, path)
        size = c.size
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        c.pos = 4
        version = c.unpack("I", "the version")
        if version not in GGUF_VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version} (a big-endian or unknown file); "
                            f"toptpu reads little-endian GGUF versions "
                            f"{', '.join(map(str, GGUF_VERSIONS))}")
        n_tensors = c.unpack("Q", "the tensor count")
        n_kv = c.unpack("Q", "the metadata count")
        if n_kv * 12 > size or n_tensors * 24 > size:
            raise c.fail(f"the header claims {n_kv} metadata entries and {n_tensors} "
                         f"tensors, more than a {size}-byte file holds")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string("a metadata key", MAX_KEY_BYTES)
            if key in fields:
                raise c.fail(f"metadata '{key}' appears twice")
            vtype = c.unpack("I", f"the type of '{key}'")
            fields[key] = _value(c, vtype, key)
        align = fields.get("general.alignment", 32)
        if not _is_int(align) or align <= 0 or align & (align - 1) or align > 1 << 16:
            raise GGUFError(f"{path}: general.alignment {align!r} is not a power of two up "
                            "to 65536")
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            name = c.string(f"the name of tensor {i}", MAX_KEY_BYTES)
            n_dims = c.unpack("I", f"the rank of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS})")
            ne = tuple(c.unpack("Q", f"a dimension of tensor '{name}'") for _ in range(n_dims))
            ttype = c.unpack("I", f"the type of tensor '{name}'")
            offset = c.unpack("Q", f"the data offset of tensor '{name}'")
            infos.append((name, ne, ttype, offset))
        data_start = -(-c.pos // align) * align
        tensors = _tensor_infos(path, infos, data_start, align, size)
        header = GGUFHeader(path, version, fields, tensors, data_start)
        check_arrays(header)
        return header
    finally:
        buf.close()


def _tensor_infos(path: str, infos: list[tuple[str, tuple[int, ...], int, int]],
                  data_start: int, align: int, size: int) -> dict[str, GGUFTensorInfo]:
    """The tensor infos checked: a known type, dimensions a whole number of blocks, and the
    data laid out as llama.cpp requires — each tensor's offset is where the one before it
    ends, padded to the alignment (so no two tensors share a byte), inside the file."""
    tensors: dict[str, GGUFTensorInfo] = {}
    expected = 0  # where the next tensor's data must start (relative to data_start)
    for name, ne, ttype, offset in infos:
        where = f"{path}: tensor '{name}'"
        if name in tensors:
            raise GGUFError(f"{where} appears twice")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
        except ValueError:
            raise GGUFError(f"{where} has unknown type {ttype}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if any(d <= 0 or d > size * block for d in ne):
            raise GGUFError(f"{where} has dimensions {list(ne)}")
        if ne[0] % block:
            raise GGUFError(f"{where}: its rows of {ne[0]} are not a multiple of "
                            f"{qtype.name}'s block of {block}")
        nbytes = math.prod(ne) // block * type_size
        at = data_start + offset
        if offset % align or at + nbytes > size:
            raise GGUFError(f"{where}: its {nbytes} bytes at offset {offset} lie outside "
                            f"the file ({size} bytes, data from byte {data_start}) or are "
                            f"not aligned to {align}")
        if offset != expected:
            raise GGUFError(f"{where} has data offset {offset}, expected {expected} (where the "
                            "tensor before it ends, aligned): tensor data must follow the "
                            "tensor infos' order without gaps or overlaps, as llama.cpp "
                            "requires; the file is corrupt or edited: re-convert it")
        expected = offset + -(-nbytes // align) * align
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), qtype.name, at, nbytes)
    return tensors


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _array_problem(header: GGUFHeader, key: str, etypes: tuple[str, ...]) -> str | None:
    v = header.fields.get(key)
    if v is None:
        return None
    if not isinstance(v, GGUFArray):
        return f"metadata '{key}' is {_shown(v)}, an array of {' or '.join(etypes)} expected"
    if v.type_name not in etypes:
        return f"metadata '{key}' is {v!r}, an array of {' or '.join(etypes)} expected"
    return None


def _shown(v: Any) -> str:
    """A metadata value as a message shows it (short)."""
    if isinstance(v, GGUFArray):
        return repr(v)
    if isinstance(v, bool):
        return f"the bool {str(v).lower()}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}" + ("..." if len(v) > 40 else "")
    return f"the {type(v).__name__} {v!r}"


def check_arrays(header: GGUFHeader) -> None:
    """The metadata arrays, before anything reads them: the tokenizer's of the types the
    format gives them, one element per token and at most as many tokens as the embedding
    has rows (token_embd.weight), the merges at most MERGES_PER_TOKEN per row, every other
    array at most OTHER_ARRAY_ELEMENTS elements in all, the special token ids among the
    tokens; and what reading them costs (READ_BYTES_PER_ELEMENT each) against the host's
    available memory."""
    path, fields = header.path, header.fields
    for key, etypes in (("tokenizer.ggml.tokens", ("string",)),
                        ("tokenizer.ggml.scores", ("float32",)),
                        ("tokenizer.ggml.token_type", ("int32",)),
                        (MERGES, ("string",))):
        problem = _array_problem(header, key, etypes)
        if problem:
            raise GGUFError(f"{path}: {problem}")
    tokens = fields.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if isinstance(tokens, GGUFArray) else None
    embd = header.tensors.get("token_embd.weight")
    rows = embd.shape[0] if embd is not None else None
    if n_tokens is not None and rows is not None and n_tokens > rows:
        raise GGUFError(f"{path}: its tokenizer has {n_tokens} tokens, more than the "
                        f"{rows} rows of token_embd.weight (the vocabulary): ids from {rows} "
                        "on would have no embedding; the file is corrupt or mismatched")
    for key in TOKEN_ARRAYS[1:]:
        v = fields.get(key)
        if isinstance(v, GGUFArray) and v.count != n_tokens:
            raise GGUFError(f"{path}: metadata '{key}' has {v.count} elements, "
                            f"tokenizer.ggml.tokens {n_tokens}: one per token expected")
    merges = fields.get(MERGES)
    if isinstance(merges, GGUFArray) and rows is not None \
            and merges.count > MERGES_PER_TOKEN * rows:
        raise GGUFError(f"{path}: metadata '{MERGES}' has {merges.count} merges, more than "
                        f"{MERGES_PER_TOKEN} per row of the {rows}-row embedding; the file is "
                        "corrupt")
    others = [(k, v) for k, v in fields.items()
              if isinstance(v, GGUFArray) and k not in (*TOKEN_ARRAYS, MERGES)]
    total = sum(v.count for _, v in others)
    if total > OTHER_ARRAY_ELEMENTS:
        key, v = max(others, key=lambda kv: kv[1].count)
        raise GGUFError(f"{path}: metadata '{key}' is {v!r}; toptpu reads at most "
                        f"{OTHER_ARRAY_ELEMENTS} elements of arrays other than the "
                        "tokenizer's (tokens, scores, token types, merges) in all")
    for key, v in fields.items():
        if not (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            continue
        if not _is_int(v) or v < 0:
            raise GGUFError(f"{path}: metadata '{key}' is {_shown(v)}, a token id (an "
                            "integer >= 0) expected")
        if n_tokens is not None and v >= n_tokens:
            raise GGUFError(f"{path}: metadata '{key}' is {v}, not one of the tokenizer's "
                            f"{n_tokens} token ids (0 to {n_tokens - 1})")
    elements = total + sum(v.count for k, v in fields.items()
                           if isinstance(v, GGUFArray) and k in (*TOKEN_ARRAYS, MERGES))
    need = elements * READ_BYTES_PER_ELEMENT
    available = mem_available()
    if available is not None and need > METADATA_MEMORY_SHARE * available:
        raise GGUFError(f"{path}: its metadata holds {elements} array elements, which take "
                        f"about {need / 2**30:.1f} GiB to read ({READ_BYTES_PER_ELEMENT} bytes "
                        f"each), more than half of this host's available memory "
                        f"({available / 2**30:.1f} GiB)")


    return None


# --------------------------------------------------------------------------- tensors


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF parameter a GGUF tensor name stands for, None for a name toptpu does not
    know (looked up, never used as a path)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() \
            or parts[3] not in ("weight", "bias") or parts[2] not in LAYER_TENSORS:
        return None
    layer = int(parts[1])
    if layer >= num_layers or str(layer) != parts[1]:
        return None
    if parts[2] in EXPERT_TENSORS:
        return None if parts[3] != "weight" else f"model.layers.{layer}.{LAYER_TENSORS[parts[2]]}"
    return f"model.layers.{layer}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"


def hf_shapes(tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The file's tensors (HF name -> shape) as the model's parameters are shaped: a MoE
    layer's stacked gate and up as transformers' fused `experts.gate_up_proj` [E, 2I, H]
    (the two must be alike), Qwen2-MoE's shared expert gate, a vector [H] in llama.cpp,
    as [1, H]."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in tensors.items():
        if name.endswith("experts.gate_proj"):
            base = name.rpartition(".")[0]
            up = tensors.get(f"{base}.up_proj")
            out[f"{base}.gate_up_proj"] = (*shape[:1], 2 * shape[1], *shape[2:]) \
                if up == shape and len(shape) == 3 else shape
        elif name.endswith("experts.up_proj") and \
                f"{name.rpartition('.')[0]}.gate_proj" in tensors:
            continue
        elif name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            out[name] = (1, shape[0])
        else:
            out[name] = shape
    return out


class GGUFTensors:
    """The tensors of a checked GGUF file by HF name, as `frontends.streaming` reads a
    checkpoint: `tensor(name)` in float32 (dequantized when allowed, llama's q/k permuted
    back), one tensor at a time from the mapped file."""

    def __init__(self, header: GGUFHeader, config: Any, arch: str,
                 dequantize: str | None) -> None:
        self.header, self.arch, self.dequantize = header, arch, dequantize
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        layers = int(config.num_hidden_layers)
        self.by_hf: dict[str, GGUFTensorInfo] = {}
        for name, info in header.tensors.items():
            hf = hf_name(name, layers)
            if hf is None:
                raise GGUFError(f"{header.path}: tensor '{name[:200]}' is not a tensor of a "
                                f"{arch} model toptpu knows")
            self.by_hf[hf] = info
        self._map: mmap.mmap | None = _open_mapped(header.path)
        if len(self._map) < max((i.offset + i.nbytes for i in header.tensors.values()),
                                default=0):
            raise GGUFError(f"{header.path} was truncated after its header was read: copy "
                            "it again")

    @property
    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (i.shape, i.type_name) for n, i in self.by_hf.items()}

    def __contains__(self, name: object) -> bool:
        return name in self.by_hf

    def exact_linears(self) -> dict[str, GGUFTensorInfo]:
        """Without `dequantize`: the decoder layers' linear weights of an `EXACT_TYPES` type
        by module path (taken as they are, `GGUFCheckpoint`)."""
        if self.dequantize is not None:
            return {}
        return {hf.removesuffix(".weight"): info for hf, info in self.by_hf.items()
                if hf.startswith("model.layers.") and hf.endswith(("_proj.weight", "_proj"))
                and info.type_name in EXACT_TYPES}

    def check_types(self) -> None:
        """Every tensor is float, an exact linear, or `dequantize` is given (the first other
        one is named). The embedding and lm_head of an exact type are taken as float, at
        their exactly dequantized values."""
        if self.dequantize is not None:
            return
        exact = {f"{m}.weight" for m in self.exact_linears()} | set(self.exact_linears())
        for hf, info in self.by_hf.items():
            if info.type_name in EXACT_TYPES and (hf in exact or not hf.startswith(
                    "model.layers.")):
                continue
            if info.type_name not in FLOAT_TYPES:
                raise GGUFError(
                    f"{self.header.path}: tensor '{info.name}' ({hf}) is {info.type_name}, "
                    f"which toptpu does not take as it is (it takes "
                    f"{', '.join(FLOAT_TYPES)}, and {', '.join(EXACT_TYPES)} linears): pass "
                    "--dequantize MODE (e.g. --dequantize f32) to dequantize it and compile "
                    "in MODE")

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's data as gguf's reader gives it (a read-only view of the mapped
        file): F32 / F16 as floats in HF order, every other type as bytes [rows..., bytes
        per row]; checked to lie inside the file as it is now (a file truncated since it
        was scanned is an error, never a SIGBUS)."""
        if self._map is None:
            raise GGUFError(f"{self.header.path} was closed")
        try:
            size = self._map.size()  # the file's size now (an fstat)
        except (OSError, ValueError):
            size = 0
        if size < info.offset + info.nbytes:
            raise GGUFError(f"{self.header.path} was truncated while it was being read "
                            f"(tensor '{info.name}'): copy it again")
        qtype = gguf.GGMLQuantizationType[info.type_name]
        view = np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)
        if info.type_name in ("F32", "F16"):
            return view.view(np.float32 if info.type_name == "F32" else np.float16).reshape(
                info.shape)
        return view.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, qtype))

    def tensor(self, name: str) -> np.ndarray:
        info = self.by_hf.get(name)
        if info is None:
            raise GGUFError(f"{self.header.path} has no tensor for '{name}'")
        data = self.raw(info)
        try:
            if info.type_name == "F32":
                out = np.array(data, dtype=np.float32)
            elif info.type_name in ("F16", "BF16") or self.dequantize is not None \
                    or info.type_name in EXACT_TYPES:
                out = np.asarray(gguf.quants.dequantize(
                    data, gguf.GGMLQuantizationType[info.type_name]), dtype=np.float32)
            else:
                self.check_types()
                raise AssertionError("unreachable")
        except GGUFError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf's dequantizers raise many types
            raise GGUFError(f"{self.header.path}: tensor '{info.name}' ({info.type_name}) "
                            f"cannot be dequantized: {str(e)[:200]}") from None
        self._check_finite(info, out)
        shape = info.shape
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp's vector [H], transformers' linear [1, H]
        return np.ascontiguousarray(self.unpermuted(name, out.reshape(shape)))

    def _check_finite(self, info: GGUFTensorInfo, *arrays: np.ndarray | None) -> None:
        """NaN or infinity in a tensor (its values, or a quantized type's scales and mins)
        is refused, naming the tensor: no weight of a model is not finite."""
        for a in arrays:
            if a is not None and not np.isfinite(a).all():
                what = "values" if info.type_name in FLOAT_TYPES else "scales or mins"
                raise GGUFError(f"{self.header.path}: tensor '{info.name}' "
                                f"({info.type_name}) has NaN or infinite {what}: the file is "
                                "damaged; re-download or re-convert it")

    def unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        """`rows` (the rows of the tensor `name`, any trailing shape) in HF order: llama's
        q/k rows permuted back, every other tensor as it is."""
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight",
                                                   "self_attn.k_proj.weight")):
            heads = self.heads if ".q_proj." in name else self.kv_heads
            return _unpermute(rows, heads)
        return rows

    def blocks(self, name: str) -> ExactForm:
        """An exact linear's stored form (`ExactForm`, `decode_blocks`), rows in HF order."""
        info = self.by_hf[name]
        *lead, k = info.shape  # [N, K], or a MoE layer's experts [E, N, K]
        raw = np.asarray(self.raw(info), dtype=np.uint8).reshape(math.prod(lead), -1)
        try:
            form = decode_blocks(raw, info.type_name, k)
        except ValueError as e:
            raise GGUFError(f"{self.header.path}: tensor '{info.name}': {e}") from None
        self._check_finite(info, form.scales, form.mins)

        def rows(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(self.unpermuted(name, a.reshape(*lead, -1)))

        return ExactForm(rows(form.q), rows(form.scales),
                         None if form.zeros is None else rows(form.zeros),
                         None if form.mins is None else rows(form.mins))

    def release(self) -> None:
        """Drop the mapped pages read so far from the resident set."""
        if self._map is not None:
            try:
                self._map.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):
                pass

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views of it are alive: unmapped when they are collected
                pass
            self._map = None


class GGUFCheckpoint:
    """A GGUF file's decoder linears of the `EXACT_TYPES` as a pre-quantized checkpoint
    (`frontends.quant.QuantizedCheckpoint`'s interface): the file's integers with their
    scales and zero points or mins (see the module doc), taken as they are; nothing
    re-quantized."""

    quant_method = "gguf"
    packing_format = "gguf"

    def __init__(self, tensors: GGUFTensors) -> None:
        self.tensors = tensors
        self.layouts: dict[str, QuantizedLayout] = {}
        for module, info in tensors.exact_linears().items():
            t = EXACT_TYPES[info.type_name]
            n, k = info.shape[-2:]  # a MoE layer's experts [E, N, K]: each expert's
            self.layouts[module] = QuantizedLayout(
                module, t.bits, t.group, t.zero is not None, k, n, False,
                {"qweight": info.name}, info.type_name, mins=t.zero is None,
                scale_dtype=str(np.dtype(_scale_dtype(info.type_name))))

    def linear(self, name: str) -> QuantizedLinear | None:
        layout = self.layouts.get(name)
        if layout is None:
            return None
        form = self.tensors.blocks(name if name in self.tensors else f"{name}.weight")
        return QuantizedLinear(name, layout.bits, layout.group_size, form.q, form.scales,
                               form.zeros, None, None, layout.sym, form.mins)

    def stacked_experts(self, name: str) -> QuantizedLinear | None:
        """A MoE layer's experts ('…experts.gate_proj'), stored stacked [E, N, K]: the
        integers, scales and zero points or mins with their leading expert axis."""
        return self.linear(name) if name in self.tensors else None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: i.shape for n, i in self.tensors.by_hf.items()}


# --------------------------------------------------------------------------- block decoding


@dataclass(frozen=True)
class ExactForm:
    """A quantized GGUF tensor [N, K] as `tpu.a16_matmul` takes it: the integers as
    unsigned uint8 [N, K] (a 4-bit type's below 16), the scales [N, K / group] (f16, f32
    for the K-quants), and either the zero points (uint8) or the mins (the scales' dtype)."""

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    mins: np.ndarray | None


def _scale_dtype(type_name: str) -> type:
    """The scales' (and mins') dtype of an exact type: f32 for the K-quants (a super-block
    f16 scale times a 6- or 8-bit sub-block scale: exact in f32, not in f16)."""
    return np.float32 if type_name.endswith("_K") else np.float16


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per value (the last axis) as float16, the other axes kept."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [..., C] -> the 4-bit values [..., 2C]: each run of `run` bytes gives its low
    nibbles, then its high ones (llama.cpp's layout: 16-byte runs for the 32-value blocks,
    32-byte runs for the K-quants' sub-block pairs)."""
    r = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return ((r >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(
        *qs.shape[:-1], -1)


def _bits_of_u32(qh: np.ndarray) -> np.ndarray:
    """Four bytes per value (little-endian u32) -> its 32 bits, bit i the value's i-th."""
    words = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K / Q5_K super-block's 12 scale bytes -> its 8 six-bit scales and mins
    (llama.cpp's get_scale_min_k4, as gguf's Q4_K.get_scale_min)."""
    d, m, m_d = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def decode_blocks(raw: np.ndarray, type_name: str, k: int) -> ExactForm:
    """The rows `raw` (uint8 [N, bytes per row]) of a tensor of the exact type `type_name`
    with K values per row, as an `ExactForm` whose `tpu.a16_matmul` weight is
    `gguf.quants.dequantize` of the same bytes, bit for bit (block layouts: llama.cpp's
    ggml-quants, as gguf-py reads them)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n = raw.shape[0]
    if k % block or raw.shape[1] != k // block * size:
        raise ValueError(f"{raw.shape[1]} bytes a row do not hold {k} {type_name} values")
    b = raw.reshape(n, k // block, size)
    f32 = np.float32
    mins: np.ndarray | None = None
    t = EXACT_TYPES[type_name]
    if type_name == "Q8_0":
        scales = _f16(b[..., 0:2])
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif type_name in ("Q4_0", "Q4_1"):
        scales = _f16(b[..., 0:2])
        at = 2 if type_name == "Q4_0" else 4
        if type_name == "Q4_1":
            mins = _f16(b[..., 2:4])
        q = _nibbles(b[..., at:], 16)
    elif type_name in ("Q5_0", "Q5_1"):
        scales = _f16(b[..., 0:2])
        at = 2 if type_name == "Q5_0" else 4
        if type_name == "Q5_1":
            mins = _f16(b[..., 2:4])
        high = _bits_of_u32(b[..., at:at + 4])
        q = _nibbles(b[..., at + 4:], 16) | (high << 4)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = (_f16(b[..., 0:2]).astype(f32)[..., None],
                   _f16(b[..., 2:4]).astype(f32)[..., None])
        sc, mc = _k_scale_min(b[..., 4:16])
        scales = d * sc.astype(f32)  # [N, B, 8]: exact (11 x 6 bits)
        mins = -(dmin * mc.astype(f32))  # gguf: d * q - dmin * m == d * q + -(dmin * m)
        if type_name == "Q4_K":
            q = _nibbles(b[..., 16:], 32)
        else:
            qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
                8, 1)
            q = _nibbles(b[..., 48:], 32) | ((qh & 1).reshape(n, -1, 256) << 4)
    elif type_name == "Q6_K":
        ql = _nibbles(b[..., 0:128], 64)
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = ql | ((qh & 3).reshape(n, -1, 256) << 4)
        d = _f16(b[..., 208:210]).astype(f32)[..., None]
        scales = d * b[..., 192:208].view(np.int8).astype(f32)  # [N, B, 16]: exact
    else:
        raise ValueError(f"{type_name} is not a type toptpu takes exactly")
    g = k // t.group
    return ExactForm(
        np.ascontiguousarray(q.reshape(n, k).astype(np.uint8)),
        np.ascontiguousarray(scales.reshape(n, g)),
        None if t.zero is None else np.full((n, g), t.zero, np.uint8),
        None if mins is None else np.ascontiguousarray(mins.reshape(n, g)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation reversed (transformers' `_reverse_permute_weights`)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# --------------------------------------------------------------------------- loading


#: the metadata transformers maps into the config and the tokenizer (its
#: GGUF_TO_TRANSFORMERS_MAPPING for llama / qwen2 / qwen3), by the kind of value each must
#: be: a one-element array taken as its element (what transformers does with every
#: array) must never pass for a scalar
_ARCH_INTS = ("context_length", "block_count", "feed_forward_length", "embedding_length",
              "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
              "vocab_size", "attention.key_length", "attention.value_length",
              "expert_count", "expert_used_count", "expert_feed_forward_length",
              "expert_shared_feed_forward_length")
_REQUIRED_INTS = ("block_count", "embedding_length", "feed_forward_length",
                  "attention.head_count")
#: what a mixture-of-experts architecture's metadata must have (llama.cpp reads them all)
_MOE_INTS: dict[str, tuple[str, ...]] = {
    "qwen3moe": ("expert_count", "expert_used_count", "expert_feed_forward_length"),
    "qwen2moe": ("expert_count", "expert_used_count", "expert_feed_forward_length",
                 "expert_shared_feed_forward_length"),
}
_ARCH_FLOATS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
_STRINGS = ("general.architecture", "general.name", "tokenizer.ggml.model",
            "tokenizer.ggml.pre", "tokenizer.chat_template")
_BOOLS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
          "tokenizer.ggml.add_space_prefix")


def check_metadata(header: GGUFHeader) -> str:
    """The metadata the config and tokenizer are made of, each of the kind of value it must
    be (a positive integer, a positive finite number, a string, a bool; never an array in
    their place); the architecture."""
    path, fields = header.path, header.fields

    def refuse(key: str, want: str) -> GGUFError:
        return GGUFError(f"{path}: metadata '{key}' is {_shown(fields[key])}, {want} "
                         "expected; the file is corrupt or edited: re-convert it")

    for key in _STRINGS:
        if key in fields and not isinstance(fields[key], str):
            raise refuse(key, "a string")
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: general.architecture {str(arch)[:60]!r}: toptpu compiles "
                        f"GGUF {', '.join(ARCHITECTURES)} models")
    for key in _ARCH_INTS:
        name = f"{arch}.{key}"
        if name not in fields:
            if key in _REQUIRED_INTS or key in _MOE_INTS.get(str(arch), ()):
                raise GGUFError(f"{path}: metadata '{name}' is missing, a positive integer "
                                "expected")
            continue
        if not _is_int(fields[name]) or fields[name] <= 0:
            raise refuse(name, "a positive integer")
    for key in _ARCH_FLOATS:
        name = f"{arch}.{key}"
        v = fields.get(name)
        if name in fields and not (isinstance(v, int | float) and not isinstance(v, bool)
                                   and math.isfinite(v) and v > 0):
            raise refuse(name, "a positive finite number")
    for key in _BOOLS:
        if key in fields and not isinstance(fields[key], bool):
            raise refuse(key, "a bool")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.model"):
        if key not in fields:
            raise GGUFError(f"{path} has no '{key}': toptpu takes the tokenizer from the "
                            "GGUF metadata")
    return str(arch)


def gguf_text_config(path: str) -> tuple[dict[str, Any], str]:
    """The sizes of a GGUF file's model as a config.json would give them (what the compile
    request is checked against before any weight is read: `--seq-length` within the
    context length, the KV cache within the chip), and where they are from."""
    header = scan_gguf(path)
    arch = check_metadata(header)
    fields = header.fields
    names = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
             "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
             "attention.head_count": "num_attention_heads",
             "attention.head_count_kv": "num_key_value_heads",
             "attention.key_length": "head_dim", "expert_count": "num_experts",
             "expert_used_count": "num_experts_per_tok"}
    cfg = {hf: fields[f"{arch}.{key}"] for key, hf in names.items()
           if f"{arch}.{key}" in fields}
    return cfg, f"{path} (its {arch}.* metadata)"


#: what transformers made of a GGUF's metadata, per file (its identity and size and
#: modification time): transformers parses every metadata field, the tokenizer's vocabulary
#: included, for the config and again for the tokenizer (~3.5 s CPU each for SmolLM2-135M's
#: 49k tokens); a process that compiles one file again (a sweep, the tests) reads it once
_CONFIGS: dict[tuple[str, int, int, int, int], tuple[Any, str]] = {}
_TOKENIZER_FILES: dict[tuple[str, int, int, int, int], dict[str, bytes]] = {}


def _file_identity(path: str) -> tuple[str, int, int, int, int]:
    st = os.stat(path)
    return os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _config(header: GGUFHeader) -> tuple[Any, str]:
    """transformers' config of the GGUF (a copy of this process's first read of the file)."""
    key = _file_identity(header.path)
    if key not in _CONFIGS:
        _CONFIGS[key] = _read_config(header)
    config, arch = _CONFIGS[key]
    return copy.deepcopy(config), arch


def _read_config(header: GGUFHeader) -> tuple[Any, str]:
    from transformers import AutoConfig

    path = header.path
    arch = check_metadata(header)
    d, name = os.path.split(os.path.abspath(path))
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(d, gguf_file=name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise GGUFError(f"transformers cannot read the config of {path}: "
                        f"{one_line_reason(e)}") from None
    fields = header.fields
    if arch in _MOE_INTS:  # what transformers' GGUF mapping leaves at its defaults
        if fields[f"{arch}.expert_used_count"] > fields[f"{arch}.expert_count"]:
            raise GGUFError(f"{path}: metadata '{arch}.expert_used_count' "
                            f"({fields[f'{arch}.expert_used_count']}) is more than its "
                            f"{fields[f'{arch}.expert_count']} experts: re-convert it")
        config.moe_intermediate_size = int(fields[f"{arch}.expert_feed_forward_length"])
        if arch == "qwen2moe":
            config.shared_expert_intermediate_size = int(
                fields[f"{arch}.expert_shared_feed_forward_length"])
            config.norm_topk_prob = False  # llama.cpp's qwen2moe: the top-k weights as they are
        else:
            config.norm_topk_prob = True  # llama.cpp's qwen3moe renormalizes them
        config.mlp_only_layers, config.decoder_sparse_step = [], 1  # every layer a MoE
    raw = config.to_dict()
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise GGUFError(f"{path}: model_type {raw.get('model_type')!r} is not supported")
    check_config_values(raw, path)
    return config, arch


def _tokenizer_files(path: str) -> dict[str, bytes]:
    """The tokenizer files transformers converts the GGUF's metadata to (cached as the
    config is)."""
    key = _file_identity(path)
    if key not in _TOKENIZER_FILES:
        _TOKENIZER_FILES[key] = _read_tokenizer_files(path)
    return dict(_TOKENIZER_FILES[key])


def _read_tokenizer_files(path: str) -> dict[str, bytes]:
    from transformers import AutoTokenizer

    d, name = os.path.split(os.path.abspath(path))
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizers / transformers raise many types
        raise GGUFError(f"{path}: its tokenizer metadata cannot be converted: "
                        f"{str(e)[:200]}") from None
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "chat_template.json"):
            p = os.path.join(tmp, n)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    files[n] = f.read()
    check_tokenizer_files(files, path)
    return files


def load_gguf(source: str, dequantize: str | None = None,
              need_tokenizer: bool = True, mode: str | None = None) -> LoadedModel:
    """A GGUF file (or a directory holding one) as a streamed skeleton (`frontends.streaming`),
    its config, tokenizer, chat template and special ids from the metadata. `mode`, the
    compile's explicit `-q`: a mode of other weight bits than most of the file's exact
    linears (a float mode included) re-quantizes them all from their dequantized weights."""
    from toptpu.frontends.streaming import StreamedWeights, skeleton

    path = gguf_file_of(source)
    if path is None:
        raise GGUFError(f"'{source}' is not a GGUF file nor a directory holding one")
    header = scan_gguf(path)
    config, arch = _config(header)
    family = check_config(config, path)
    tensors = GGUFTensors(header, config, arch, dequantize)
    want, tied = expected_shapes(config)
    have = hf_shapes({n: i.shape for n, i in tensors.by_hf.items()})
    problems = shape_mismatches(have, want, tied, set())
    if problems:
        raise GGUFError(f"the tensors of {path} do not match its metadata: "
                        f"{'; '.join(problems)}")
    tensors.check_types()
    exact = tensors.exact_linears()
    if exact and mode not in (None, "auto"):
        try:
            bits = parse_mode(mode)[1]
        except ValueError as e:
            raise GGUFError(str(e)) from None
        most = Counter(EXACT_TYPES[i.type_name].bits for i in exact.values()).most_common(1)
        if bits != most[0][0]:  # the checkpoint's bits (`prequantized.checkpoint_bits`)
            tensors.dequantize = mode
    files = _tokenizer_files(path) if need_tokenizer else {}
    ck = GGUFCheckpoint(tensors)
    stream = StreamedWeights(tensors, {},
                             # the ignore: QuantizedCheckpoint's interface, not its class
                             checkpoint=ck if ck.layouts else None)  # type: ignore[arg-type]
    get: Callable[[str], np.ndarray] = stream.tensor_f32
    model, stream.placeholders = skeleton(config, get)
    stream.materialized[LAYER_PREFIX] = model.model.layers[0]
    return LoadedModel(model, family, files, generation_settings(None, config), path,
                       checkpoint=stream.checkpoint,
                       checkpoint_dtype="float16" if ck.layouts else None, stream=stream)
