"""`toptpu serve`'s checks before it opens the model or binds a socket (fast: no model
compiled, no server started): a non-loopback address needs an API key, the system prompt
file is read within bounds, an image comes only from a `data:` URL."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from toptpu.cli import main
from toptpu.serve_cli import is_loopback


def serve_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one error line of `toptpu serve ARGS` (exit 1)."""
    capsys.readouterr()
    assert main(["serve", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.com", False),
    ("localhost.example.com", False)])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_beyond_loopback_needs_a_key_before_anything_opens(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.delenv("TOPTPU_API_KEY", raising=False)
    missing = str(tmp_path / "nothing.toptpu")  # never opened: the address is refused first
    for host in ("0.0.0.0", "::", "10.0.0.1"):
        line = serve_error(capsys, missing, "--host", host)
        assert line == (f"toptpu serve: error: --host {host} is not a loopback address: give "
                        "--api-key KEY (or $TOPTPU_API_KEY; clients send it as "
                        "'Authorization: Bearer KEY') to serve beyond this machine")
    # with a key (or $TOPTPU_API_KEY) the next check is the model file's
    line = serve_error(capsys, missing, "--host", "0.0.0.0", "--api-key", "k")
    assert "cannot open model file" in line
    monkeypatch.setenv("TOPTPU_API_KEY", "k")
    assert "cannot open model file" in serve_error(capsys, missing, "--host", "0.0.0.0")


def test_the_system_prompt_file_is_checked(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing.toptpu")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe system")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)
    cases = [(str(tmp_path / "absent.txt"), "No such file or directory"),
             (str(empty), "is empty"), (str(binary), "is not UTF-8 text"),
             (str(big), "is over 16 MiB"), (str(tmp_path), "Is a directory")]
    for path, words in cases:
        line = serve_error(capsys, missing, "--system-prompt-file", path)
        assert line.startswith(f"toptpu serve: error: --system-prompt-file '{path}'"), line
        assert words in line, line
    assert not os.path.exists(missing)


def test_other_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing.toptpu")
    assert serve_error(capsys, missing, "--shutdown-grace", "nan") == \
        "toptpu serve: error: --shutdown-grace must be a number of seconds >= 0"
    assert serve_error(capsys, missing) == \
        f"toptpu serve: error: cannot open model file '{missing}': No such file or directory"


def test_an_image_comes_only_from_a_data_url() -> None:
    pytest.importorskip("starlette")
    from toptpu.backend.runtime.serving import ServeError
    from toptpu.serve import data_url_bytes

    png = b"\x89PNG\r\n\x1a\n"
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(png).decode(),
                          "u") == png
    for url, words in [("https://example.com/a.png", "a https URL is not fetched"),
                       ("http://127.0.0.1/a.png", "a http URL is not fetched"),
                       ("file:///etc/passwd", "a file URL is not fetched"),
                       ("a.png", "a relative URL is not fetched"),
                       ("data:image/png,rawbytes", "must be base64"),
                       ("data:image/png;base64,!!", "not valid base64")]:
        with pytest.raises(ServeError) as e:
            data_url_bytes(url, "u")
        assert e.value.status == 400 and words in str(e.value), (url, str(e.value))
