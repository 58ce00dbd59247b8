"""Measured planner profiles of this machine: the demo targets' verification passes, the
emulated card's drafting and link, and the host's loop (``exstill-bench profile``).

- target: a pass of U sequences with K drafted tokens each, for every U and K asked, the median
  of a few runs taken in turns, keyed by the tokens in it (``[target.pass]``), at the context
  a run has half-way;
- card: the link's round trip (PING); rounds where the draft made ahead hit (the card's own
  guess of the outcome committed) and rounds where it missed (nothing kept, a bonus drawn at
  random, which the card's other outcomes do not hold; a fixed cost, then K + 1 steps of the
  draft), each on one stream and on every stream at once (one batched run of the draft for all
  of them), for K = 1..8, each checked against the card's counters; from those what a round
  costs when it hits, the cost of a step, the fixed cost of drafting anew, and what each
  further stream adds to each; and tree rounds of one stream at depths 2 to 8, for what each
  level of a tree costs (``tree_level_us``) and what a tree costs beyond a chain's first step
  (``tree_us``; the runtime drafts a tree when its COMMIT comes, never ahead:
  ``prefetch_trees = false``);
- host: the host's time a pass (a run's wall time less verification and waiting for the card),
  from speculative runs at each user count, as a line in the users (``[host]``);
- runs: per user count, a K = 8 run's metrics (the acceptance by position) and the card's
  draft's ``top_k`` along that run's text (draft_ranks.py: how often the draft's second,
  third, ... choice names the target's token, for trees and drafting ahead for other outcomes);
- the card's drafting ahead for other outcomes than full acceptance, timed by the card in
  those runs (its stats ``outcome_passes``, ``outcome_pass_us``, ``outcome_pass_width``): a
  pass of a stream's outcome tree as a line in its outcomes (``outcome_line``);
- the card's ``target_slowdown``: a pass in those runs, beside the card drafting ahead,
  against the table's pass of as many tokens timed with the card idle (the median over the
  user counts; the emulator shares the CPU's caches and memory with the target).

The card's drafting ahead runs while the host waits for the next COMMIT; a measured miss
therefore follows a pause as long as a pass would be, so that the next miss does not wait for it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.bench.decode.users import pass_costs
from exstill_sdk.demo import DRAFT_TARGET, THREADS
from exstill_sdk.demo.pair import draft_model
from exstill_sdk.errors import ExstillError
from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target, user_prompts
from exstill_sdk.harness.passes import tree_pass_seconds
from exstill_sdk.plan.measure.draft_ranks import draft_top_k
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.protocol.messages import TreeRequest
from exstill_sdk.speculative.estimators import Line, fit_line
from exstill_sdk.speculative.trees import ROOT, TokenTree

PAUSE_S = 0.02
"""Between measured card rounds: the card finishes drafting ahead meanwhile."""
CARD_ROUNDS = 15
PASS_TURNS = 5
"""Turns through the K when timing passes: a burst of noise on a shared machine spoils one,
and the first turn, after a pass of another size (the prompt's), runs slow: the small target's
pass of one token at one user came out at 0.69 to 0.89 ms from one turn, 0.52 to 0.58 ms from
five, where a plain run's step took 0.52 ms."""
PILOT_K = 8
"""K of the runs that measure acceptance (every position drafted) and the host's time."""
SHORT_TOKENS = 32
TREE_PROBE = TreeRequest(8, 2, 8)
"""The trees ``tree_line`` times, at every depth from 2 to this one."""
MIN_STEP_US = 1.0
"""The least a drafted token is taken to cost the card, in microseconds (``card_profile``)."""


def demo_hf_target(image: Any) -> Any:
    """A demo target's image as a transformers model behind ``HFTarget``, on one thread as the
    ONNX one."""
    import torch

    from exstill_sdk.adapters.hf import HFTarget
    from exstill_sdk.image.hf import to_hf_model

    torch.set_num_threads(THREADS)
    return HFTarget(to_hf_model(image, "sdpa"))


def run(
    name: str,
    users: Sequence[int],
    *,
    adapter: str = "onnx",
    out: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """``exstill-bench profile``: every profile of the demo pair with the ``name`` target, run
    by ``adapter`` (``onnx``: OnnxTarget, one pass for every sequence; ``hf``: HFTarget on
    transformers, a forward call per sequence); with ``out``, also as the files ``exstill
    plan`` reads."""
    from exstill_sdk.demo import demo_target

    with demo_card(max(users)) as (card, prompts):
        demo = demo_target(name, progress=sys.stderr.isatty())
        hf = adapter == "hf"
        target = demo_hf_target(demo.image) if hf else demo_onnx_target(demo.image, users, prompts)
        label = f"demo-{name}-{adapter}"
        result = measure(card, target, draft_model(), label, prompts, users, progress=progress)
    if out is not None:
        result["files"] = [str(p) for p in write_profiles(Path(out), result)]
    return result


def write_profiles(folder: Path, measured: dict[str, Any]) -> list[Path]:
    """``target.json``, ``card.json`` and ``run-U-users.json`` (a run's metrics and the
    draft's ``top_k`` along its text, which ``exstill plan --acceptance`` reads) into
    ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = {"target": measured["target"], "card": measured["card"]}
    docs.update({f"run-{u}-users": doc for u, doc in measured["runs"].items()})
    paths = []
    for stem, doc in docs.items():
        paths.append(folder / f"{stem}.json")
        paths[-1].write_text(json.dumps(doc, indent=1))
    return paths


def measure(
    card: Any,
    target: Any,
    draft: Any,
    name: str,
    prompts: list[list[int]],
    users: Sequence[int],
    new_tokens: int = 128,
    progress: bool = False,
) -> dict[str, Any]:
    """Every profile of the pair: ``target`` and ``card`` (with ``host``) as the planner reads
    them, and ``runs``: per user count, the pilot run's metrics (its acceptance) and the
    ``top_k`` of ``draft`` (the card's draft, ``demo.pair.draft_model``) along its text. Passes and
    drafts are timed at the context a run of ``new_tokens`` has half-way (attention grows with
    it: on the small target it is a good part of a pass)."""
    if progress:
        print(f"profiling the {name} target and the card ...", file=sys.stderr, flush=True)
    half_way = user_prompts(max(users), len(prompts[0]) + new_tokens // 2)
    target_doc = target_profile(target, name, half_way, users, range(PILOT_K + 1))
    target_doc["target"]["context"] = len(half_way[0])
    card_doc = card_profile(card, half_way[0])
    pilots = {u: pilot(card, target, prompts[:u], new_tokens) for u in users}
    top_k = {u: draft_top_k(draft, prompts[:u], p["texts"], PILOT_K) for u, p in pilots.items()}
    card_doc["host"] = host_line([(u, p["host_us"]) for u, p in pilots.items()])
    steps = [p["ahead_step"] for p in pilots.values() if p["ahead_step"]]
    card_doc["card"].update(ahead_line(card_doc["card"], steps))
    passes = [p["outcome_pass"] for p in pilots.values() if p["outcome_pass"]]
    card_doc["card"].update(outcome_line(card_doc["card"], passes))
    slowdown = {
        u: p["pass_ms"] / table_ms(target_doc, u, p["pass_tokens"])
        for u, p in pilots.items()
        if p["pass_ms"]
    }
    if slowdown:
        card_doc["card"]["target_slowdown"] = round(
            max(1.0, statistics.median(slowdown.values())), 3
        )
    return {
        "target": target_doc,
        "card": card_doc,
        "runs": {str(u): {"metrics": p["metrics"], "top_k": top_k[u]} for u, p in pilots.items()},
        "target_slowdown_by_users": {str(u): round(v, 3) for u, v in slowdown.items()},
    }


def table_ms(target_doc: dict[str, Any], users: int, tokens: float) -> float:
    """The pass table's milliseconds for ``users`` sequences and ``tokens`` tokens (a line
    between the sizes timed)."""
    rows = target_doc["target"]["pass"]
    points = sorted(
        (t, ms)
        for b, t, ms in zip(rows["batch"], rows["tokens"], rows["ms"], strict=True)
        if b == users
    )
    return float(np.interp(tokens, [t for t, _ in points], [ms for _, ms in points]))


def pilot(card: Any, target: Any, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """A K = 8 run's metrics (its acceptance, as a run's JSON has them), its text (every
    sequence's tokens, the target's own greedy text) and the host's own time
    a pass: a long run's less a short one's, over their difference in passes, so that the
    prompt and the opening of the streams cancel out."""
    from exstill_sdk.speculative import SpeculativeDecoder

    costs = []
    metrics: dict[str, Any] = {}
    warm = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=PILOT_K, max_k=PILOT_K)
    warm.generate_batch(batch, SHORT_TOKENS, stop_token_ids=[])  # untimed: the short run
    for n in (SHORT_TOKENS, new_tokens):  # would otherwise pay the first passes' costs
        decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=PILOT_K, max_k=PILOT_K)
        before = card.stats()
        results = decoder.generate_batch(batch, n, stop_token_ids=[])
        ahead = ahead_step(card, before)
        outcomes = outcome_pass(card, before)
        passes = max(r.metrics.rounds for r in results)
        m = decoder.metrics
        costs.append((passes, m.host_s, m.verify_s, m.num_draft_tokens + m.rounds))
        metrics = m.to_dict()
    (p0, h0, v0, t0), (p1, h1, v1, t1) = costs
    passes = max(1, p1 - p0)
    return {
        "metrics": metrics,
        "texts": [r.tokens for r in results],
        "host_us": max(0.0, (h1 - h0) / passes) * 1e6,
        # the card's own timing of its drafting ahead in the long run: (streams, us) a step
        "ahead_step": ahead,
        # and of its drafting ahead for other outcomes: (outcomes, us) a pass of its trees
        "outcome_pass": outcomes,
        # a steady pass of the long run, beside the card drafting ahead: its ms and tokens
        "pass_ms": max(0.0, (v1 - v0) / passes) * 1e3 if p1 > p0 else 0.0,
        "pass_tokens": (t1 - t0) / passes,
    }


AHEAD_STATS: tuple[str, str, str] = ("ahead_steps", "ahead_step_us", "ahead_step_streams")
"""The card's counters of its drafting ahead (firmware/telemetry.py)."""


def ahead_step(card: Any, before: dict[str, Any]) -> tuple[float, float] | None:
    """(streams, microseconds) of the card's average step of drafting ahead since its stats
    were ``before``, as the card timed them; None where it drafted nothing ahead."""
    return _averaged(card, before, AHEAD_STATS)


def _averaged(
    card: Any, before: dict[str, Any], keys: tuple[str, str, str]
) -> tuple[float, float] | None:
    """The card's counters ``keys`` (how many, their microseconds, what they drafted) since
    its stats were ``before``: (drafted, microseconds) each on average; None where none."""
    now = card.stats()
    count, us, drafted = (now.get(key, 0) - before.get(key, 0) for key in keys)
    return (drafted / count, us / count) if count else None


OUTCOME_STATS: tuple[str, str, str] = ("outcome_passes", "outcome_pass_us", "outcome_pass_width")
"""The card's counters of its drafting ahead for other outcomes (firmware/telemetry.py)."""


def outcome_pass(card: Any, before: dict[str, Any]) -> tuple[float, float] | None:
    """(outcomes, microseconds) of the card's average pass of a stream's outcome tree since
    its stats were ``before``, as the card timed them; None where it drafted no other outcome."""
    return _averaged(card, before, OUTCOME_STATS)


def outcome_line(card: dict[str, Any], passes: list[tuple[float, float]]) -> dict[str, float]:
    """``outcome_pass_us`` and ``outcome_us``: a pass of a stream's outcome tree as a line in
    its outcomes, from (outcomes, microseconds) a pass timed by the card in the pilot runs, as
    the card runtime fits its own (firmware/outcomes.py, ``PassCost``): with one width seen,
    half of it fixed; with none, the runtime's own prior, a fixed part of two steps of drafting
    ahead and a quarter of a step an outcome. Mean widths less than an outcome apart count as
    one width: a line through them is a slope of noise (the large target's pilots gave 7,311
    us an outcome and 1 us fixed)."""
    if not passes:
        step = card.get("ahead_us_per_token", card["draft_us_per_token"])
        return {"outcome_pass_us": round(2 * step, 2), "outcome_us": round(step / 4, 2)}
    widths = [w for w, _ in passes]
    if max(widths) - min(widths) < 1.0:
        width, us = statistics.mean(widths), statistics.mean(us for _, us in passes)
        return {"outcome_pass_us": round(us / 2, 2), "outcome_us": round(us / 2 / width, 2)}
    fixed, each = fit_line(((w, us, 1.0) for w, us in passes), min_slope=0.0)
    return {"outcome_pass_us": round(max(1.0, fixed), 2), "outcome_us": round(each, 2)}


def ahead_line(card: dict[str, Any], steps: list[tuple[float, float]]) -> dict[str, float]:
    """``ahead_us_per_token`` and ``ahead_stream_us_per_token`` from (streams, microseconds) a
    step of drafting ahead, timed by the card in the pilot runs: a line in the streams (one
    stream count: its step, and ``card``'s cost of a further stream); ``card``'s miss rates
    without any. On this machine the two processes share the CPU's caches, and a card drafting
    beside a running target is slower than while the host waits."""
    if not steps:
        return {}
    if len({s for s, _ in steps}) < 2:
        (streams, us), *_ = steps
        other = card["stream_us_per_token"]
        return {
            "ahead_us_per_token": round(max(1.0, us - (streams - 1) * other), 2),
            "ahead_stream_us_per_token": other,
        }
    first, other = fit_line(((s - 1, us, 1.0) for s, us in steps), min_slope=0.0)
    return {
        "ahead_us_per_token": round(max(1.0, first), 2),
        "ahead_stream_us_per_token": round(other, 2),
    }


def target_profile(
    target: Any, name: str, prompts: list[list[int]], users: Sequence[int], ks: Sequence[int]
) -> dict[str, Any]:
    """``[target.pass]`` from passes of every U in ``users`` with every K in ``ks``, one
    curve per U."""
    rows: dict[str, list[float]] = {"batch": [], "tokens": [], "ms": []}
    for u in users:
        retime(rows, target, prompts, u, ks)
    trees, chains = tree_pass_seconds(target, prompts[0], TREE_PASS, TREE_PASS_KEPT, PASS_TURNS)
    return {
        "target": {
            "name": name,
            "source": f"exstill-bench profile on this machine: passes of {list(users)} users "
            f"with K = {list(ks)} each, the median of {2 * PASS_TURNS} in {PASS_TURNS} turns; "
            f"tree_pass: a tree of {len(TREE_PASS.tokens)} nodes scored and a path of "
            f"{len(TREE_PASS_KEPT)} kept, over a chain of as many tokens, {PASS_TURNS} turns",
            "pass": rows,
            "tree_pass": round(statistics.median(trees) / statistics.median(chains), 3),
        }
    }


TREE_PASS = TokenTree((11, 12, 13, 14, 15, 16, 21, 22), (ROOT, 0, 1, 2, 3, 4, ROOT, 0))
"""The tree a target's tree pass is timed with: the decoder's smaller tree (8 nodes, top-2,
depth 6) as the demo draft grows it, a chain of six with a second choice at depths 1 and 2."""
TREE_PASS_KEPT = (0, 1, 2, 3, 4, 5)
"""The path kept after it: the chain of six, about what the demo runs' trees keep."""


def retime(
    rows: dict[str, list[float]], target: Any, prompts: list[list[int]], users: int,
    ks: Sequence[int],
) -> None:  # fmt: skip
    """Time the passes of ``users`` sequences with every K in ``ks`` (now), in place of the
    table's rows for that many users."""
    keep = [i for i, b in enumerate(rows["batch"]) if b != users]
    for key in rows:
        rows[key] = [rows[key][i] for i in keep]
    for tokens, ms in pass_costs(target, prompts[:users], ks, turns=PASS_TURNS).items():
        rows["batch"].append(users)
        rows["tokens"].append(int(tokens))
        rows["ms"].append(ms)


def card_profile(card: Any, prompt: list[int], streams: int = 12) -> dict[str, Any]:
    """``[card]``: link, drafting and the card's fixed costs, measured through ``card`` on one
    stream and on ``streams`` at once, for K = 1..8: rounds where every stream's draft made
    ahead hit (``round_us``, ``commit_us``: the difference of the two stream counts) and
    rounds where every stream missed, each count's a line in the draft's steps (K + 1): one
    stream's gives a step's cost and ``miss_us``, the difference of the two lines what each
    further stream adds (``stream_us_per_token``, ``miss_stream_us``)."""
    rtt = statistics.median(card.ping() for _ in range(50)) * 1e6
    vocab = {t.name: t.vocab_size for t in card.info().targets}[DRAFT_TARGET]
    rng = np.random.default_rng(0)
    hits, misses = [], []
    for count in (1, streams):
        opened = [card.open_stream(target=DRAFT_TARGET) for _ in range(count)]
        try:
            for s in opened:
                s.prefill(prompt)
            hit: list[float] = []
            missed: dict[int, list[float]] = {k: [] for k in range(1, PILOT_K + 1)}
            # a K's hits in a row, then its misses: what the card drafts ahead after a round
            # is sized by that round's K, and how long, by how long the host took before
            for k in missed:
                for _ in range(CARD_ROUNDS):
                    hit += _round_us(card, opened, k, _hit_verdicts(opened, k), hit=True)
                for _ in range(CARD_ROUNDS):
                    wrong = _miss_verdicts(opened, k, vocab, rng)
                    missed[k] += _round_us(card, opened, k, wrong, hit=False)
            # steps: the bonus taken in, then one per drafted token; the median round of each
            # K, so that a round slowed by the machine's other work does not tilt the line
            points = [(k + 1, statistics.median(us) - rtt, 1.0) for k, us in missed.items() if us]
            if not hit or len(points) < 2:
                raise ExstillError(
                    f"the card's drafting ahead did not hit and miss as its rounds were meant to "
                    f"({len(hit)} hits, misses at {len(points)} K): run exstill-bench profile "
                    "again on an emulator drafting ahead (no --no-prefetch)"
                )
            hits.append(statistics.median(hit) - rtt)
            # a drafted token costs something: where a round's noise hides a small draft's step
            # (on a loaded machine), the one stream's line is held at a slope of MIN_STEP_US,
            # so that the profile stays one the planner reads
            misses.append(fit_line(points, min_slope=MIN_STEP_US if count == 1 else None))
        finally:
            for s in opened:
                s.close()
    costs = round_costs(hits, misses, streams)
    tree = tree_line(card, prompt, rtt, vocab, rng)
    # a tree of one level against a chain's miss of one step: what the tree costs beyond it
    chain_step = sum(costs[key] for key in ("round_us", "commit_us", "miss_us"))
    chain_step += costs["draft_us_per_token"]
    return {
        "card": {
            "name": "emulated",
            "source": "exstill-bench profile: exstill-emu in its own process on its own core, "
            "over TCP",
            "streams": streams,
            **costs,
            "link_rtt_us": round(rtt, 1),
            "prefetch": "outcomes",
            "overflow": "target-alone",
            "max_k": PILOT_K,
            "max_tree_nodes": 0,
            "tree_level_us": round(tree.slope, 1),
            "tree_us": round(max(0.0, tree.intercept - chain_step), 1),
            "prefetch_trees": False,  # the runtime drafts a tree when its COMMIT comes
        }
    }


def round_costs(hits: Sequence[float], misses: Sequence[Line], streams: int) -> dict[str, float]:
    """The card's costs of a round from its rounds timed on one stream and on ``streams``:
    ``hits``, a round (less the link) where every stream's draft made ahead hit; ``misses``,
    the line in the draft's steps of a round where every stream missed."""
    (hit_one, hit_all), (miss_one, miss_all) = hits, misses
    further = streams - 1
    commit = max(0.0, (hit_all - hit_one) / further)
    return {
        "draft_us_per_token": round(miss_one.slope, 2),
        "stream_us_per_token": round(max(0.0, (miss_all.slope - miss_one.slope) / further), 2),
        "round_us": round(max(0.0, hit_one - commit), 1),
        "commit_us": round(commit, 1),
        "miss_us": round(max(0.0, miss_one.intercept - hit_one), 1),
        "miss_stream_us": round(
            max(0.0, (miss_all.intercept - miss_one.intercept) / further - commit), 1
        ),
    }


def tree_line(
    card: Any, prompt: list[int], rtt: float, vocab: int, rng: np.random.Generator
) -> Line:
    """What a tree round costs the card on one stream, a line in the levels after the first:
    COMMIT_TREE rounds (the first node kept, a random bonus) asking for trees of
    ``TREE_PROBE.nodes`` nodes at top-``TREE_PROBE.top_k``, depths 2 to ``TREE_PROBE.depth``,
    taken in turns, each depth's median, less the link's round trip ``rtt`` (timed as the
    chain rounds, ``_round_us``). Its intercept is a tree of one level; its slope
    ``tree_level_us``."""
    depths = range(2, TREE_PROBE.depth + 1)
    taken: dict[int, list[float]] = {d: [] for d in depths}
    with card.open_stream(target=DRAFT_TARGET) as s:
        s.prefill(prompt)
        for _ in range(CARD_ROUNDS):
            for d in depths:
                shape = replace(TREE_PROBE, depth=d)
                s.draft_tree(shape)
                verdict = Verdict(1, int(rng.integers(vocab)), (0,))
                taken[d] += _round_us(card, [s], shape, [verdict], hit=False)
    points = [(d - 1, statistics.median(us) - rtt, 1.0) for d, us in taken.items() if us]
    return fit_line(points, min_slope=MIN_STEP_US)


def _hit_verdicts(streams: list[Any], k: int) -> list[Verdict] | None:
    """Each stream drafts K afresh, the card drafting ahead for the outcome it guesses: all K
    kept and its guess of the bonus, which a draft of K + 1 names first (the draft is greedy);
    verdicts that end there. None where a stream's draft came out short."""
    verdicts = []
    for s in streams:
        guess = s.draft(k + 1).tokens
        if len(guess) <= k or len(s.draft(k).tokens) < k:
            return None
        verdicts.append(Verdict(k, guess[k]))
    return verdicts


def _miss_verdicts(
    streams: list[Any], k: int, vocab: int, rng: np.random.Generator
) -> list[Verdict]:
    """Each stream drafts K afresh; verdicts that keep nothing of it, with a bonus drawn at
    random: one the card's other outcomes (its likeliest few) almost never hold."""
    for s in streams:
        s.draft(k)
    return [Verdict(0, int(rng.integers(vocab))) for _ in streams]


def _round_us(
    card: Any,
    streams: list[Any],
    ask: int | TreeRequest,
    verdicts: list[Verdict] | None,
    hit: bool,
) -> list[float]:
    """The microseconds of a round with ``verdicts`` (the streams' COMMITs sent together, each
    asking for a draft of ``ask``: K, or a tree), or none where the card's counters say it was
    not the round meant: a draft made ahead that ``hit`` for every stream, or for none. Pauses
    first, as a pass would, so that the card finishes drafting ahead; then pings it, so that it
    gives up the drafting for other outcomes it sized to that pause (whose pass in progress a
    COMMIT would wait for) and the round times what the card takes for its COMMITs. Rolls
    every stream back after, so that every round drafts at the same context."""
    if verdicts is None:
        return []
    before = card.stats()["prefetch_hits"]
    time.sleep(PAUSE_S)
    card.ping()
    start = time.perf_counter()
    with card.sent_together():
        sent = [(s, v, s.send_commit(v, ask)) for s, v in zip(streams, verdicts, strict=True)]
    for s, verdict, rid in sent:
        s.receive_commit(rid, verdict)
    us = (time.perf_counter() - start) * 1e6
    hits = card.stats()["prefetch_hits"] - before
    for s, verdict in zip(streams, verdicts, strict=True):
        s.rollback(s.length - verdict.accepted - 1)
    return [us] if hits == (len(streams) if hit else 0) else []


def host_line(points: list[tuple[int, float]]) -> dict[str, float]:
    """``[host]`` from (users, host microseconds a pass) of measured runs."""
    if len({u for u, _ in points}) < 2:
        (_, us), *_ = points
        return {"us_per_round": round(us, 1), "us_per_sequence": 0.0}
    per_round, per_sequence = fit_line(((u, us, 1.0) for u, us in points), min_slope=None)
    if per_round < 0:  # a line through the origin: every microsecond is per sequence
        per_sequence, per_round = sum(y for _, y in points) / sum(u for u, _ in points), 0.0
    return {
        "us_per_round": round(per_round, 1),
        "us_per_sequence": round(max(0.0, per_sequence), 2),
    }
