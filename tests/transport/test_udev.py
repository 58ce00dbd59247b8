"""udev/70-exstill.rules matches the SDK's USB identity and is valid where udevadm can say."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from exstill_sdk.protocol.usb_ids import PRODUCT_ID, VENDOR_ID

RULES = Path(__file__).resolve().parents[2] / "udev" / "70-exstill.rules"


def rules() -> list[str]:
    return [ln for ln in RULES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_rules_use_the_sdk_ids_and_grant_access() -> None:
    lines = rules()
    assert len(lines) == 2
    for line in lines:
        assert re.search(r'ATTRS\{idVendor\}=="([0-9a-f]{4})"', line).group(1) == f"{VENDOR_ID:04x}"
        assert (
            re.search(r'ATTRS\{idProduct\}=="([0-9a-f]{4})"', line).group(1) == f"{PRODUCT_ID:04x}"
        )
        assert 'TAG+="uaccess"' in line and 'GROUP="plugdev"' in line and 'MODE="0660"' in line
    assert {re.search(r'SUBSYSTEM=="(\w+)"', ln).group(1) for ln in lines} == {"usb", "tty"}
    assert int(RULES.name.split("-")[0]) < 73  # before 73-seat-late.rules applies uaccess


def test_udevadm_verify() -> None:
    udevadm = shutil.which("udevadm")
    if udevadm is None:
        pytest.skip("udevadm is not installed here")
    probe = subprocess.run([udevadm, "verify", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("this udevadm has no 'verify' command (systemd < 254)")
    out = subprocess.run(
        [udevadm, "verify", "--no-style", str(RULES)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
