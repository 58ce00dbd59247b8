"""First contact: each tool run the way a new user would (a real process), answering a mistake
in one line with README's exit codes, Ctrl-C included, and output that names things one way."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exstill_sdk import NotACardError, open_card
from exstill_sdk.harness.synthetic import write_checkpoint
from exstill_sdk.image.pack import pack_checkpoint

from .. import helpers
from .helpers import script, start_emu

ROOT = Path(__file__).resolve().parents[2]


def tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script(args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout
    )


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def as_foreground() -> None:
    """In the child before it runs: Ctrl-C as a terminal's foreground job has it. A test
    runner started in the background (nohup, a CI job) ignores SIGINT, every child inherits
    that, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def tiny_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helpers.tiny_image(tmp_path_factory.mktemp("tiny") / "tiny.img")


@pytest.fixture(scope="module")
def big_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 21 MB: an upload long enough to interrupt through a throttled link."""
    root = tmp_path_factory.mktemp("big")
    write_checkpoint(
        root / "ck", layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=4, vocab=512
    )
    pack_checkpoint(root / "ck", root / "big.img", "big")
    return root / "big.img"


# ------------------------------------------------------------ 1. a card without an image store


def test_a_card_without_a_store_says_so(tiny_image: Path) -> None:
    proc, url = start_emu()  # no --store
    try:
        for args in ((str(tiny_image),), ("--list",), ("--erase", "tiny")):
            out = tool("exstill-flash", *args, "--url", url)
            line = one_line(out.stderr)
            assert out.returncode == 1 and "has no image store" in line, line
            assert "start the emulator with --store DIR" in line
        info = json.loads(tool("exstill-info", "--url", url, "--json").stdout)
        names = ["prefetch", "pipelining", "trees", "outcomes", "sampled_trees"]
        assert info["features"] == names  # 8. names
    finally:
        stop(proc)


# ------------------------------------------------------------ 2. Ctrl-C


class ThrottledProxy:
    """A real TCP proxy that forwards host-to-card bytes at ``rate`` bytes a second and counts
    them, so that an upload is still running when the test interrupts it."""

    def __init__(self, upstream: str, rate: float) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.rate = rate
        self.forwarded = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            card = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, card, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(card, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttle: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if throttle:
                    self.forwarded += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_ctrl_c_during_flash_then_the_same_command_resumes(
    big_image: Path, tmp_path: Path, admin_key: Path
) -> None:
    packed = json.loads(tool("exstill-pack", "verify", str(big_image), "--json").stdout)
    proc, url = start_emu("--store", str(tmp_path / "store"), "--admin-key", str(admin_key))
    proxy = ThrottledProxy(url, rate=8e6)
    size = big_image.stat().st_size
    try:
        command = [str(big_image), "--key", str(admin_key), "--json"]
        flashing = subprocess.Popen(
            [script("exstill-flash"), *command, "--url", proxy.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=as_foreground,
        )
        deadline = time.monotonic() + 60
        while proxy.forwarded < size // 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.forwarded < size  # still uploading
        flashing.send_signal(signal.SIGINT)
        out, err = flashing.communicate(timeout=30)
        assert flashing.returncode == 130, err
        said = json.loads(out)  # --json: the interruption is one JSON object too
        assert said["exit"] == 130 and "the same command resumes from there" in said["error"]
        assert "Traceback" not in err

        again = tool("exstill-flash", *command, "--url", url)
        assert again.returncode == 0, again.stderr
        result = json.loads(again.stdout)
        assert len(result["resumed_from"]) == 1 and 0 < result["resumed_from"][0] < size
        assert result["bytes_sent"] == size - result["resumed_from"][0]
        # 7. one name for each value: the whole file's SHA-256 is the same everywhere
        listed = json.loads(tool("exstill-flash", "--url", url, "--list", "--json").stdout)
        assert result["file_sha256"] == packed["file_sha256"] == listed["images"][0]["file_sha256"]
        inspected = json.loads(tool("exstill-pack", "inspect", str(big_image), "--json").stdout)
        assert inspected["file_sha256"] == packed["file_sha256"]
        assert inspected["content_sha256"] == packed["content_sha256"]
        features = json.loads(tool("exstill-info", "--url", url, "--json").stdout)["features"]
        assert "image_store" in features
    finally:
        proxy.close()
        stop(proc)


def test_ctrl_c_during_pack_leaves_nothing_behind(tmp_path: Path) -> None:
    write_checkpoint(
        tmp_path / "ck", layers=4, hidden=1024, intermediate=2816, heads=8, kv_heads=4, vocab=4096
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    packing = subprocess.Popen(
        [
            script("exstill-pack"),
            str(tmp_path / "ck"),
            "-o",
            str(out_dir / "x.img"),
            "--target",
            "x",
            "--dtype",
            "int8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_foreground,
    )
    deadline = time.monotonic() + 60
    while not any(out_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)
    packing.send_signal(signal.SIGINT)
    _, err = packing.communicate(timeout=30)
    assert packing.returncode == 130 and one_line(err) == "exstill-pack: interrupted"
    assert list(out_dir.iterdir()) == []  # the partial file is gone; no image half-written


def test_ctrl_c_during_the_demo(demo_cache: Path) -> None:
    demo = subprocess.Popen(
        [script("exstill"), "demo", "--target", "small", "--runs", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_foreground,
    )
    assert demo.stdout is not None
    seen = ""
    while "continuation" not in seen:
        seen += demo.stdout.readline()
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == 130 and one_line(err) == "exstill demo: interrupted"


# ------------------------------------------------------------ 3. a server that is not a card


@pytest.fixture(params=["SSH-2.0", "HTTP/1.1 400"])
def not_a_card(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """An SSH-like server that speaks first, or an HTTP-like one that answers what it gets and
    hangs up; (its URL, the start of what it sends)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                if request.param == "SSH-2.0":
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                    conn.recv(4096)
                else:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", request.param
    listener.close()


def test_a_silent_server_is_a_handshake_that_timed_out_not_a_transfer() -> None:
    """A server that waits for the client to speak first and never answers a frame (as an HTTP
    server waits for a whole request line): the handshake gives up on its own deadline, not
    exstill-flash's transfer timeout, and says what to check."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                held.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        out = tool("exstill-flash", "--list", "--url", url, timeout=120)
        assert out.returncode == 1
        assert one_line(out.stderr) == (
            f"exstill-flash: {url} did not answer the handshake within 5 s: is it an Exstill "
            "card, and is it running?"
        )
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_server_that_is_not_a_card_is_named_at_once(not_a_card: tuple[str, str]) -> None:
    url, sent = not_a_card
    with pytest.raises(NotACardError, match="answered, but not as an Exstill card"):
        open_card(url, timeout=60)  # waiting for the timeout would be LinkTimeoutError
    for args in (("exstill-info", "--url", url), ("exstill-flash", "--list", "--url", url)):
        out = tool(*args, timeout=60)
        line = one_line(out.stderr)
        assert out.returncode == 1 and "not as an Exstill card" in line and sent in line
    out = tool("exstill-info", "--url", url, "--json", timeout=60)
    assert out.returncode == 1 and "not as an Exstill card" in json.loads(out.stdout)["error"]


# ------------------------------------------------------------ 4. one convention for six tools


@pytest.mark.parametrize(
    "args",
    [
        ("exstill", "demo", "--url", "bogus://x"),
        ("exstill-info", "--url", "bogus://x"),
        ("exstill-flash", "--list", "--url", "bogus://x"),
        ("exstill-bench", "roundtrip", "--url", "bogus://x"),
        ("exstill-pack", "inspect", "/nonexistent/x.img"),
        ("exstill-emu", "--listen", "udp://127.0.0.1:0"),
    ],
)
def test_every_tool_exits_2_for_a_mistyped_command(args: tuple[str, ...]) -> None:
    out = tool(*args)
    assert out.returncode == 2 and out.stdout == ""
    one_line(out.stderr)
    out = tool(*args, "--json")
    error = json.loads(out.stdout)
    assert out.returncode == 2 and error["ok"] is False and error["exit"] == 2 and error["error"]


def test_argument_errors_are_one_line_and_help_agrees() -> None:
    for args in (("exstill", "demo", "--k", "abc"), ("exstill-bench", "roundtrip", "--k", "x")):
        out = tool(*args)
        assert out.returncode == 2 and "--help" in one_line(out.stderr)
    assert "0..8" in tool("exstill", "demo", "--help").stdout
    assert "default tcp://127.0.0.1:0" in " ".join(tool("exstill-emu", "--help").stdout.split())


# ------------------------------------------------------------ 9. human text unless --json


def test_rollback_and_bench_print_text(tiny_image: Path, tmp_path: Path, admin_key: Path) -> None:
    proc, url = start_emu("--store", str(tmp_path / "store"), "--admin-key", str(admin_key))
    try:
        key = ("--key", str(admin_key))
        assert tool("exstill-flash", str(tiny_image), "--url", url, *key).returncode == 0
        again = tool("exstill-flash", str(tiny_image), "--url", url, "--allow-downgrade", *key)
        assert again.returncode == 0, again.stderr
        out = tool("exstill-flash", "--url", url, "--rollback", "tiny", *key)
        assert out.returncode == 0 and out.stdout.startswith("tiny: back on its previous image")
        out = tool("exstill-bench", "roundtrip", "--url", url, "--rounds", "50", "--streams", "2")
        assert out.returncode == 0 and "{" not in out.stdout and "p50" in out.stdout
    finally:
        stop(proc)


# ------------------------------------------------------------ 10, 14, 15. exstill-pack


def _tokenizer_of(directory: Path, tokens: int) -> None:
    vocab = {f"t{i}": i for i in range(tokens)}
    (directory / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}})
    )


def test_pack_paths_modes_vocab_and_sign(tmp_path: Path) -> None:
    ck = helpers.tiny_checkpoint(tmp_path / "ck")
    out = tool("exstill-pack", str(ck), "-o", "/nonexistent/dir/x.img", "--target", "x")
    line = one_line(out.stderr)
    assert out.returncode == 2 and "/nonexistent/dir" in line and ".partial" not in line
    out = tool("exstill-pack", str(tmp_path / "nodir"), "-o", str(tmp_path / "x.img"))
    assert out.returncode == 2  # --target missing: argparse first
    out = tool(
        "exstill-pack", str(tmp_path / "nodir"), "-o", str(tmp_path / "x.img"), "--target", "x"
    )
    assert out.returncode == 2 and "no such directory" in one_line(out.stderr)

    _tokenizer_of(ck, 80)  # names ids the model has no rows for: not its tokenizer
    out = tool("exstill-pack", str(ck), "-o", str(tmp_path / "x.img"), "--target", "x")
    assert out.returncode == 2 and "not this model's tokenizer" in one_line(out.stderr)
    _tokenizer_of(ck, 40)  # models pad their vocabulary: expected, and said so
    image = tmp_path / "x.img"
    assert tool("exstill-pack", str(ck), "-o", str(image), "--target", "x").returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert image.stat().st_mode & 0o777 == 0o666 & ~umask
    shown = tool("exstill-pack", "inspect", str(image)).stdout
    assert "vocab 40" in shown and "24 of them padding" in shown

    assert "Sign a packed image" in tool("exstill-pack", "sign", "--help").stdout
    keys = json.loads(
        tool("exstill-pack", "keygen", "--dir", str(tmp_path / "keys"), "--json").stdout
    )
    unsigned = json.loads(tool("exstill-pack", "verify", str(image), "--json").stdout)
    out = tool("exstill-pack", "sign", str(image), "--key", keys["private_key"], "--json")
    signed = json.loads(out.stdout)
    assert out.returncode == 0 and signed["key_id"] == keys["key_id"]
    assert signed["content_sha256"] == unsigned["content_sha256"]  # the same contents
    assert signed["file_sha256"] != unsigned["file_sha256"]  # a new trailer
    out = tool("exstill-pack", "verify", str(image), "--trusted-keys", str(tmp_path / "keys"))
    assert out.returncode == 0 and "signature checked" in out.stdout


# ------------------------------------------------------------ 11, 12, 13. examples


def example(
    name: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_quickstart_reports_its_own_stream() -> None:
    proc, url = start_emu()
    try:
        first = example("quickstart.py", "--url", url)
        second = example("quickstart.py", "--url", url)  # a card with another client's rounds
    finally:
        stop(proc)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    figures = [out.stdout.splitlines()[-1] for out in (first, second)]
    assert figures[0] == figures[1] and "accepted of" in figures[0]


def test_hf_example_uses_the_draft_image_it_is_given(tiny_image: Path, tmp_path: Path) -> None:
    helpers.tiny_image(tmp_path / "other.img", "other")
    proc, url = start_emu("--image", str(tmp_path / "other.img"))
    try:
        out = example("hf_generate.py", "--url", url, "--draft-image", str(tiny_image))
    finally:
        stop(proc)
    assert (
        out.returncode == 1 and "no target 'tiny'" in out.stderr and "exstill-flash" in out.stderr
    )
    out = example("hf_generate.py")  # the tiny model, its own weights as the draft
    assert out.returncode == 0, out.stderr
    assert "identical to model.generate" in out.stdout
    assert "deprecated" not in out.stderr  # 13. the current cache API, no notices


def test_examples_say_what_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()  # a transformers that is not there, as without the hf extra
    (shadow / "transformers.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    out = example("hf_generate.py", env=env)
    assert out.returncode == 2 and "pip install" in one_line(out.stderr)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    out = example("vllm_offline.py", "--model", str(tmp_path))
    assert out.returncode == 2 and "pip install vllm" in one_line(out.stderr)
