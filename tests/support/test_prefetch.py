"""The card's prefetch counters, counted run by run and summed (as ``exstill-bench vllm`` reports
them), against the same counters read once over all the runs, on a real card served over TCP
(the server drafts ahead after each reply, before it reads the next request)."""

from __future__ import annotations

from collections import Counter

from exstill_sdk.card import open_card
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.support.prefetch import PREFIX, prefetch_counts, prefetch_report

TEXT = [5, 6, 7, 8, 9, 10, 11, 12] * 12


def _rounds(card, start: int, rounds: int, short: int, k: int = 4) -> None:
    """Greedy rounds of prompt lookup over ``TEXT`` from position ``start``: the drafted tokens
    that continue the text are kept, less ``short`` of them (a verdict the card did not draft
    ahead for), and the text's next token is the bonus."""
    stream = card.open_stream("lookup")
    try:
        stream.prefill(TEXT[:start])
        at, draft = start, stream.draft(k)
        for _ in range(rounds):
            kept = 0
            while kept < len(draft.tokens) and draft.tokens[kept] == TEXT[at + kept]:
                kept += 1
            kept = max(0, kept - short)
            at += kept + 1
            draft = stream.commit(Verdict(kept, TEXT[at - 1]), k)
    finally:
        stream.close()


def test_runs_counted_apart_sum_to_the_whole(tcp_server) -> None:
    with open_card(tcp_server.url) as card:
        first = card.stats()
        runs = []
        for start, short in ((16, 0), (24, 1)):
            before = card.stats()
            _rounds(card, start, rounds=6, short=short)
            runs.append(prefetch_counts(card.stats(), before))
        whole = prefetch_report(card.stats(), first)
    assert all(key.startswith(PREFIX) for run in runs for key in run)
    summed = prefetch_report(sum((Counter(run) for run in runs), Counter()))
    assert summed == whole, (summed, whole)
    assert whole["rounds"] == 12  # every COMMIT after a draft the card drafted ahead for
    assert whole["hits"] == 6  # lookup's drafts of a repeat taken whole were made ahead
    assert whole["misses"] == 6
