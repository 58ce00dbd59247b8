from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def script(name: str) -> str:
    """The installed console script next to this interpreter."""
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is not installed; pip install -e . first"
    return str(path)


def start_emu(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [script("exstill-emu"), "--listen", "tcp://127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url.startswith("tcp://127.0.0.1:"), proc.stderr.read() if proc.stderr else url
    return proc, url
