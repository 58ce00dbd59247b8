"""exstill-flash: load a card image onto a card, resumably, verified, power-cut safe.

exstill-flash IMAGE --url URL [--target NAME] [--no-confirm] [--allow-downgrade] [--json]
exstill-flash --url URL --list | --rollback TARGET | --erase TARGET
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exstill_sdk.cli.support import EXIT_OK, Parser, UsageError, print_result, run
from exstill_sdk.errors import (
    DeviceNotFoundError,
    DevicePermissionError,
    DowngradeRefusedError,
    ImageError,
    NotAuthorizedError,
    StoreFullError,
)
from exstill_sdk.protocol.constants import ImageState

if TYPE_CHECKING:
    from exstill_sdk.card import Card


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="exstill-flash",
        description="Upload a card image (resuming after a dropped link), let the card verify "
        "it, run it on trial, health-check it and confirm it. Or list, roll back or erase "
        "the card's images.",
    )
    p.add_argument("image", nargs="?", help="card image to flash (made by exstill-pack)")
    p.add_argument(
        "--url", help="the card (usb://, serial://, tcp://; an emulator started with --store DIR)"
    )
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


def _hint(exc: BaseException) -> str:
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


def _list(card: Card) -> dict[str, Any]:
    return {
        "images": [
            {
                "target": e.target,
                "slot": "ab"[e.slot],
                "state": ImageState(e.state).name.lower(),
                "version": e.version,
                "size": e.size,
                "file_sha256": e.sha256.hex(),
            }
            for e in card.list_images()
        ]
    }


def _human(result: dict[str, Any]) -> str:
    if "images" in result:
        rows = [
            (
                e["target"],
                e["slot"],
                e["state"],
                "v" + e["version"],
                f"{e['size']:,} B",
                "file_sha256 " + e["file_sha256"][:16],
            )
            for e in result["images"]
        ]
        if not rows:
            return "no images on this card"
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )
    if "rolled_back" in result:
        return f"{result['rolled_back']}: back on its previous image, which serves now"
    if "erased" in result:
        return f"{result['erased']}: erased from the card"
    state = "confirmed" if result["confirmed"] else "on trial (not confirmed)"
    resumed = f", resumed from byte {result['resumed_from'][0]:,}" if result["resumed_from"] else ""
    return (
        f"flashed {result['target']} v{result['version']}: {result['size']:,} bytes at "
        f"{result['mb_per_s']} MB/s, {state}; re-sent {result['resent_bytes']} bytes{resumed}"
        f"\nfile_sha256 {result['file_sha256']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sent = [0, 0]  # bytes the card holds, image size

    def how_far() -> str:
        if not args.image or not sent[1]:
            return ""
        return (
            f"the card holds {sent[0]:,} of {sent[1]:,} bytes of {args.image}; the same "
            "command resumes from there"
        )

    return run(
        "exstill-flash",
        args.json,
        lambda: _main(args, sent),
        interrupted=how_far,
        hint=_hint,
    )


def _main(args: argparse.Namespace, sent: list[int]) -> int:
    from exstill_sdk.card import open_card
    from exstill_sdk.flash import flash

    if args.new_key:
        from exstill_sdk.auth import generate_admin_key

        path = generate_admin_key(args.new_key)
        done = {"admin_key": str(path), "mode": "0600"}
        print_result(done, args.json, lambda: f"wrote a new admin key to {path} (mode 0600)")
        return EXIT_OK
    actions = [bool(args.image), args.list, bool(args.rollback), bool(args.erase)]
    if sum(actions) != 1 or not args.url:
        raise UsageError("give --url and an IMAGE, or one of --list, --rollback, --erase")
    result: dict[str, Any]
    with open_card(args.url, timeout=30, key=args.key) as card:
        if args.list:
            result = _list(card)
        elif args.rollback:
            card.revert(args.rollback)
            result = {"rolled_back": args.rollback}
        elif args.erase:
            card.erase(args.erase)
            result = {"erased": args.erase}
        else:
            sent[1] = Path(args.image).stat().st_size
            bar = None
            if not args.json and sys.stderr.isatty():
                from tqdm import tqdm

                bar = tqdm(total=sent[1], unit="B", unit_scale=True, desc="flashing", leave=False)

            def progress(done: int) -> None:
                if bar is not None:
                    bar.update(done - sent[0])
                sent[0] = done

            try:
                result = flash(
                    card,
                    args.image,
                    target=args.target,
                    confirm=not args.no_confirm,
                    allow_downgrade=args.allow_downgrade,
                    progress=progress,
                ).to_dict()
            finally:
                if bar is not None:
                    bar.close()
    print_result(result, args.json, lambda: _human(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
