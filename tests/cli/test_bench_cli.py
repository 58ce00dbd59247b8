"""exstill-bench roundtrip prints the figures it promises (values are not timed here)."""

from __future__ import annotations

import json
import subprocess

from .helpers import script, start_emu


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [script("exstill-bench"), "roundtrip", "--rounds", "300", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_emu_roundtrip_json() -> None:
    result = _bench("--url", "emu://", "--k", "6")
    assert {"url", "k", "rounds", "p50_us", "p99_us", "bytes_per_round"} <= result.keys()
    assert result["k"] == 6 and result["rounds"] == 300
    assert result["p50_us"] > 0
    # 20-byte COMMIT frame + 40-byte reply carrying six tokens; whole frames in process.
    assert result["bytes_per_round"] == 64


def test_tcp_roundtrip_json_has_raw_socket_baseline() -> None:
    proc, url = start_emu()
    try:
        result = _bench("--url", url, "--placement", "none")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert result["bytes_per_round"] == 68  # COBS adds 2 bytes per frame
    assert result["raw_socket_p50_us"] > 0 and result["ratio_to_raw_p50"] > 0
    assert result["placement"] == "none"


def test_bad_arguments_exit_2() -> None:
    out = subprocess.run(
        [script("exstill-bench"), "roundtrip", "--url", "bogus://", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "scheme" in out.stderr


def test_engine_bench_json() -> None:
    out = subprocess.run(
        [
            script("exstill-bench"),
            "engine",
            "--synthetic",
            "1x64",
            "--rounds",
            "6",
            "--k",
            "4",
            "--no-hf",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layers"] == 1 and result["hidden"] == 64 and result["k"] == 4
    assert result["us_per_token_1_stream"] > 0 and result["us_per_token_12_streams"] > 0
