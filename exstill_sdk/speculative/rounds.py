"""The round engine: what every way of decoding does between two verification passes.

A round, for one sequence or a batch of them (SpeculativeDecoder) or for a serving engine's rows
(RowStreams), is the same five steps, and this module holds the shared ones:

1. the target's pass scored every sequence's draft, timed by ``timing.PassClock``;
2. each sequence's ``Verdict`` (the caller's acceptance rule) is observed by the K planner;
3. the planner (``KPlanner``: ``BatchK``, or ``PolicyPlanner`` over a one-sequence policy)
   chooses every sequence's next K together;
4. ``exchange`` brings the card along: streams that lag catch up (prefill, then a draft), and
   the COMMITs of the rest go out in one write, so that the card drafts their misses as one
   batch; the drafts come back, typed (``Draft``);
5. the card's time is recorded on the clock, for the next pass's timing.

A lone sequence is a batch of one. Scheduling, recovery from a lost card and matching rows to
streams stay with the callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from exstill_sdk.errors import DeviceLostError, ExstillError
from exstill_sdk.interface import CardInterface
from exstill_sdk.protocol.drafts import Draft, Verdict
from exstill_sdk.protocol.messages import TreeRequest
from exstill_sdk.speculative.adaptive import KPolicy
from exstill_sdk.speculative.timing import PassTiming
from exstill_sdk.stream import DraftStream


class KPlanner(Protocol):
    """Chooses the next K of every sequence of a round from what rounds and passes cost."""

    def observe_round(self, seq: int, k: int, accepted: int, timed: bool = True) -> None:
        """Sequence ``seq`` drafted ``k`` tokens and ``accepted`` of them were accepted
        (``timed=False``: the chain inside a tree round, whose costs are not a chain's)."""

    def observe_pass(self, timing: PassTiming) -> None: ...

    def choose(self, seqs: list[int], limits: list[int]) -> list[int]:
        """K for each of ``seqs``, at most its limit."""
        ...

    def forget(self, seq: int) -> None:
        """The sequence finished."""


class PolicyPlanner:
    """A one-sequence ``KPolicy`` (fixed K, or ``AdaptiveK``) as a ``KPlanner``: every
    sequence gets the policy's K; an adaptive policy learns from a batch of one, observing each
    round's acceptance at once, before the next K is chosen, and what the round cost once the
    round after its pass has been timed (the card's wait for the next draft is part of what a K
    costs)."""

    def __init__(self, policy: KPolicy) -> None:
        self.policy = policy
        self._pass: tuple[float, bool] = (0.0, False)
        self._round: tuple[int, int, float, bool] | None = None

    def observe_round(self, seq: int, k: int, accepted: int, timed: bool = True) -> None:
        self.policy.observe_acceptance(k, accepted)  # before the next K is chosen
        self._round = (k, accepted, *self._pass) if timed else None

    def observe_pass(self, timing: PassTiming) -> None:
        last, self._round = self._round, None
        self._pass = (timing.pass_s, timing.steady)
        if last is None or timing.round_s is None:
            return
        k, accepted, verify_s, steady = last
        if steady:  # a pass that also took in a prompt is not what a K costs
            other = max(0.0, timing.round_s - timing.card_s)
            self.policy.observe(k, accepted, verify_s, other, timing.drafted or 0, timing.card_s)

    def choose(self, seqs: list[int], limits: list[int]) -> list[int]:
        return [self.policy.choose(limit) for limit in limits]

    def forget(self, seq: int) -> None:
        pass


class Commit(NamedTuple):
    """A stream in step with its sequence: one COMMIT (the verdict, the next K) brings the
    next draft."""

    stream: DraftStream
    verdict: Verdict
    next_k: int | TreeRequest
    """The next draft: a chain of up to this many tokens, or a tree of this shape."""


class CatchUp(NamedTuple):
    """A stream behind its sequence: the tokens it lacks (a prefill), then a draft."""

    stream: DraftStream
    tokens: Sequence[int]
    next_k: int | TreeRequest


def exchange(card: CardInterface, steps: Sequence[Commit | CatchUp]) -> list[Draft | ExstillError]:
    """The card's half of a round: every catch-up first, then every COMMIT in one write (one
    to each card of a pool), then their replies. Each step's result is its next draft or the
    error of that step: the card's refusal, or DeviceLostError where the step's card was lost
    (a lost card fails its other steps at once; the steps on other cards of a pool go on)."""
    out: dict[int, Draft | ExstillError] = {}
    commits: list[tuple[int, Commit]] = []
    for i, step in enumerate(steps):
        if isinstance(step, Commit):
            commits.append((i, step))
            continue
        try:
            if step.tokens:
                step.stream.prefill(list(step.tokens))
            nxt = step.next_k
            out[i] = step.stream.draft(nxt) if isinstance(nxt, int) else step.stream.draft_tree(nxt)
        except ExstillError as exc:
            out[i] = exc
    if len(commits) == 1:  # nothing to send together with
        i, (stream, verdict, k) = commits[0]
        try:
            out[i] = stream.commit(verdict, k)
        except ExstillError as exc:
            out[i] = exc
    elif commits:
        sent: list[tuple[int, Commit, int]] = []
        try:
            with card.sent_together():
                for i, step in commits:
                    try:
                        sent.append((i, step, step.stream.send_commit(step.verdict, step.next_k)))
                    except ExstillError as exc:
                        out[i] = exc
        except DeviceLostError:
            pass  # the lost card's steps learn it from their replies, at once
        for i, step, rid in sent:
            try:
                out[i] = step.stream.receive_commit(rid, step.verdict)
            except ExstillError as exc:
                out[i] = exc
    return [out[i] for i in range(len(steps))]
