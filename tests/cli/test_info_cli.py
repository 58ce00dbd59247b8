"""exstill-info and list_devices."""

from __future__ import annotations

import json
import subprocess

from exstill_firmware import CardRuntime
from exstill_firmware.emulator.usb_backend import EmulatedUsbBackend

from exstill_sdk import list_devices, open_card

from .helpers import script, start_emu


def test_list_devices_finds_usb_cards_and_named_urls() -> None:
    backend = EmulatedUsbBackend()
    backend.add_card(lambda: CardRuntime(2, 256), serial="CARD-A")
    backend.add_card(lambda: CardRuntime(2, 256), serial="CARD-B")
    found = list_devices(["emu://?streams=3", "tcp://127.0.0.1:1"], usb_backend=backend)
    usb = [d for d in found if d.kind == "usb"]
    assert [d.serial_number for d in usb] == ["CARD-A", "CARD-B"]
    assert usb[0].url == "usb://1209:e511?serial=CARD-A"
    named = {d.url: d for d in found if d.kind != "usb"}
    assert "3 streams" in named["emu://?streams=3"].description
    assert "not answering" in named["tcp://127.0.0.1:1"].description
    from exstill_sdk.transport.usb import register_usb_backend, unregister_usb_backend

    register_usb_backend("listed", backend)
    try:
        with open_card(usb[1].url + "&backend=listed") as card:  # the listed URL opens that card
            assert card.info().slots == 2
    finally:
        unregister_usb_backend("listed")


def test_info_shows_a_card_and_watches() -> None:
    proc, url = start_emu("--streams", "4")
    try:
        with open_card(url) as card:
            s = card.open_stream()
            s.prefill([1, 2, 3, 1, 2])
            s.draft(2)
            out = subprocess.run(
                [script("exstill-info"), "--url", url, "--json"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info = json.loads(out.stdout)
            assert info["streams"] == {"in_use": 1, "slots": 4}
            assert info["telemetry"]["draft_tokens"] == 2 and info["engines"] == ["lookup"]
        out = subprocess.run(
            [script("exstill-info"), "--url", url, "--watch", "0.1", "--iterations", "3", "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert len(out.stdout.strip().splitlines()) == 3
        human = subprocess.run(
            [script("exstill-info"), "--url", url], capture_output=True, text=True, timeout=30
        ).stdout
        assert "exstill-emu" in human and "streams" in human
        listed = subprocess.run(
            [script("exstill-info"), "--list", "--url", url, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert any(d["url"] == url for d in json.loads(listed.stdout))
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([script("exstill-info"), "--url", url], capture_output=True, text=True)
    assert bad.returncode == 1 and "exstill-emu --listen" in bad.stderr


def test_emu_serves_a_pty() -> None:
    proc = subprocess.Popen(
        [script("exstill-emu"), "--serial", "pty"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("serial:///dev/")
        with open_card(url) as card:
            s = card.open_stream()
            s.prefill([7, 8, 9, 7, 8])
            assert s.draft(2).tokens == (9, 7)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0
