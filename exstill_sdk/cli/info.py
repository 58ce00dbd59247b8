"""exstill-info: list cards, and show a card's versions, streams, targets and telemetry."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from exstill_sdk.cli.support import EXIT_OK, Parser, UsageError, run
from exstill_sdk.support.prefetch import describe, prefetch_report


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="exstill-info",
        description="List Exstill cards (USB, serial, and emulator URLs you name) or show one "
        "card's firmware, streams, targets and telemetry.",
    )
    p.add_argument("--list", action="store_true", help="list cards")
    p.add_argument(
        "--url",
        action="append",
        default=[],
        help="a card URL, or a pool's URL,URL,... (repeatable with --list)",
    )
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    p.add_argument(
        "--key", metavar="FILE", help="the card's admin key (a card reached from another host)"
    )
    p.add_argument("--iterations", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="JSON output (one object per refresh)")
    return p


def snapshot(url: str, key: str | None = None) -> dict[str, Any]:
    from exstill_sdk.card import open_card
    from exstill_sdk.protocol.constants import Features

    with open_card(url, timeout=3, key=key) as card:
        info, stats = card.info(), card.stats()
    return {
        "url": url,
        "firmware": info.firmware,
        "protocol_version": info.protocol_version,
        "streams": {"in_use": stats.get("streams_open", 0), "slots": info.slots},
        "context": info.context,
        "max_k": info.max_k,
        "features": [str(f.name).lower() for f in Features if f and f in info.features],
        "engines": list(info.engines),
        "targets": [
            {
                "name": t.name,
                "vocab_size": t.vocab_size,
                "tokenizer_sha256": t.tokenizer_sha256.hex(),
            }
            for t in info.targets
        ],
        "telemetry": stats,
        "prefetch": prefetch_report(stats),
    }


def pool_snapshot(urls: list[str], key: str | None = None) -> dict[str, Any]:
    """Each card of a pool, and what the pool makes of them: streams summed over the cards
    that answer, and for each target the cards that lack it (its streams skip them)."""
    from exstill_sdk.errors import ExstillError

    cards: list[dict[str, Any]] = []
    for url in urls:
        try:
            cards.append(snapshot(url, key))
        except ExstillError as exc:
            cards.append({"url": url, "error": exc.message})
    up = [c for c in cards if "error" not in c]
    names = sorted({t["name"] for c in up for t in c["targets"]})
    return {
        "url": ",".join(urls),
        "cards": cards,
        "pool": {
            "cards_up": len(up),
            "cards": len(cards),
            "streams": {
                "in_use": sum(c["streams"]["in_use"] for c in up),
                "slots": sum(c["streams"]["slots"] for c in up),
            },
            "targets": {
                name: {
                    "on": [c["url"] for c in up if any(t["name"] == name for t in c["targets"])],
                    "skipped": [
                        c["url"] for c in up if all(t["name"] != name for t in c["targets"])
                    ],
                }
                for name in names
            },
        },
    }


def _human_pool(s: dict[str, Any]) -> str:
    pool = s["pool"]
    lines = [
        f"pool of {pool['cards']} cards, {pool['cards_up']} answering: "
        f"{pool['streams']['in_use']} of {pool['streams']['slots']} streams in use"
    ]
    for name, where in pool["targets"].items():
        skipped = where["skipped"]
        lines.append(
            f"  target {name}: on {len(where['on'])} card(s)"
            + (f"; skipped on {', '.join(skipped)} (it lacks {name})" if skipped else "")
        )
    for card in s["cards"]:
        if "error" in card:
            lines.append(f"{card['url']}: not answering: {card['error']}")
        else:
            lines.append(_human(card))
    return "\n".join(lines)


def _human(s: dict[str, Any]) -> str:
    lines = [
        f"{s['url']}: {s['firmware']}, protocol v{s['protocol_version']}",
        f"  streams   {s['streams']['in_use']} of {s['streams']['slots']} in use, "
        f"{s['context']} tokens each, max K {s['max_k']}",
        f"  engines   {', '.join(s['engines']) or 'none'}",
        f"  features  {', '.join(s['features']) or 'none'}",
        "  targets   "
        + (
            ", ".join(
                f"{t['name']} (vocab {t['vocab_size']}, tokenizer {t['tokenizer_sha256'][:12]})"
                for t in s["targets"]
            )
            or "none"
        ),
    ]
    t = s["telemetry"]
    rounds = t.get("rounds", 0)
    lines.append(
        f"  rounds    {rounds}, drafted {t.get('draft_tokens', 0)}, accepted "
        f"{t.get('accepted_tokens', 0)}"
    )
    lines.append(f"  prefetch  {describe(prefetch_report(t))}")
    errors = {k: v for k, v in t.items() if k.startswith("errors.") and v}
    lines.append("  errors    " + (", ".join(f"{k[7:]} {v}" for k, v in errors.items()) or "none"))
    lines.append(f"  frames    {t.get('frames', 0)} served, {t.get('frames_dropped', 0)} dropped")
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    if args.list:
        from exstill_sdk.discovery import list_devices

        devices = list_devices(args.url)
        if args.json:
            print(json.dumps([d.to_dict() for d in devices]))
        elif not devices:
            print("no cards found (USB, serial); name emulators with --url")
        else:
            for d in devices:
                print(f"{d.url:<40} {d.kind:<7} {d.description}")
        return EXIT_OK
    if len(args.url) != 1:
        raise UsageError("give --list, or one --url (a pool of cards: URL,URL,...)")
    from exstill_sdk.pool import split_card_urls

    urls = split_card_urls(args.url[0])
    count = 0
    while True:
        s = snapshot(urls[0], args.key) if len(urls) == 1 else pool_snapshot(urls, args.key)
        if args.json:
            print(json.dumps(s), flush=True)
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(_human(s) if len(urls) == 1 else _human_pool(s), flush=True)
        count += 1
        if not args.watch or (args.iterations and count >= args.iterations):
            return EXIT_OK
        time.sleep(args.watch)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("exstill-info", args.json, lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
