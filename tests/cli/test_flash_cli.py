"""exstill-flash against exstill-emu --store in another process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from exstill_sdk import open_card

from ..helpers import tiny_image
from .helpers import script, start_emu


def flash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script("exstill-flash"), *args], capture_output=True, text=True, timeout=120
    )


def test_flash_list_rollback_erase_and_restart(tmp_path: Path, admin_key: Path) -> None:
    key = ("--key", str(admin_key))
    images = []
    for version in ("1", "2"):
        images.append(
            tiny_image(tmp_path / f"v{version}.img", seed=int(version), image_version=version)
        )
    store = tmp_path / "store"
    proc, url = start_emu("--store", str(store), "--context", "256", "--admin-key", str(admin_key))
    try:
        out = flash(str(images[0]), "--url", url, "--json", *key)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["confirmed"] is True
        assert flash(str(images[1]), "--url", url, "--target", "tiny", *key).returncode == 0
        listed = json.loads(flash("--url", url, "--list", "--json").stdout)["images"]
        assert {(i["version"], i["state"]) for i in listed} == {
            ("1", "previous"),
            ("2", "confirmed"),
        }
        refused = flash(str(images[0]), "--url", url, *key)
        assert refused.returncode == 1 and "--allow-downgrade" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
        assert flash("--url", url, "--rollback", "tiny", *key).returncode == 0
        trial = flash(str(images[1]), "--url", url, "--no-confirm", *key)  # on trial only
        assert trial.returncode == 0 and "on trial" in trial.stdout
    finally:
        proc.terminate()
        proc.wait(10)
    # the store survives a restart: the confirmed image serves again
    proc, url = start_emu("--store", str(store), "--context", "256", "--admin-key", str(admin_key))
    try:
        with open_card(url) as card:
            assert [t.name for t in card.info().targets] == ["tiny"]
            assert {e.version for e in card.list_images() if e.state == 3} == {"1"}
        assert flash("--url", url, "--erase", "tiny", *key).returncode == 0
        missing = flash(str(tmp_path / "nope.img"), "--url", url, *key)
        assert missing.returncode == 2 and "nope.img" in missing.stderr  # a mistyped path
    finally:
        proc.terminate()
        proc.wait(10)


def test_power_cut_exit_code_and_store_full(tmp_path: Path, admin_key: Path) -> None:
    key = ("--key", str(admin_key))
    tiny_image(tmp_path / "t.img", seed=1)
    proc, url = start_emu(
        "--store", str(tmp_path / "store"), "--power-cut-after", "5000", "--admin-key", key[1]
    )
    out = flash(str(tmp_path / "t.img"), "--url", url, *key)
    assert out.returncode == 1
    assert proc.wait(10) == 75
    # the same image onto a card whose store is too small: refused, with what to do
    proc, url = start_emu(
        "--store", str(tmp_path / "small"), "--store-max-mb", "0.01", "--admin-key", key[1]
    )
    try:
        out = flash(str(tmp_path / "t.img"), "--url", url, "--json", *key)
        assert out.returncode == 1
        error = json.loads(out.stdout)
        assert error["code"] == 0x0F and "erase a target first" in error["error"]
        assert json.loads(flash("--url", url, "--list", "--json").stdout)["images"] == []
    finally:
        proc.terminate()
        proc.wait(10)
