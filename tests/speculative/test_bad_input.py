"""Typed errors, never a token that is not the target's."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import TcpCardServer, build_engines

from exstill_sdk import (
    ContextFullError,
    ExstillError,
    InvalidArgumentError,
    TargetOutputError,
    TokenizerMismatchError,
    open_card,
)
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.protocol.constants import Opcode
from exstill_sdk.protocol.framing import Deframer
from exstill_sdk.speculative import SpeculativeDecoder

from ..helpers import served, tiny_image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    tiny_image(root / "tiny.img", vocab=32, seed=1)
    # the same weights packed for another tokenizer (same size, other strings)
    other = json.loads((root / "tiny.ckpt" / "tokenizer.json").read_text())
    other["model"]["vocab"] = {f"x{i}": i for i in range(32)}
    (root / "other-tokenizer.json").write_text(json.dumps(other))
    pack_checkpoint(
        root / "tiny.ckpt", root / "foreign.img", "foreign", tokenizer=root / "other-tokenizer.json"
    )
    tiny_image(root / "wide.img", "wide", vocab=40, seed=1)
    return root


def test_tokenizer_and_vocabulary_mismatch(tiny: Path) -> None:
    target = OnnxTarget(tiny / "tiny.img", positions=64)
    images = f"{tiny / 'foreign.img'},{tiny / 'wide.img'},{tiny / 'tiny.img'}"
    with open_card(f"emu://?image={images}&context=64") as card:
        with pytest.raises(TokenizerMismatchError, match="tokenizer"):
            SpeculativeDecoder(card, target, draft="foreign")
        with pytest.raises(TokenizerMismatchError, match="40 tokens"):
            SpeculativeDecoder(card, target, draft="wide")
        SpeculativeDecoder(card, target, draft="tiny")  # the matching image is fine


class Faulty(OnnxTarget):
    """A target that goes wrong in a given round."""

    def __init__(self, path: Path, fault: str, at_round: int) -> None:
        super().__init__(path, positions=64)
        self.fault, self.at_round, self.rounds = fault, at_round, 0

    def verify(self, seq_id, context, draft):
        logits = super().verify(seq_id, context, draft)
        self.rounds += 1
        if self.rounds == self.at_round:
            if self.fault == "shape":
                return logits[:-1]
            logits = logits.copy()
            logits[0, 0] = np.nan
        return logits


@pytest.mark.parametrize("fault", ["shape", "nan"])
def test_bad_logits_stop_before_any_unverified_token(tiny: Path, fault: str) -> None:
    reference = OnnxTarget(tiny / "tiny.img", positions=64).greedy([1, 2, 3], 20)
    target = Faulty(tiny / "tiny.img", fault, at_round=3)
    got: list[int] = []
    with open_card(f"emu://?image={tiny / 'tiny.img'}&context=64") as card:
        decoder = SpeculativeDecoder(card, target, draft="tiny", k=2)
        with pytest.raises(TargetOutputError, match=r"shape|NaN"):
            for token in decoder.stream([1, 2, 3], 20, stop_token_ids=[]):
                got.append(token)
        assert card.stats()["streams_open"] == 0  # the stream was closed
    assert got and got == reference[: len(got)]


def test_prompt_longer_than_the_context(tiny: Path) -> None:
    target = OnnxTarget(tiny / "tiny.img", positions=128)  # the card's slot binds
    with open_card(f"emu://?image={tiny / 'tiny.img'}&context=64") as card:
        decoder = SpeculativeDecoder(card, target, draft="tiny")
        with pytest.raises(ContextFullError, match="64-token slot") as refused:
            decoder.generate(list(range(1, 30)) * 2, 10)
        assert str(refused.value).endswith("shorten them or use long_context=True")
        # the advice works: a target stream outgrows its slot with long_context
        long = SpeculativeDecoder(card, target, draft="tiny", long_context=True)
        assert len(long.generate(list(range(1, 30)) * 2, 3, stop_token_ids=[]).tokens) == 3
        # the lookup engine has no long-context mode: the advice says to draft with a target
        lookup = SpeculativeDecoder(card, target, engine="lookup")
        with pytest.raises(ContextFullError, match="built-in engines have no long-context mode"):
            lookup.generate(list(range(1, 30)) * 2, 10)


def test_a_slot_longer_than_the_target_holds(tiny: Path) -> None:
    """A 2048-token slot for a model of 48 positions (a 16K slot for an 8K model, small): the
    target's max_position_embeddings bounds a request, not the card's slot."""
    transformers = pytest.importorskip("transformers")
    from exstill_sdk.adapters.hf import HFTarget

    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny / "tiny.ckpt", max_position_embeddings=48
    )
    target = HFTarget(model)
    assert target.max_positions == 48
    prompt = list(range(1, 31)) + list(range(1, 11))
    with open_card(f"emu://?image={tiny / 'tiny.img'}&context=2048") as card:
        decoder = SpeculativeDecoder(card, target, draft="tiny")
        with pytest.raises(InvalidArgumentError, match="exceed the target's 48 positions"):
            decoder.generate(prompt, 9)
        assert card.stats()["streams_opened"] == 0  # refused before any work
        assert len(decoder.generate(prompt, 8, stop_token_ids=[]).tokens) == 8


def test_card_disappearing_mid_round(tiny: Path) -> None:
    runtime = CardRuntime(
        4, 128, build_engines([], [tiny / "tiny.img"], 4, 128), background_prefetch=False
    )
    server = TcpCardServer(runtime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    reference = OnnxTarget(tiny / "tiny.img", positions=128).greedy([4, 5, 6], 60)
    target = OnnxTarget(tiny / "tiny.img", positions=128)
    got: list[int] = []
    card = open_card(server.url, timeout=2)
    decoder = SpeculativeDecoder(card, target, draft="tiny", k=2)
    with pytest.raises(ExstillError):
        for token in decoder.stream([4, 5, 6], 60, stop_token_ids=[]):
            got.append(token)
            if len(got) == 10:
                server.stop()
                server.close()
    card.close()
    thread.join(5)
    runtime.shutdown()
    assert len(got) >= 10 and got == reference[: len(got)]


class _DropAtClose:
    """A real TCP proxy that forwards every frame until the client sends CLOSE, then drops
    both connections (a link lost exactly when a finished sequence frees its stream)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream = upstream
        self.dropped = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        card = socket.create_connection(self.upstream)

        def back() -> None:
            with contextlib.suppress(OSError):
                while data := card.recv(65536):
                    client.sendall(data)

        threading.Thread(target=back, daemon=True).start()
        deframer = Deframer()
        while data := client.recv(65536):
            if any(frame[1] == Opcode.CLOSE for frame in deframer.feed(data)):
                self.dropped.set()
                break
            card.sendall(data)
        for sock in (client, card):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_link_lost_at_close_keeps_the_finished_generation(tiny: Path) -> None:
    runtime = CardRuntime(
        4, 128, build_engines([], [tiny / "tiny.img"], 4, 128), background_prefetch=False
    )
    reference = OnnxTarget(tiny / "tiny.img", positions=128).greedy([4, 5, 6], 40)
    with served(runtime) as server:
        proxy = _DropAtClose((server.host, server.port))
        with open_card(proxy.url, timeout=2) as card:
            target = OnnxTarget(tiny / "tiny.img", positions=128)
            decoder = SpeculativeDecoder(card, target, draft="tiny", k=3)
            result = decoder.generate([4, 5, 6], 40, stop_token_ids=[])
    assert proxy.dropped.is_set() and result.tokens == reference
    assert result.finish_reason == "length"


def test_arguments_out_of_range_are_typed_errors(tiny: Path) -> None:
    with open_card("emu://") as card:
        target = OnnxTarget(tiny / "tiny.img", positions=64)
        with pytest.raises(InvalidArgumentError, match="max_k"):
            SpeculativeDecoder(card, target, max_k=-3)
        # refused here: sent, the card would drop it and the call end in LinkTimeoutError
        with pytest.raises(InvalidArgumentError, match="one frame"):
            card.ping(bytes(card.info().max_payload + 1))
