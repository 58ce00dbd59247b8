"""Quickstart: a draft card (the built-in emulator) drafting for a verifier, round by round.

The "target" here is an oracle that knows the text it will write (a real target plugs in
through a verifier adapter: docs/integrating-a-target.md). Tokens are the text's UTF-8 bytes.
The card drafts with prompt lookup, so it does well wherever the text repeats itself; every
emitted token is still the target's own.

    python examples/quickstart.py [--url tcp://127.0.0.1:PORT] [--k 6]
"""

from __future__ import annotations

import argparse

from exstill_sdk import Verdict, open_card

PROMPT = "def add(a, b):\n    return a + b\n\n"
CONTINUATION = (
    "def sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n    return a / b\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="emu://", help="card URL (default: in-process emulator)")
    parser.add_argument("--k", type=int, default=6, help="tokens drafted per round")
    args = parser.parse_args()

    target_text = list(CONTINUATION.encode())
    with open_card(args.url) as card, card.open_stream("lookup") as stream:
        info = card.info()
        print(
            f"card: {info.firmware}, {info.slots} streams x {info.context} tokens, "
            f"engines {', '.join(info.engines)}"
        )
        stream.prefill(list(PROMPT.encode()))
        out: list[int] = []
        draft = stream.draft(args.k)
        rounds = drafted = accepted_total = prefetch_hits = 0
        while len(out) < len(target_text):
            # Verify: accept the draft's longest prefix that matches the target's own tokens.
            accepted = 0
            for token in draft.tokens:
                if (
                    len(out) + accepted < len(target_text)
                    and target_text[len(out) + accepted] == token
                ):
                    accepted += 1
                else:
                    break
            out += draft.tokens[:accepted]
            drafted += len(draft.tokens)
            accepted_total += accepted
            prefetch_hits += draft.prefetch_hit
            if len(out) == len(target_text):
                break
            bonus = target_text[len(out)]  # the target's token at the first miss (or after all)
            out.append(bonus)
            rounds += 1
            draft = stream.commit(Verdict(accepted, bonus), args.k)
        print(bytes(out).decode(), end="")
    assert out == target_text
    # This stream's own figures (card.stats() counts every client of a shared card).
    print(
        f"\n{len(out)} tokens in {rounds} rounds: "
        f"{len(out) / max(rounds, 1):.2f} tokens per target pass; "
        f"{accepted_total} drafted tokens accepted of {drafted}, "
        f"prefetch hits {prefetch_hits} of {rounds}"
    )


if __name__ == "__main__":
    main()
