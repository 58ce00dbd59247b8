#!/usr/bin/env python3
"""Card image benchmarks: open cost of a 1 GiB image, and packing speed against a plain copy.

    python tools/bench_image.py [--gib 1.0] [--dir DIR] [--json]

1. Builds a synthetic HF Llama-family checkpoint of about --gib GiB (float32 safetensors, a
   config.json and a WordLevel tokenizer.json); nothing is downloaded.
2. Packs it with exstill-pack's code (f32, then f16 and int8) and copies its safetensors file
   (shutil.copyfile, an in-kernel copy, and a read/write loop through this process), each
   followed by fsync, alternating, best of three; before each timed step the previous outputs
   are deleted and the page cache flushed (os.sync), so no step pays for another's writeback.
   `pack_to_copy_ratio` is pack time over copyfile time for the same bytes.
3. Opens the f32 image in a fresh process and reports the wall time and the resident memory
   that `open_image` added (from /proc/self/statm), then the time to verify its digest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPEN_PROBE = r"""
import os, sys, time
from exstill_sdk.image import open_image
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
before = rss()
t0 = time.perf_counter()
image = open_image(sys.argv[1])
seconds = time.perf_counter() - t0
view = image.tensor("embed.weight")
after = rss()
print(seconds, after - before, view.shape[0], image.size)
"""


def make_checkpoint(directory: Path, gib: float) -> int:
    """A float32 Llama-family checkpoint of about ``gib`` GiB; its safetensors size."""
    from exstill_sdk.harness.synthetic import write_checkpoint

    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    fixed = (2 * vocab * hidden + hidden) * 4
    layers = max(1, round((gib * (1 << 30) - fixed) / per_layer))
    write_checkpoint(
        directory,
        layers=layers,
        hidden=hidden,
        intermediate=inter,
        heads=16,
        kv_heads=16,
        vocab=vocab,
    )
    return (directory / "model.safetensors").stat().st_size


def copy_with_fsync(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def copy_through_process(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(8 << 20):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())


def timed(step, *outputs: Path) -> float:
    """Run a step on a clean slate: earlier outputs deleted and written back first."""
    for path in outputs:
        path.unlink(missing_ok=True)
    os.sync()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size (default 1 GiB)")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from exstill_sdk.image import open_image
    from exstill_sdk.image.pack import pack_checkpoint

    work = Path(args.dir or tempfile.mkdtemp(prefix="exstill-bench-image-"))
    try:
        ckpt = work / "ckpt"
        checkpoint_bytes = make_checkpoint(ckpt, args.gib)
        image = work / "model.img"
        source, copy = ckpt / "model.safetensors", work / "copy.bin"
        pack_s, copy_s, loop_s = [], [], []
        for _ in range(3):
            pack_s.append(timed(lambda: pack_checkpoint(ckpt, image, "bench", "f32"), image))
            copy_s.append(timed(lambda: copy_with_fsync(source, copy), copy))
            loop_s.append(timed(lambda: copy_through_process(source, copy), copy))
        copy.unlink()
        probe = subprocess.run(
            [sys.executable, "-c", OPEN_PROBE, str(image)], capture_output=True, text=True
        )
        if probe.returncode:
            raise SystemExit(probe.stderr)
        open_s, open_rss, _, image_bytes = probe.stdout.split()
        with open_image(image) as img:
            t0 = time.perf_counter()
            img.verify()
            verify_s = time.perf_counter() - t0
        timings = {}
        for dtype in ("f16", "int8"):
            out = work / f"model-{dtype}.img"
            timings[dtype] = timed(
                lambda out=out, dtype=dtype: pack_checkpoint(ckpt, out, "bench", dtype), out
            )
        result = {
            "checkpoint_bytes": checkpoint_bytes,
            "image_bytes": int(image_bytes),
            "open_ms": round(float(open_s) * 1000, 2),
            "open_rss_mib": round(int(open_rss) / (1 << 20), 2),
            "verify_s": round(verify_s, 3),
            "pack_f32_s": round(min(pack_s), 3),
            "copy_s": round(min(copy_s), 3),
            "copy_through_process_s": round(min(loop_s), 3),
            "pack_to_copy_ratio": round(min(pack_s) / min(copy_s), 2),
            "pack_to_process_copy_ratio": round(min(pack_s) / min(loop_s), 2),
            "pack_f16_s": round(timings["f16"], 3),
            "pack_int8_s": round(timings["int8"], 3),
        }
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<20} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
