"""Images, eval texts and chat lines read within bounds, and results that are numbers
(issue 44, parts 5 and 7).

- An image is refused by its declared size before it is decoded (a 68-byte PNG claiming
  50000 x 50000; a real PNG over MAX_IMAGE_PIXELS), and when it is not a regular file (a
  FIFO named x.png hung `run` and `chat`); in `chat` such an image leaves the conversation
  going.
- `eval --text`: a FIFO is refused (it hung), a text over MAX_TEXT_BYTES is refused from its
  size, `--max-tokens N` reads only the start of the text its tokens need (a 16 MB text
  with --max-tokens 100 took 3.3 GB) and gives the whole text's first N tokens.
- `chat`: a line longer than fits the KV cache is refused without being tokenized (a
  10 MB line took 1.9 GB).
- `eval --json` of a model file whose logits are not finite prints valid JSON (null, with
  the reason) and exits 1 (it printed `"perplexity": Infinity`, status 0).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from fuzz import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from llm_fixtures import compiled
from test_cli_errors import SEQ64, assert_one_error, cli

from toptpu.backend.runtime.runtime import Runtime
from toptpu.backend.runtime.vision import MAX_IMAGE_PIXELS, ImageError, load_image
from toptpu.command_io import LineTooLong, message_limit, read_line
from toptpu.eval_cli import MAX_TEXT_BYTES, ModelFileScorer, TextFile, text_tokens


@pytest.fixture
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(tmp_path_factory, "qwen2", **SEQ64).model_file


def _png_claiming(path: str, width: int, height: int) -> str:
    """A PNG whose header claims width x height and whose data is a few bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b""))
    return path


# --------------------------------------------------------------------------- images


def test_images_are_refused_by_their_declared_size_before_decoding(tmp_path) -> None:
    bomb = _png_claiming(str(tmp_path / "bomb.png"), 50000, 50000)
    assert os.path.getsize(bomb) < 100
    with pytest.raises(ImageError, match=r"claims 2500000000 pixels, more than toptpu decodes "
                                         r"\(67108864 pixels, 8192x8192\): downscale it"):
        load_image(bomb)
    just_over = _png_claiming(str(tmp_path / "over.png"), 8192, 8193)
    with pytest.raises(ImageError, match=r"is 8192x8193 \(67117056 pixels\), more than"):
        load_image(just_over)
    at_limit = _png_claiming(str(tmp_path / "limit.png"), 8192, 8192)
    assert 8192 * 8192 == MAX_IMAGE_PIXELS
    with pytest.raises(ImageError, match="is corrupt or truncated"):  # decoded: no pixels
        load_image(at_limit)


def test_a_real_large_png_is_refused_in_bounded_memory(tmp_path) -> None:
    """A real 9000 x 9000 PNG (a few hundred kB; 81 Mpx, 243 MB decoded as RGB): refused
    from its header; the process that tries it stays far below what decoding takes."""
    from PIL import Image

    path = str(tmp_path / "big.png")
    Image.new("RGB", (9000, 9000), (10, 20, 30)).save(path, optimize=True)
    code = ("import sys\n"
            "from toptpu.backend.runtime.vision import ImageError, load_image\n"
            "try:\n    load_image(sys.argv[1])\nexcept ImageError as e:\n    print(e)\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print(int(hwm.split()[1]) // 1024)\n")  # this process's peak resident MB
    res = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=120)
    message, peak_mb = res.stdout.strip().splitlines()
    assert "is 9000x9000 (81000000 pixels), more than toptpu decodes" in message, res.stderr
    assert int(peak_mb) < 200, peak_mb  # decoding alone would take 243 MB


def test_an_image_that_is_not_a_regular_file(tmp_path, capsys) -> None:
    """A FIFO named x.png (the probe: `run` and `chat` hung on it) is refused at once, and by
    `run` before the model file is even read."""
    fifo = str(tmp_path / "x.png")
    os.mkfifo(fifo)
    with pytest.raises(ImageError, match="is a FIFO, not an image file"):
        load_image(fifo)
    with pytest.raises(ImageError, match="is a directory"):
        load_image(str(tmp_path))
    code, _, err = cli(["run", str(tmp_path / "none.toptpu"), "--prompt", "hi", "--image",
                        fifo], capsys)
    assert_one_error(code, err, "run", f"image '{fifo}' is a FIFO, not an image file")
    code, _, err = cli(["run", str(tmp_path / "none.toptpu"), "--prompt", "hi", "--video",
                        str(tmp_path / "a.png"), fifo], capsys)
    assert_one_error(code, err, "run", "does not exist")


@pytest.mark.slow  # compiles a tiny VLM
def test_chat_goes_on_after_a_hostile_image(tmp_path_factory, tmp_path, monkeypatch,
                                            capsys) -> None:
    """In `chat`, the bomb PNG (the probe: DecompressionBombError ended the conversation)
    and a FIFO are answered with one line each; the next message is replied to."""
    from vlm_fixtures import vlm_file

    model = vlm_file(tmp_path_factory, "internvl")
    bomb = _png_claiming(str(tmp_path / "bomb.png"), 50000, 50000)
    fifo = str(tmp_path / "x.png")
    os.mkfifo(fifo)
    lines = iter([f"/image {bomb}", f"/image {fifo}", "Hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, _, err = cli(["chat", model, "--max-new-tokens", "2", "--executor",
                        "interpreter"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "claims 2500000000 pixels, more than toptpu decodes" in err
    assert "is a FIFO, not an image file" in err
    assert "[2 tokens, stop: max_new_tokens" in err


# --------------------------------------------------------------------------- eval texts


def test_eval_refuses_a_fifo_and_a_text_over_the_limit_before_reading(model_file, tmp_path,
                                                                      capsys) -> None:
    fifo = str(tmp_path / "t.txt")
    os.mkfifo(fifo)
    code, _, err = cli(["eval", model_file, "--text", fifo], capsys)
    assert_one_error(code, err, "eval", f"--text '{fifo}' is a FIFO")
    big = str(tmp_path / "big.txt")
    with open(big, "wb") as f:  # sparse: its size says it all, nothing needs reading
        f.truncate(16 * 2**20)
    code, _, err = cli(["eval", model_file, "--text", big], capsys)
    assert_one_error(code, err, "eval", f"is {16 * 2**20} bytes, more than {MAX_TEXT_BYTES} "
                     "(4 MiB); pass a shorter text, or --max-tokens N")


_LINE = st.text(st.sampled_from("abcdefghij klmnop.,!?\n\t ÄéΩ中"), min_size=0, max_size=40)


@fuzz_settings(40)
@given(lines=st.lists(_LINE, min_size=1, max_size=400), n=st.integers(2, 300))
def test_max_tokens_reads_only_the_start_and_gives_the_texts_first_tokens(
        model_file, tmp_path_factory, lines: list[str], n: int) -> None:
    """--max-tokens N: the tokens of the prefix read are the whole text's first N (the
    prefix is cut at a line end and gives N + 16 tokens), and no more of the file is read
    than those tokens need."""
    rt = _runtime(model_file)
    text = "\n".join(lines)
    if not text.strip():
        return
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "prefix.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    f = TextFile(path, whole=False)
    read: list[int] = []
    original = f.read

    def counting(k: int | None = None) -> bytes:
        data = original(k)
        read.append(len(data))
        return data

    f.read = counting  # type: ignore[method-assign]
    try:
        _, ids = text_tokens(f, rt.encode, n)
    finally:
        f.close()
    assert ids == rt.encode(text)[:n]
    assert max(read) <= max(16 * (n + 16) * 4 ** 3, 1)  # a few growing pieces at most


def test_a_16_mb_text_with_max_tokens_reads_kilobytes(model_file, tmp_path, capsys) -> None:
    """The probe's case: 16 MB of text, --max-tokens 100 (3.3 GB before): the result is
    the one of the text's first 100 tokens, and the file is read no further than ~7 kB."""
    from toptpu.demo_smollm2 import DEMO_TEXT

    path = str(tmp_path / "big.txt")
    with open(path, "w") as f:
        f.write((DEMO_TEXT + "\n") * (16_000_000 // (len(DEMO_TEXT) + 1)))
    small = str(tmp_path / "small.txt")
    with open(small, "w") as f:
        f.write((DEMO_TEXT + "\n") * 3)
    code, out, err = cli(["eval", model_file, "--text", path, "--max-tokens", "100",
                          "--json", "--quiet", "--executor", "interpreter"], capsys)
    assert code == 0, err
    big = json.loads(out)
    code, out, err = cli(["eval", model_file, "--text", small, "--max-tokens", "100",
                          "--json", "--quiet", "--executor", "interpreter"], capsys)
    assert code == 0, err
    assert big["text_tokens"] == 100 and big["perplexity"] == json.loads(out)["perplexity"]


def strict_json(text: str) -> dict:
    """`text` parsed as JSON proper: NaN and Infinity (Python's extension) refused."""
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


_RT: dict[str, Runtime] = {}


def _runtime(path: str) -> Runtime:
    if path not in _RT:
        _RT[path] = Runtime.open(path, "interpreter")
    return _RT[path]


# --------------------------------------------------------------------------- not finite


def test_eval_json_of_logits_that_are_not_finite(model_file, text_file_path, capsys,
                                                 monkeypatch) -> None:
    """NaN logits at one position: valid JSON (perplexity and nll null, the reason in
    `problem`), one error line naming where, status 1; without --json the line alone."""
    logits = ModelFileScorer.logits

    def nan_at_3(self: ModelFileScorer, ids: list[int]) -> np.ndarray:
        out = np.array(logits(self, ids))
        out[3, 5] = np.nan
        return out

    monkeypatch.setattr(ModelFileScorer, "logits", nan_at_3)
    code, out, err = cli(["eval", model_file, "--text", text_file_path, "--json", "--quiet",
                          "--executor", "interpreter"], capsys)
    res = strict_json(out)
    assert res["perplexity"] is None and res["nll"] is None
    assert res["problem"].startswith(f"the logits of {model_file} are NaN or infinite at "
                                     "token 3 of the text (window 1)")
    assert_one_error(code, err, "eval", "are NaN or infinite at token 3")
    code, out, err = cli(["eval", model_file, "--text", text_file_path, "--quiet",
                          "--executor", "interpreter"], capsys)
    assert out == ""
    assert_one_error(code, err, "eval", "are NaN or infinite at token 3")


@pytest.fixture
def text_file_path(tmp_path) -> str:  # noqa: ANN001
    path = tmp_path / "text.txt"
    path.write_text("Hello world! The tensor processor runs the compiled model. Each layer is "
                    "compiled once, and the weights of every layer are bound by address.\n")
    return str(path)


@pytest.mark.slow  # compiles a model whose lm_head has a NaN row
def test_eval_of_a_model_file_with_a_nan_weight(tmp_path_factory, tmp_path, capsys,
                                                text_file_path) -> None:
    """End to end: a checkpoint with one NaN row of its lm_head compiles (only layer 0 is
    checked for NaN), and its eval is valid JSON with the reason, status 1."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from toptpu.compiler import compile as compile_model

    src = str(tmp_path / "ck")
    shutil.copytree(compiled(tmp_path_factory, "qwen2", **SEQ64).model_dir, src)
    shard = os.path.join(src, "model.safetensors")
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].copy()
    tensors["lm_head.weight"][5] = np.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    out = str(tmp_path / "nan.toptpu")
    compile_model(src, out, seq_length=64, max_input_length=16, progress=None)
    code, stdout, err = cli(["eval", out, "--text", text_file_path, "--json", "--quiet"],
                            capsys)
    res = strict_json(stdout)
    assert res["perplexity"] is None and "NaN or infinite at token 0" in res["problem"]
    assert_one_error(code, err, "eval", "NaN or infinite")


# --------------------------------------------------------------------------- chat lines


def test_read_line_holds_no_more_than_its_limit() -> None:
    stream = io.StringIO("x" * 100_000 + "\nnext\n" + "y" * 10 + "\n")
    with pytest.raises(LineTooLong, match="longer than 64 characters"):
        read_line("", 64, stream)
    assert read_line("", 64, stream) == "next"
    assert read_line("", 10, stream) == "y" * 10  # exactly the limit
    with pytest.raises(EOFError):
        read_line("", 64, stream)


def test_the_chat_limit_is_what_the_kv_cache_could_hold(model_file) -> None:
    rt = _runtime(model_file)
    vocab = rt.tokenizer.backend.get_vocab()
    limit = message_limit(vocab, rt.seq)
    longest = max(len(t) for t in vocab)
    assert limit == rt.seq * longest * 4
    # a line of the longest token repeated beyond the limit cannot fit the cache
    token = max(vocab, key=len)
    assert len(rt.encode(token * (rt.seq + 1))) > rt.seq


@pytest.mark.slow  # chats in a process
def test_a_10_mb_chat_line_is_refused_without_tokenizing_it(model_file) -> None:
    """The probe: a 10 MB line took 1.9 GB before its refusal. Now it is dropped while it is
    read (the process stays small) and the conversation goes on."""
    code = ("import sys\nfrom toptpu.cli import main\nrc = main(sys.argv[1:])\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print('maxrss_mb', int(hwm.split()[1]) // 1024, file=sys.stderr)\n"
            "sys.exit(rc)\n")  # VmHWM: this image's peak (ru_maxrss keeps the forked one's)
    res = subprocess.run([sys.executable, "-c", code, "chat", model_file, "--max-new-tokens",
                          "2", "--executor", "interpreter"],
                         input="a" * 10_000_000 + "\nHello\n/exit\n", capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "[the line is longer than" in res.stderr and "more than fits the KV cache; not " \
        "sent]" in res.stderr
    assert "[2 tokens, stop: max_new_tokens" in res.stderr
    rss = int(res.stderr.split("maxrss_mb ")[1].split()[0])
    assert rss < 500, rss
