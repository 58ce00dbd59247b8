"""The card's counters, reported by STATS (names in docs/protocol.md, "Telemetry")."""

from __future__ import annotations

import time

from exstill_sdk.protocol.constants import ErrorCode

WIRE_ERRORS = [c for c in ErrorCode if c < 0x100]


class Telemetry:
    __slots__ = (
        "accepted_tokens",
        "admin_refused",
        "ahead_step_streams",
        "ahead_step_us",
        "ahead_steps",
        "draft_tokens",
        "drafts",
        "errors",
        "frames",
        "frames_dropped",
        "images_set_aside",
        "outcome_pass_us",
        "outcome_pass_width",
        "outcome_passes",
        "prefetch_hits",
        "prefetch_hits_by_accepted",
        "prefetch_late",
        "prefetch_misses",
        "prefetch_outcome_hits",
        "prefetch_outcome_partial",
        "prefetch_outcomes_late",
        "prefetch_wasted_tokens",
        "rounds",
        "started",
        "streams_opened",
    )

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.frames = 0
        self.frames_dropped = 0
        self.rounds = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.prefetch_late = 0
        self.prefetch_hits_by_accepted = [0] * 256  # a COMMIT accepts a u8 count
        """Hits by the number of drafted tokens the host accepted."""
        self.prefetch_outcome_hits = 0
        """Hits on a draft made ahead for an outcome other than full acceptance with the
        card's guessed bonus token (firmware/outcomes.py)."""
        self.prefetch_outcome_partial = 0
        """Misses answered by finishing a draft begun ahead for that outcome (the outcome work
        stopped before it was done)."""
        self.prefetch_outcomes_late = 0
        """COMMITs that came before the drafts ahead for other outcomes were done."""
        self.prefetch_wasted_tokens = 0
        """Tokens drafted ahead for outcomes that did not happen."""
        self.ahead_steps = 0
        self.ahead_step_us = 0
        self.ahead_step_streams = 0
        """Steps of drafting ahead for full acceptance (each a batched step of every stream
        drafting ahead together), the microseconds they took and the streams they drafted:
        what drafting costs while the host verifies (on a CPU emulator, beside the target)."""
        self.outcome_passes = 0
        self.outcome_pass_us = 0
        self.outcome_pass_width = 0
        """Passes of a stream's outcome tree (drafting ahead for other outcomes, one stream
        at a time), the microseconds they took and the outcomes they drafted (each pass's
        width, summed): what the card's ``PassCost`` fits (firmware/outcomes.py)."""
        self.streams_opened = 0
        self.admin_refused = 0
        """Requests refused for want of the admin key (NOT_AUTHORIZED), AUTH failures included."""
        self.images_set_aside = 0
        """Stored images the card would not serve at boot (damaged, or not loadable)."""
        self.errors: dict[int, int] = dict.fromkeys(WIRE_ERRORS, 0)

    def snapshot(self, streams_open: int) -> dict[str, int]:
        out = {
            "uptime_ms": int((time.monotonic() - self.started) * 1000),
            "frames": self.frames,
            "frames_dropped": self.frames_dropped,
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "prefetch_late": self.prefetch_late,
            "prefetch_outcome_hits": self.prefetch_outcome_hits,
            "prefetch_outcome_partial": self.prefetch_outcome_partial,
            "prefetch_outcomes_late": self.prefetch_outcomes_late,
            "prefetch_wasted_tokens": self.prefetch_wasted_tokens,
            "ahead_steps": self.ahead_steps,
            "ahead_step_us": self.ahead_step_us,
            "ahead_step_streams": self.ahead_step_streams,
            "outcome_passes": self.outcome_passes,
            "outcome_pass_us": self.outcome_pass_us,
            "outcome_pass_width": self.outcome_pass_width,
            "streams_open": streams_open,
            "streams_opened": self.streams_opened,
            "images_set_aside": self.images_set_aside,
            "admin_refused": self.admin_refused,
        }
        out.update(
            {
                f"prefetch_hits.accepted_{j}": n
                for j, n in enumerate(self.prefetch_hits_by_accepted)
                if n
            }
        )
        out.update({f"errors.{ErrorCode(c).name.lower()}": n for c, n in self.errors.items()})
        return out
