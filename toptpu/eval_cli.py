"""`toptpu eval`: the quality of a model file measured on a text.

Teacher-forced perplexity over a UTF-8 text, tokenized once with the model file's own
tokenizer (its default special tokens: a BOS where the tokenizer adds one) and cut into
**non-overlapping windows of at most SEQ tokens** (the compiled KV capacity; with a
reference model file, the smaller of the two SEQs). Each window is a fresh conversation
run through `Runtime.sequence_logits` (the prefill chunks of `generate`, lm_head on every
row) on the reference machine or, with `--executor interpreter`, the Tpu interpreter. In a
window of w tokens the logits of positions 0..w-2 predict tokens 1..w-1, so the first
token of every window is context only; a last window of one token predicts nothing and is
dropped. Perplexity is exp of the mean negative log-likelihood over all predicted tokens.

Against a reference (`--reference MODEL_FILE`, e.g. the f32 compile, or `--hf DIR`, the
float model in transformers), on the same windows and positions: top-1 agreement (the
fraction of positions whose argmax is the same), mean KL divergence KL(reference || model)
in nats, and greedy generation from the text's first `--prompt-tokens` tokens for
`--greedy-tokens` tokens (EOS ignored) with both: the first index where they differ.
`--json` prints one object (schema EVAL_JSON_SCHEMA, documented in docs/usage.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from toptpu.backend.runtime.runtime import Runtime, SamplingConfig
from toptpu.cli_args import int_at_least
from toptpu.dialects.output_file import note_input
from toptpu.errors import ToptpuError
from toptpu.progress import progress_bar

#: version of the `toptpu eval --json` object; bumped when a key changes meaning or goes away
EVAL_JSON_SCHEMA = 1

#: most bytes of --text read (a text for perplexity, not a corpus dump: wikitext-2's test
#: set is 1.3 MB): tokenizing takes ~230 bytes of memory per character, so 4 MiB ~ 1 GB
MAX_TEXT_BYTES = 4 * 2**20
#: with --max-tokens N, the text is read from its start in pieces of at least this many
#: bytes per token (growing fourfold) until its tokens reach N + PREFIX_MARGIN
PREFIX_BYTES_PER_TOKEN = 16
#: tokens beyond N a prefix must give: the last tokens of a prefix cut at a line end may
#: differ from the whole text's (a post-processor's end token, a merge across the cut)
PREFIX_MARGIN = 16

#: positions whose float64 log-probabilities are held at once (a 150k vocabulary: 77 MB)
ROWS = 64


class EvalError(ToptpuError, ValueError):
    """The text or the reference cannot be evaluated as given; the message says why."""


# --------------------------------------------------------------------------- arguments


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file")
    p.add_argument("--text", required=True, metavar="FILE",
                   help="UTF-8 text file the perplexity is measured on")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", metavar="MODEL_FILE",
                     help="compare with another model file (e.g. the f32 compile)")
    ref.add_argument("--hf", metavar="DIR",
                     help="compare with the float model of a Hugging Face directory "
                     "(transformers, f32)")
    p.add_argument("--executor", choices=["interpreter", "machine"], default="machine",
                   help="run the nets with the Tpu interpreter or on the reference machine")
    p.add_argument("--max-tokens", type=int_at_least(2), default=None,
                   help="use at most the first N tokens of the text")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=8,
                   help="with a reference: greedy generation starts from the text's first N "
                   "tokens")
    p.add_argument("--greedy-tokens", type=int_at_least(1), default=16,
                   help="with a reference: tokens generated greedily by both (at most what "
                   "the KV cache holds after the prompt)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (schema in docs/usage.md)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


# --------------------------------------------------------------------------- the text


class TextFile:
    """The --text file, checked before anything is read from it: a regular file (a FIFO
    would block the read forever) and, when it is read `whole`, at most MAX_TEXT_BYTES (its
    size from the file system, not from reading it; `--max-tokens` reads only the start
    it needs, at most MAX_TEXT_BYTES of it)."""

    def __init__(self, path: str, whole: bool = True) -> None:
        self.path = path
        try:  # without blocking: a FIFO is refused, never read
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise EvalError(f"--text '{path}' does not exist") from None
        except IsADirectoryError:
            raise EvalError(f"--text '{path}' is a directory; pass a UTF-8 text file") from None
        except OSError as e:
            raise EvalError(f"cannot read --text '{path}': {e.strerror or e}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else (
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
            raise EvalError(f"--text '{path}' is {kind}; pass a UTF-8 text file")
        self._file = os.fdopen(fd, "rb")
        if whole and st.st_size > MAX_TEXT_BYTES:
            self.close()
            raise EvalError(f"--text '{path}' is {st.st_size} bytes, more than {MAX_TEXT_BYTES} "
                            f"({MAX_TEXT_BYTES >> 20} MiB); pass a shorter text, or "
                            "--max-tokens N to use its first N tokens")
        note_input(fd, path)
        self.size = st.st_size

    def read(self, n: int | None = None) -> bytes:
        """The first `n` bytes (all: None), at most MAX_TEXT_BYTES whatever the file does."""
        self._file.seek(0)
        data = self._file.read(min(MAX_TEXT_BYTES + 1, n if n is not None else 1 << 62))
        if len(data) > MAX_TEXT_BYTES:  # it grew since it was checked, or tokens are scarce
            raise EvalError(f"--text '{self.path}': more than {MAX_TEXT_BYTES >> 20} MiB of "
                            "it would be read; pass a shorter text")
        return data

    def close(self) -> None:
        self._file.close()


def decode_text(data: bytes, path: str) -> str:
    """`data` as text: valid, non-blank UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"--text '{path}' is not valid UTF-8 (byte 0x{data[e.start]:02x} at "
                        f"offset {e.start}); pass a UTF-8 text file") from None
    if not text.strip():
        raise EvalError(f"--text '{path}' is empty; pass a text of at least two tokens")
    return text


def read_text(path: str) -> str:
    """The text of `path`: a regular file of valid, non-blank UTF-8, at most
    MAX_TEXT_BYTES."""
    f = TextFile(path)
    try:
        return decode_text(f.read(), path)
    finally:
        f.close()


def _line_cut(data: bytes) -> int:
    """Where a prefix of the text ends: after its last line end followed by a character
    that is not white space (a tokenizer splits there), 0 if there is none."""
    at = len(data)
    while (at := data.rfind(b"\n", 0, at)) >= 0:
        if at + 1 < len(data) and not data[at + 1:at + 2].isspace():
            return at + 1
    return 0


def text_tokens(f: TextFile, encode: Any, max_tokens: int | None) -> tuple[str, list[int]]:
    """The text (what was read of it) and its tokens: all of them, or with `max_tokens` the
    first N, from a prefix read in growing pieces and cut at a line end (see
    PREFIX_BYTES_PER_TOKEN), never more of the file than those tokens need."""
    if max_tokens is None:
        text = decode_text(f.read(), f.path)
        return text, encode(text)
    want = max_tokens + PREFIX_MARGIN
    n = PREFIX_BYTES_PER_TOKEN * want
    while True:
        if n >= f.size or n > MAX_TEXT_BYTES:
            text = decode_text(f.read(), f.path)
            return text, encode(text)[:max_tokens]
        data = f.read(n)
        cut = _line_cut(data)
        if cut:
            text = decode_text(data[:cut], f.path)
            ids = encode(text)
            if len(ids) >= want:
                return text, ids[:max_tokens]
        n *= 4


def windows(n: int, size: int) -> list[tuple[int, int]]:
    """Non-overlapping [start, end) windows of at most `size` over n tokens; a last
    window of one token (nothing to predict) is dropped."""
    return [(s, min(s + size, n)) for s in range(0, n, size) if min(s + size, n) - s >= 2]


# --------------------------------------------------------------------------- scorers


class Scorer(Protocol):
    """A model that gives teacher-forced logits and greedy continuations."""

    name: str
    kind: str  # "model_file" or "hf"
    seq: int | None  # the most ids one call takes (None: no limit)
    vocab_size: int

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...

    def greedy(self, ids: Sequence[int], n: int) -> list[int]: ...


class ModelFileScorer:
    """A model file run by the runtime."""

    kind = "model_file"

    def __init__(self, path: str, executor: str) -> None:
        self.name = path
        self.rt = Runtime.open(path, executor)
        self.seq: int | None = self.rt.seq
        self.vocab_size = self.rt.meta.model.vocab_size
        self.mode = str(self.rt.header.get("mode"))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.rt.encode(text)]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.rt.sequence_logits(ids)

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        res = self.rt.generate(list(ids), n, SamplingConfig(), stop_on_eos=False)
        return [int(t) for t in res.generated_ids]


class HFScorer:
    """The float model of a Hugging Face directory in transformers (f32, local files)."""

    kind = "hf"
    seq: int | None = None

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from toptpu.frontends.hf_loader import ModelLoadError, quiet_transformers, read_config

        self.name = path
        config, _ = read_config(path)  # a supported model directory, checked
        self.vocab_size = int(config.vocab_size)
        try:
            with quiet_transformers():
                self.model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, local_files_only=True).eval()
        except Exception as e:  # noqa: BLE001 - transformers raises many types here
            raise ModelLoadError(f"transformers cannot load the model in '{path}': "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                 ) from e

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)], dtype=torch.int64)).logits
        return out[0].float().numpy()

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(ids):]


# --------------------------------------------------------------------------- metrics


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@dataclass
class Totals:
    """Sums over the predicted positions of all windows."""

    positions: int = 0
    nll: float = 0.0
    ref_nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    #: the sum over positions of (the model's nll - the reference's nll)^2
    diff_sq: float = 0.0

    def add(self, targets: np.ndarray, lp: np.ndarray, ref_lp: np.ndarray | None) -> None:
        rows = np.arange(len(targets))
        self.positions += len(targets)
        nll = -lp[rows, targets]
        self.nll += float(nll.sum())
        if ref_lp is not None:
            ref_nll = -ref_lp[rows, targets]
            self.ref_nll += float(ref_nll.sum())
            self.diff_sq += float(np.square(nll - ref_nll).sum())
            p = np.exp(ref_lp)
            kl = (p * (ref_lp - lp)).sum(-1)
            self.kl += float(np.maximum(kl, 0.0).sum())  # >= 0; rounding can dip below
            self.agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())

    def nll_difference(self) -> tuple[float, float | None]:
        """The mean over positions of the model's nll minus the reference's (= ln of the
        perplexities' ratio) and its standard error over positions (None below two): the
        paired comparison of two models on the same tokens, as llama.cpp's
        `llama-perplexity --kl-divergence` reports ln(PPL(Q)/PPL(base)). Positions of one
        text are not independent draws, so the error is a yardstick, not a test."""
        n = self.positions
        mean = (self.nll - self.ref_nll) / n
        if n < 2:
            return mean, None
        var = max(0.0, self.diff_sq / n - mean * mean) * n / (n - 1)
        return mean, math.sqrt(var / n)


def non_finite(logits: np.ndarray, name: str, start: int, window: int) -> str | None:
    """Why a window's logits make no perplexity: the first position whose logits are NaN
    or infinite (None: all finite)."""
    bad = ~np.isfinite(logits).all(axis=-1)
    if not bad.any():
        return None
    row = int(np.argmax(bad))
    return (f"the logits of {name} are NaN or infinite at token {start + row} of the text "
            f"(window {window + 1}): it computes non-finite numbers there (damaged weights, "
            "or an overflow in its activation type), so there is no perplexity")


def _ppl(nll_sum: float, n: int) -> float:
    return math.exp(nll_sum / n) if nll_sum / n < 700 else math.inf


def first_disagreement(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


# --------------------------------------------------------------------------- the command


def _open_reference(args: argparse.Namespace, model: ModelFileScorer, text: str,
                    ids: list[int]) -> Scorer | None:
    ref: Scorer
    if args.reference is not None:
        mf = ModelFileScorer(args.reference, args.executor)
        if mf.vocab_size != model.vocab_size:
            raise EvalError(f"--reference '{args.reference}' has a vocabulary of "
                            f"{mf.vocab_size} tokens, the model file {model.vocab_size}: "
                            "compare compiles of the same model")
        if mf.encode(text)[:len(ids)] != ids:
            raise EvalError(f"--reference '{args.reference}' tokenizes the text differently "
                            "from the model file: compare compiles of the same model")
        ref = mf
    elif args.hf is not None:
        ref = HFScorer(args.hf)
        if ref.vocab_size != model.vocab_size:
            raise EvalError(f"--hf '{args.hf}' has a vocabulary of {ref.vocab_size} tokens, "
                            f"the model file {model.vocab_size}: pass the directory the model "
                            "file was compiled from")
    else:
        return None
    return ref


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation `args` asks for; the `--json` object."""
    text_file = TextFile(args.text, whole=args.max_tokens is None)  # before the model
    progress = None if args.quiet else sys.stderr
    try:
        model = ModelFileScorer(args.model_file, args.executor)
        text, ids = text_tokens(text_file, model.encode, args.max_tokens)
    finally:
        text_file.close()
    if len(ids) < 2:
        raise EvalError(f"--text '{args.text}' is {len(ids)} token long: perplexity needs at "
                        "least two tokens (one to predict from, one to predict)")
    ref = _open_reference(args, model, text, ids)
    window = min(s for s in (model.seq, ref.seq if ref else None) if s is not None)
    spans = windows(len(ids), window)
    tot = Totals()
    t0 = time.perf_counter()
    problem = None
    # a terminal: one progress line over the tokens; otherwise a line per window
    bar = progress_bar(sum(e - s for s, e in spans), "toptpu eval", quiet=args.quiet,
                       unit="tok")
    try:
        problem = _score_windows(model, ref, ids, spans, tot, bar, progress, t0)
    finally:
        bar.close()
    out: dict[str, Any] = {
        "schema": EVAL_JSON_SCHEMA,
        "model_file": args.model_file, "mode": model.mode, "executor": args.executor,
        "text_tokens": len(ids), "window": window, "windows": len(spans),
        "predicted_tokens": tot.positions,
        "nll": None, "perplexity": None, "reference": None, "problem": problem,
    }
    if problem is not None:
        return out
    out["nll"], out["perplexity"] = tot.nll / tot.positions, _ppl(tot.nll, tot.positions)
    if not math.isfinite(out["perplexity"]):
        out["problem"] = (f"the perplexity overflows a float (mean negative log-likelihood "
                          f"{out['nll']:.1f} nats): the model predicts this text hopelessly")
        out["perplexity"] = None
        return out
    if ref is not None:
        difference, stderr = tot.nll_difference()
        out["reference"] = {
            "kind": ref.kind, "path": ref.name,
            "nll": tot.ref_nll / tot.positions,
            "perplexity": _ppl(tot.ref_nll, tot.positions),
            "top1_agreement": tot.agree / tot.positions,
            "mean_kl": tot.kl / tot.positions,
            "nll_difference": difference,
            "nll_difference_stderr": stderr,
            "greedy": _greedy(model, ref, ids, args, progress),
        }
    return out


def _score_windows(model: ModelFileScorer, ref: Scorer | None, ids: list[int],
                   spans: list[tuple[int, int]], tot: Totals, bar: Any, progress: Any,
                   t0: float) -> str | None:
    """Score the text window by window into `tot`; the problem that stopped it (logits that
    are not finite), None when every window was scored. `bar` (a live progress line, drawn
    on a terminal) counts the tokens; without it, a line per window goes to `progress`."""
    for k, (s, e) in enumerate(spans):
        chunk = ids[s:e]
        targets = np.array(chunk[1:], np.int64)
        logits = model.logits(chunk)[:-1]
        ref_logits = ref.logits(chunk)[:-1] if ref else None
        problem = non_finite(logits, model.name, s, k) or (
            None if ref is None or ref_logits is None
            else non_finite(ref_logits, ref.name, s, k))
        if problem:
            return problem
        for r in range(0, len(targets), ROWS):  # f64 in blocks: [rows, V] at a time
            tot.add(targets[r:r + ROWS], log_softmax(logits[r:r + ROWS]),
                    None if ref_logits is None else log_softmax(ref_logits[r:r + ROWS]))
        if not bar.disable:
            bar.set_postfix_str(f"perplexity so far {_ppl(tot.nll, tot.positions):.4f}",
                                refresh=False)
            bar.update(e - s)
        elif progress:
            print(f"toptpu eval: window {k + 1}/{len(spans)} ({e - s} tokens): perplexity so "
                  f"far {_ppl(tot.nll, tot.positions):.4f} ({time.perf_counter() - t0:.1f}s)",
                  file=progress, flush=True)
    return None


def _greedy(model: ModelFileScorer, ref: Scorer, ids: list[int], args: argparse.Namespace,
            progress: Any) -> dict[str, Any]:
    """Greedy generation from the text's first tokens by both; where they first differ."""
    seqs = [s for s in (model.seq, ref.seq) if s is not None]
    prompt = ids[:min(args.prompt_tokens, min(seqs) - 1)]
    n = min(args.greedy_tokens, min(seqs) - len(prompt))
    if progress:
        print(f"toptpu eval: greedy generation of {n} tokens after {len(prompt)} text tokens",
              file=progress, flush=True)
    a, b = model.greedy(prompt, n), ref.greedy(prompt, n)
    return {"prompt_tokens": len(prompt), "generated_tokens": n,
            "first_disagreement": first_disagreement(a, b),
            "agreeing_tokens": sum(x == y for x, y in zip(a, b, strict=False)),
            "model_ids": a, "reference_ids": b}


def finite_or_null(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, infinity) replaced by None: what
    JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def summary(res: dict[str, Any]) -> str:
    lines = [f"{res['model_file']} ({res['mode']}): perplexity {res['perplexity']:.4f} "
             f"(nll {res['nll']:.4f}) over {res['predicted_tokens']} predicted tokens of "
             f"{res['text_tokens']}, {res['windows']} window(s) of at most {res['window']}"]
    ref = res["reference"]
    if ref is not None:
        g = ref["greedy"]
        where = ("never (all agree)" if g["first_disagreement"] is None
                 else f"at token {g['first_disagreement']}")
        lines.append(f"reference {ref['path']} ({ref['kind']}): perplexity "
                     f"{ref['perplexity']:.4f}; top-1 agreement {ref['top1_agreement']:.4f}, "
                     f"mean KL(reference || model) {ref['mean_kl']:.6g} nats")
        se = ref["nll_difference_stderr"]
        lines.append(f"ln(perplexity / reference's) {ref['nll_difference']:+.5f}"
                     + ("" if se is None else f" ± {se:.5f} (standard error over tokens)"))
        lines.append(f"greedy after {g['prompt_tokens']} text tokens: "
                     f"{g['agreeing_tokens']}/{g['generated_tokens']} tokens agree, first "
                     f"disagreement {where}")
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    """Perplexity of a model file on a text, and top-1 agreement, KL and greedy divergence
    against a reference model file or Hugging Face directory."""
    res = evaluate(args)
    if args.json:  # valid JSON whatever happened: a result that is not a number is null
        print(json.dumps(finite_or_null(res), allow_nan=False))
    if res["problem"] is not None:
        raise EvalError(res["problem"])
    if not args.json:
        print(summary(res))
    return 0


def add_eval_parser(sub: Any) -> None:
    e = sub.add_parser("eval", help=cmd_eval.__doc__)
    add_eval_args(e)
    e.set_defaults(fn=cmd_eval)
