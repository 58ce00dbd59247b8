"""exstill-flash: load a card image onto a card, resumably, verified, power-cut safe.

exstill-flash IMAGE --url URL [--target NAME] [--no-confirm] [--allow-downgrade] [--json]
exstill-flash --url URL --list | --rollback TARGET | --erase TARGET
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exstill_sdk.errors import (
    DeviceNotFoundError,
    DevicePermissionError,
    DowngradeRefusedError,
    ExstillError,
    ImageError,
    NotAuthorizedError,
    StoreFullError,
)
from exstill_sdk.protocol.constants import ImageState


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="exstill-flash",
        description="Upload a card image (resuming after a dropped link), let the card verify "
        "it, run it on trial, health-check it and confirm it. Or list, roll back or erase "
        "the card's images.",
    )
    p.add_argument("image", nargs="?", help="card image to flash (made by exstill-pack)")
    p.add_argument("--url", help="the card (usb://, serial://, tcp://, emu://)")
    p.add_argument(
        "--key",
        metavar="FILE",
        help="the card's admin key: a network link (tcp://) needs it to change the card's images",
    )
    p.add_argument(
        "--new-key",
        metavar="FILE",
        help="make a new admin key in FILE (mode 0600; never printed) for exstill-emu "
        "--admin-key and exstill-flash --key, then exit",
    )
    p.add_argument("--target", help="target name on the card (default: the image's)")
    p.add_argument(
        "--no-confirm",
        action="store_true",
        help="leave the image on trial: the card reverts it at its next reset",
    )
    p.add_argument("--allow-downgrade", action="store_true", help="install an older version")
    p.add_argument("--list", action="store_true", help="list the card's images")
    p.add_argument("--rollback", metavar="TARGET", help="go back to TARGET's previous image")
    p.add_argument("--erase", metavar="TARGET", help="remove TARGET from the card")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _hint(exc: ExstillError) -> str:
    if isinstance(exc, DeviceNotFoundError):
        return " (is the card connected and the URL right? exstill-info --list)"
    if isinstance(exc, DevicePermissionError):
        return ""  # the message names the udev rule already
    if isinstance(exc, DowngradeRefusedError | StoreFullError):
        return ""
    if isinstance(exc, ImageError):
        return " (the card keeps its current image)"
    if isinstance(exc, NotAuthorizedError):
        return " (it changed nothing)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from exstill_sdk.card import open_card
    from exstill_sdk.flash import flash

    if args.new_key:
        from exstill_sdk.auth import generate_admin_key

        try:
            path = generate_admin_key(args.new_key)
        except ExstillError as exc:
            print(f"exstill-flash: {exc.message}", file=sys.stderr)
            return 2
        done = {"admin_key": str(path), "mode": "0600"}
        print(json.dumps(done) if args.json else f"wrote a new admin key to {path} (mode 0600)")
        return 0
    actions = [bool(args.image), args.list, bool(args.rollback), bool(args.erase)]
    if sum(actions) != 1 or not args.url:
        print(
            "exstill-flash: give --url and an IMAGE, or one of --list, --rollback, --erase",
            file=sys.stderr,
        )
        return 2
    result: dict[str, Any]
    try:
        with open_card(args.url, timeout=30, key=args.key) as card:
            if args.list:
                result = {
                    "images": [
                        {
                            "target": e.target,
                            "slot": "ab"[e.slot],
                            "state": ImageState(e.state).name.lower(),
                            "version": e.version,
                            "size": e.size,
                            "sha256": e.sha256.hex(),
                        }
                        for e in card.list_images()
                    ]
                }
            elif args.rollback:
                card.revert(args.rollback)
                result = {"rolled_back": args.rollback}
            elif args.erase:
                card.erase(args.erase)
                result = {"erased": args.erase}
            else:
                bar = None
                if not args.json and sys.stderr.isatty():
                    from pathlib import Path

                    from tqdm import tqdm

                    bar = tqdm(
                        total=Path(args.image).stat().st_size,
                        unit="B",
                        unit_scale=True,
                        desc="flashing",
                        leave=False,
                    )
                last = [0]

                def progress(done: int) -> None:
                    if bar is not None:
                        bar.update(done - last[0])
                        last[0] = done

                try:
                    r = flash(
                        card,
                        args.image,
                        target=args.target,
                        confirm=not args.no_confirm,
                        allow_downgrade=args.allow_downgrade,
                        progress=progress,
                    )
                finally:
                    if bar is not None:
                        bar.close()
                result = r.to_dict()
    except (ExstillError, OSError) as exc:
        message = exc.message if isinstance(exc, ExstillError) else str(exc)
        if args.json:
            print(json.dumps({"ok": False, "error": message, "code": int(getattr(exc, "code", 0))}))
        else:
            extra = _hint(exc) if isinstance(exc, ExstillError) else ""
            print(f"exstill-flash: {message}{extra}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    elif "images" in result:
        for e in result["images"] or [{"target": "(no images)"}]:
            print("  ".join(str(v) for v in e.values()))
    elif "target" in result:
        state = "confirmed" if result["confirmed"] else "on trial (not confirmed)"
        print(
            f"flashed {result['target']} v{result['version']}: {result['size']:,} bytes at "
            f"{result['mb_per_s']} MB/s, {state}; re-sent {result['resent_bytes']} bytes"
        )
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
