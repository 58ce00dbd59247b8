"""exstill-emu as a separate process: serving, shutdown, and surviving a fuzzing client."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import threading

import pytest

from exstill_sdk import open_card
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import Opcode
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.protocol.frame import encode_frame
from exstill_sdk.protocol.framing import encode_stream_frame

from ..helpers import tiny_image
from .helpers import script, start_emu


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_several_clients_and_exits_cleanly(sig: signal.Signals) -> None:
    proc, url = start_emu("--streams", "3", "--context", "512")
    try:
        with open_card(url) as a, open_card(url) as b:
            assert (a.info().slots, a.info().context) == (3, 512)
            sa, sb = a.open_stream(), b.open_stream()
            sa.prefill([1, 2, 3, 1, 2])
            sb.prefill([4, 5, 6, 4, 5])
            assert sa.draft(2).tokens == (3, 1) and sb.draft(2).tokens == (6, 4)
    finally:
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=10)
    # Ctrl-C (SIGINT) exits 130 like every tool's interruption; SIGTERM is a clean stop
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err
    assert "stopped after" in err and len(err.strip().splitlines()) == 1


def test_json_first_line_and_bad_arguments() -> None:
    proc = subprocess.Popen(
        [script("exstill-emu"), "--listen", "tcp://127.0.0.1:0", "--json"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["url"] == f"tcp://127.0.0.1:{info['port']}" and info["port"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    bad = subprocess.run(
        [script("exstill-emu"), "--listen", "udp://x:1"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "tcp://HOST:PORT" in bad.stderr
    bad = subprocess.run(
        [script("exstill-emu"), "--engine", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "lookup" in bad.stderr


def _fuzz_frames(rng: random.Random, handle: int, n: int) -> list[bytes]:
    """n frames: random bytes, mutated valid frames, and well-formed frames with hostile
    contents (random opcodes, handles and payloads under a correct CRC)."""
    valid = [
        encode_frame(Opcode.HELLO, 1, 0, m.encode_hello_request(m.HelloRequest(1, 1))),
        encode_frame(Opcode.DRAFT, 2, handle, b"\x04"),
        encode_frame(Opcode.COMMIT, 3, handle, m.encode_commit_request(m.CommitRequest(2, 5, 4))),
        encode_frame(Opcode.PREFILL, 4, handle, m.encode_tokens([1, 2, 3])),
        encode_frame(Opcode.ROLLBACK, 5, handle, m.encode_u32(1)),
        encode_frame(Opcode.OPEN, 6, 0, m.encode_open_request(m.OpenRequest(0, "lookup"))),
        encode_frame(Opcode.STATS, 7, 0),
    ]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(encode_stream_frame(rng.randbytes(rng.randint(0, 80))))
        elif kind == 1:
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            out.append(encode_stream_frame(bytes(frame[: rng.randint(1, len(frame))])))
        elif kind == 2:
            op = rng.choice([*Opcode, rng.randrange(256)])
            h = rng.choice([handle, handle ^ 0x100, rng.getrandbits(32), 0])
            payload = rng.randbytes(rng.randint(0, 40))
            out.append(encode_stream_frame(encode_frame(op, rng.getrandbits(16), h, payload)))
        else:
            out.append(rng.randbytes(rng.randint(1, 60)))  # raw garbage, maybe no delimiter
    return out


def test_ten_thousand_hostile_frames_leave_the_card_serving() -> None:
    proc, url = start_emu("--context", "4096")
    try:
        host, port = url.removeprefix("tcp://").split(":")
        fuzz = socket.create_connection((host, int(port)))
        drained = threading.Event()

        def drain() -> None:
            while fuzz.recv(65536):
                pass
            drained.set()

        threading.Thread(target=drain, daemon=True).start()
        rng = random.Random(20261130)
        with open_card(url) as victim_card:
            victim = victim_card.open_stream()
            victim.prefill([11, 12, 13, 11, 12])
            frames = _fuzz_frames(rng, victim.handle, 10_000)
            # Shake hands first so that hostile stream requests reach the stream table.
            hello = m.encode_hello_request(m.HelloRequest(1, 1, "fuzz"))
            fuzz.sendall(encode_stream_frame(encode_frame(Opcode.HELLO, 1, 0, hello)))
            for start in range(0, len(frames), 100):
                fuzz.sendall(b"".join(frames[start : start + 100]))
            fuzz.sendall(b"\x00")
            # The stream that another connection tried to hijack is untouched.
            assert victim.draft(3).tokens == (13, 11, 12)
        fuzz.shutdown(socket.SHUT_WR)  # the card sees the client go; its replies drain
        assert drained.wait(10)
        fuzz.close()
        # A new, valid client gets exactly what the in-process card gives.
        pattern = [rng.randrange(50000) for _ in range(30)]
        results = []
        for card_url in (url, "emu://"):
            with open_card(card_url) as card, card.open_stream() as s:
                s.prefill(pattern * 3)
                d = s.draft(6)
                seen = [d.tokens]
                for r in range(50):
                    d = s.commit(Verdict(len(d.tokens), pattern[r % 30]), 6)
                    seen.append(d.tokens)
                results.append(seen)
        assert results[0] == results[1]
        assert proc.poll() is None
        with open_card(url) as card:
            stats = card.stats()
        assert stats["frames_dropped"] > 1000 and stats["errors.bad_handle"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_serves_a_target_image(tmp_path) -> None:
    """exstill-emu --image: the image is checked, listed in the handshake and drafts."""

    tiny_image(tmp_path / "t.img", vocab=96)
    proc, url = start_emu("--image", str(tmp_path / "t.img"), "--context", "256")
    try:
        with open_card(url) as card:
            (target,) = card.info().targets
            assert target.name == "tiny" and target.vocab_size == 96
            with card.open_stream(target="tiny") as s:
                s.prefill([5, 6, 7, 8])
                assert len(s.draft(4).tokens) == 4
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    data = bytearray((tmp_path / "t.img").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "bad.img").write_bytes(bytes(data))
    bad = subprocess.run(
        [script("exstill-emu"), "--image", str(tmp_path / "bad.img")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "digest mismatch" in bad.stderr  # the image said no


def test_a_busy_port_is_one_line_that_says_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [script("exstill-emu"), "--listen", f"tcp://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"exstill-emu: --listen tcp://127.0.0.1:{port}: the address is in use; choose another "
        "(port 0 takes a free one)"
    )
