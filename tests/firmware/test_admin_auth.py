"""Who may change the card: image-store requests on a network link need the admin key, proven
by HMAC over a fresh nonce. Real emulator processes, real sockets."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from exstill_sdk import NotAuthorizedError, open_card
from exstill_sdk.card import Card
from exstill_sdk.flash import flash
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.auth import answer
from exstill_sdk.protocol.constants import ADMIN_OPCODES, Opcode
from exstill_sdk.protocol.frame import encode_frame
from exstill_sdk.protocol.framing import encode_stream_frame

from ..cli.helpers import script, start_emu
from ..cli.test_emu_cli import _fuzz_frames


def store_state(url: str, store: Path) -> tuple[object, ...]:
    """What a client sees of the store (list, targets served, engines) and the files' digests."""
    with open_card(url) as card:
        listed = sorted(
            (e.target, e.slot, e.state, e.version, e.sha256) for e in card.list_images()
        )
        served = sorted(t.name for t in card.info().targets)
        engines = card.info().engines
    files = sorted(
        (str(p.relative_to(store)), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in store.rglob("*")
        if p.is_file()
    )
    return listed, served, engines, files


@pytest.fixture
def keyed_card(images, tmp_path, admin_key):
    """An emulator with a store and an admin key, v1 of `tiny` flashed with the key."""
    store = tmp_path / "store"
    proc, url = start_emu("--store", str(store), "--context", "256", "--admin-key", str(admin_key))
    with open_card(url, key=admin_key) as card:
        assert flash(card, images["1"]).confirmed
    yield url, store, proc
    proc.terminate()
    proc.wait(10)


def admin_requests(card: Card, images: dict[str, Path]) -> dict[str, object]:
    """Every administration request, each sent and its outcome (the exception, or None)."""
    data = images["2"].read_bytes()
    begin = m.UploadBegin(len(data), hashlib.sha256(data).digest(), "tiny", "2")
    attempts = {
        "UPLOAD_BEGIN": lambda: card.upload_begin(begin),
        "UPLOAD_CHUNK": lambda: card.receive_pipelined(
            card.send_pipelined(Opcode.UPLOAD_CHUNK, m.UPLOAD_CHUNK_HEAD.pack(0, 0) + data[:1000]),
            Opcode.UPLOAD_CHUNK,
        ),
        "UPLOAD_END": lambda: card.upload_end(),
        "ACTIVATE": lambda: card.activate("tiny"),
        "CONFIRM": lambda: card.confirm("tiny"),
        "REVERT": lambda: card.revert("tiny"),
        "ERASE": lambda: card.erase("tiny"),
    }
    assert {Opcode[name] for name in attempts} == ADMIN_OPCODES
    outcomes: dict[str, object] = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            outcomes[name] = None
        except NotAuthorizedError as exc:
            outcomes[name] = exc
    return outcomes


def test_every_administration_request_is_refused_without_the_key(keyed_card, images):
    url, store, _ = keyed_card
    before = store_state(url, store)
    with open_card(url) as card:  # no key
        outcomes = admin_requests(card, images)
        assert all(isinstance(e, NotAuthorizedError) for e in outcomes.values()), outcomes
        assert "admin key" in str(outcomes["ERASE"])
        assert card.stats()["admin_refused"] >= len(ADMIN_OPCODES)
    assert store_state(url, store) == before


def test_a_wrong_key_is_refused_and_proves_nothing(keyed_card, images, tmp_path):
    url, store, _ = keyed_card
    before = store_state(url, store)
    with pytest.raises(NotAuthorizedError, match="wrong admin key"):
        open_card(url, key=os.urandom(32))
    with open_card(url) as card:  # answer a real challenge with the wrong key, then try all
        nonce = card.request(Opcode.AUTH_CHALLENGE)
        with pytest.raises(NotAuthorizedError):
            card.request(Opcode.AUTH, answer(os.urandom(32), nonce))
        outcomes = admin_requests(card, images)
        assert all(isinstance(e, NotAuthorizedError) for e in outcomes.values()), outcomes
    assert store_state(url, store) == before


class _Recorder:
    """A real TCP proxy that keeps every byte the client sends."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        card = socket.create_connection(self.upstream)

        def back() -> None:
            with contextlib.suppress(OSError):  # the client may be gone first
                while data := card.recv(65536):
                    client.sendall(data)
            client.close()

        threading.Thread(target=back, daemon=True).start()
        while data := client.recv(65536):
            self.sent += data
            card.sendall(data)
        card.close()


def test_a_recorded_authenticated_session_replayed_is_refused(keyed_card, images, admin_key):
    url, store, _ = keyed_card
    recorder = _Recorder(url)
    with open_card(recorder.url, key=admin_key) as card:
        card.erase("tiny")  # allowed: this session proved the key
    with open_card(url, key=admin_key) as card:
        assert flash(card, images["1"]).confirmed  # put it back
    before = store_state(url, store)
    host, port = url.removeprefix("tcp://").split(":")
    with socket.create_connection((host, int(port))) as replay:
        replay.sendall(bytes(recorder.sent))  # the same HELLO, AUTH answer and ERASE
        replay.shutdown(socket.SHUT_WR)
        _drain(replay)
    assert store_state(url, store) == before  # the old answer fits no new nonce
    with open_card(url) as card:
        assert card.stats()["admin_refused"] >= 2  # the AUTH and the ERASE


def _drain(sock: socket.socket) -> None:
    while sock.recv(65536):
        pass


def test_hostile_frames_leave_store_and_engines_as_they_were(keyed_card):
    url, store, _ = keyed_card
    before = store_state(url, store)
    rng = random.Random(18)
    host, port = url.removeprefix("tcp://").split(":")
    hello = encode_stream_frame(
        encode_frame(Opcode.HELLO, 1, 0, m.encode_hello_request(m.HelloRequest(1, 1, "fuzz")))
    )
    admin = [
        encode_stream_frame(encode_frame(rng.choice(sorted(ADMIN_OPCODES)), i, 0, payload))
        for i, payload in enumerate(
            [m.encode_name("tiny"), m.encode_name("lookup"), b"", rng.randbytes(60)] * 250
        )
    ]
    for _ in range(4):
        with socket.create_connection((host, int(port))) as fuzz:
            drained = threading.Thread(target=_drain, args=(fuzz,))
            drained.start()
            frames = [hello, *_fuzz_frames(rng, rng.getrandbits(32), 5_000), *admin]
            rng.shuffle(frames)
            for start in range(0, len(frames), 200):
                fuzz.sendall(b"".join(frames[start : start + 200]))
            fuzz.shutdown(socket.SHUT_WR)
            drained.join(20)
    assert store_state(url, store) == before


def test_the_right_key_flashes_over_tcp(keyed_card, images, admin_key):
    url, _, _ = keyed_card
    with open_card(url, key=admin_key) as card:
        result = flash(card, images["2"])
        assert result.confirmed
        assert {e.version for e in card.list_images() if e.state == 3} == {"2"}


def test_a_key_file_is_private_and_never_printed(tmp_path):
    path = tmp_path / "card.key"
    out = subprocess.run(
        [script("exstill-flash"), "--new-key", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and str(path) in out.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    assert len(bytes.fromhex(secret)) == 32
    assert secret not in out.stdout + out.stderr
    again = subprocess.run(
        [script("exstill-flash"), "--new-key", str(path)], capture_output=True, text=True
    )
    assert again.returncode == 2 and "exists" in again.stderr and secret not in again.stderr
    assert path.read_text().strip() == secret  # not overwritten


def test_listening_beyond_loopback_needs_a_key_or_insecure(admin_key):
    refused = subprocess.run(
        [script("exstill-emu"), "--listen", "tcp://0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--admin-key" in refused.stderr
    assert "--insecure" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    for extra in (("--admin-key", str(admin_key)), ("--insecure",)):
        proc = subprocess.Popen(
            [script("exstill-emu"), "--listen", "tcp://0.0.0.0:0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("tcp://")
        finally:
            proc.terminate()
            proc.wait(10)


def _own_address() -> str | None:
    """This host's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address: str = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_client_on_another_host_proves_the_key_even_to_draft(admin_key):
    address = _own_address()
    if address is None:
        pytest.skip("no non-loopback interface to connect through")
    proc = subprocess.Popen(
        [script("exstill-emu"), "--listen", f"tcp://{address}:0", "--admin-key", str(admin_key)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        # the handshake is open to all, drafting is not
        with open_card(url) as card, pytest.raises(NotAuthorizedError, match="another host"):
            card.open_stream()
        with open_card(url, key=admin_key) as card, card.open_stream() as s:
            s.prefill([1, 2, 1, 2])
            assert s.draft(2).tokens == (1, 2)
    finally:
        proc.terminate()
        proc.wait(10)
