"""exstill-info and list_devices."""

from __future__ import annotations

import json
import signal
import subprocess

from exstill_firmware import CardRuntime
from exstill_firmware.emulator.usb_backend import EmulatedUsbBackend

from exstill_sdk import list_devices, open_card, open_cards

from ..helpers import tiny_image
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


def test_info_on_a_pool_says_which_cards_a_target_skips(tmp_path) -> None:
    """exstill-emu --cards serves a pool; exstill-info on a pool's URL shows every card, the
    streams summed, and the cards without a target (its streams skip them)."""
    tiny_image(tmp_path / "t.img")
    pair, pair_url = start_emu("--cards", "2", "--streams", "3", "--context", "256")
    holder, holder_url = start_emu("--image", str(tmp_path / "t.img"), "--context", "256")
    try:
        url = f"{pair_url},{holder_url},tcp://127.0.0.1:9"
        first, second = pair_url.split(",")
        with open_cards(url) as pool:
            streams = [pool.open_stream("lookup") for _ in range(2)]
            out = subprocess.run(
                [script("exstill-info"), "--url", url, "--json"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            s = json.loads(out.stdout)
            assert [c["url"] for c in s["cards"]] == [
                first,
                second,
                holder_url,
                "tcp://127.0.0.1:9",
            ]
            assert "nothing listens" in s["cards"][3]["error"]
            assert s["pool"]["cards_up"] == 3
            assert s["pool"]["streams"] == {"in_use": 2, "slots": 3 + 3 + 12}
            assert s["pool"]["targets"]["tiny"] == {"on": [holder_url], "skipped": [first, second]}
            human = subprocess.run(
                [script("exstill-info"), "--url", url], capture_output=True, text=True, timeout=30
            ).stdout
            assert (
                f"target tiny: on 1 card(s); skipped on {first}, {second} (it lacks tiny)" in human
            )
            assert "2 of 18 streams in use" in human
            for st in streams:
                st.close()
    finally:
        for proc in (pair, holder):
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=10)
            assert proc.returncode == 130 and "stopped after" in err
