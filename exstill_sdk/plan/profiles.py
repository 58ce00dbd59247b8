"""Target and card profiles: what a verification pass costs, what the card's drafting costs.

Profiles are TOML or JSON files (docs/planning.md has the schema, and the shipped ones in
``exstill_sdk/data/profiles`` are worked examples with the source of every number). Loading
checks every field and refuses a bad one with a ``ProfileError`` naming it.

A target's costs come in one of two forms:

- measured: ``[target.pass]`` is a pass by the tokens in it (every sequence's K + 1), as on a
  CPU target whose pass costs what its tokens cost; a plain step of B sequences is a pass of B
  tokens, unless ``[target.step]`` gives it apart;
- modelled (the seed's): a plain step by batch size, from ``[target.anchor]`` (a published
  speed at one user, grown by batch from the parts below), ``[target.step]`` (a measured
  table) or ``[target.memory]`` (bytes read over bandwidth against arithmetic over compute,
  a bound); and a pass verifying T tokens for B sequences costs the plain step of B, plus the
  T - B extra tokens at the prefill rate, plus reading the experts the extra tokens wake
  (``[target.verify]``): T tokens routed to k of E experts independently read about
  E(1 - (1 - k/E)^T) of them, and a draft's tokens, consecutive in one text, share experts
  more often than that: ``expert_overlap`` (rho) counts each extra token as 1 - rho of one.

  From the anchor, a plain step of B sequences adds the experts their tokens wake, reading
  each further sequence's KV cache (``kv_bytes_per_token`` at the profile's ``context``) and
  each further token's arithmetic at the prefill rate.
"""

from __future__ import annotations

import json
import math
import sys
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.plan.shapes import DraftShape

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "profiles"


class ProfileError(InvalidArgumentError):
    """A profile that cannot be used: the message names the file and the field."""


# ---------------------------------------------------------------------------- reading fields


def read_document(path: str | Path) -> dict[str, Any]:
    """A profile file (``.toml`` or ``.json``) as a dict."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    kind = "JSON" if p.suffix == ".json" else "TOML"  # what the file was read as
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ProfileError(f"{p.name}: not valid {kind} ({exc})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p.name}: a profile is a table of fields, not {type(data).__name__}")
    return data


KINDS = {"targets": "target", "cards": "card", "acceptance": "acceptance"}
"""Shipped profiles' folders, and the option that takes each (--target, --card, --acceptance)."""


def resolve(path: str | Path, kind: str) -> Path:
    """``path`` itself if it exists, else a shipped profile of that name (``gpt-oss-120b``,
    ``targets/gpt-oss-120b.toml``) in the ``kind`` folder (targets, cards, acceptance). A path
    that names a file (a folder or a suffix in it) must exist."""
    p = Path(path)
    if p.exists():
        return p
    for candidate in (SHIPPED / kind / p.name, SHIPPED / kind / f"{p.name}.toml"):
        if candidate.is_file() and (len(p.parts) == 1 or p.parent.name == kind):
            return candidate
    if len(p.parts) > 1 or p.suffix in (".toml", ".json"):
        raise FileNotFoundError(2, "no such file", str(path))
    for other, option in KINDS.items():
        if other != kind and (SHIPPED / other / f"{p.name}.toml").is_file():
            raise ProfileError(
                f"{p.name} is a shipped {option} profile: pass it as --{option}, not "
                f"--{KINDS[kind]}"
            )
    names = ", ".join(sorted(q.stem for q in (SHIPPED / kind).glob("*.toml")))
    raise FileNotFoundError(2, f"no such {KINDS[kind]} profile (shipped ones: {names})", str(path))


class Fields:
    """Typed access to one table of a profile, each mistake reported with its dotted name."""

    def __init__(self, source: str, table: Any, prefix: str) -> None:
        if not isinstance(table, dict):
            raise ProfileError(f"{source}: {prefix} must be a table of fields")
        self.source, self.table, self.prefix = source, table, prefix

    def has(self, key: str) -> bool:
        return key in self.table

    def name(self, key: str) -> str:
        """The dotted name of a field of this table."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def _fail(self, key: str, what: str) -> ProfileError:
        return ProfileError(f"{self.source}: {self.name(key)} {what}")

    def only(self, *known: str) -> Fields:
        """This table, refusing a field it does not know: a misspelt optional field would
        otherwise be ignored without a word."""
        for key in self.table:
            if key not in known:
                raise self._fail(key, f"is not a field here (known: {', '.join(known)})")
        return self

    def sub(self, key: str) -> Fields:
        if key not in self.table:
            raise self._fail(key, "is missing")
        return Fields(self.source, self.table[key], self.name(key))

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.table.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if not isinstance(value, str):
            raise self._fail(key, f"must be text, not {value!r}")
        if choices and value not in choices:
            raise self._fail(key, f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        minimum: float = 0.0,
        positive: bool = False,
        maximum: float = math.inf,
    ) -> float:
        value = self.table.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        return self._check(key, value, minimum, positive, maximum)

    def flag(self, key: str, default: bool) -> bool:
        value = self.table.get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, f"must be true or false, not {value!r}")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.table.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"must be a whole number {minimum} or more, not {value!r}")
        return value

    def numbers(
        self, key: str, *, positive: bool = False, maximum: float = math.inf
    ) -> list[float]:
        value = self.table.get(key)
        if value is None:
            raise self._fail(key, "is missing")
        if not isinstance(value, list) or not value:
            raise self._fail(key, f"must be a list of numbers, not {value!r}")
        return [self._check(f"{key}[{i}]", v, 0.0, positive, maximum) for i, v in enumerate(value)]

    def _check(self, key: str, value: Any, minimum: float, positive: bool, maximum: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise self._fail(key, f"must be a number, not {value!r}")
        if value < minimum or (positive and value <= 0):
            raise self._fail(key, f"must be {'above' if positive else 'at least'} 0, not {value}")
        if value > maximum:
            raise self._fail(key, f"must be at most {maximum:g}, not {value}")
        return float(value)


# ---------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class Curve:
    """y by x from a measured table: straight lines between points, the last segment's slope
    beyond them, the first point's value below them."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def read(cls, table: Fields, x: str, y: str) -> Curve:
        xs, ys = table.numbers(x, positive=True), table.numbers(y, positive=True)
        if len(xs) != len(ys):
            raise ProfileError(
                f"{table.source}: {table.prefix}.{y} has {len(ys)} values for {len(xs)} in "
                f"{table.prefix}.{x}"
            )
        if any(b <= a for a, b in pairwise(xs)):
            raise ProfileError(f"{table.source}: {table.prefix}.{x} must be strictly increasing")
        return cls(tuple(xs), tuple(ys))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1 or x <= xs[0]:
            return ys[0]
        i = min(bisect_left(xs, x), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class PassTable:
    """Measured passes by the tokens in them, one curve per batch size where the table gives
    ``batch`` (the sequences in the pass change its cost on a target with a per-sequence part,
    such as attention): a batch between two measured ones is interpolated between their
    curves, one beyond them takes the nearest. Without ``batch``, one curve for every batch."""

    curves: tuple[tuple[int, Curve], ...]
    """(batch, curve), batch ascending; batch 0: any."""

    @classmethod
    def read(cls, table: Fields) -> PassTable:
        if not table.has("batch"):
            return cls(((0, Curve.read(table, "tokens", "ms")),))
        batches = table.numbers("batch", positive=True)
        tokens, ms = table.numbers("tokens", positive=True), table.numbers("ms", positive=True)
        if not len(batches) == len(tokens) == len(ms):
            raise ProfileError(
                f"{table.source}: {table.name('batch')}, {table.name('tokens')} and "
                f"{table.name('ms')} must have one value per measured pass"
            )
        rows: dict[int, list[tuple[float, float]]] = {}
        for i, (b, t, y) in enumerate(zip(batches, tokens, ms, strict=True)):
            if b != int(b) or t < b:
                raise ProfileError(
                    f"{table.source}: {table.name(f'batch[{i}]')} must be a whole number of "
                    f"sequences, at most the pass's tokens ({t:g}), not {b:g}"
                )
            rows.setdefault(int(b), []).append((t, y))
        curves = []
        for b in sorted(rows):
            points = sorted(rows[b])
            if any(t1 <= t0 for (t0, _), (t1, _) in pairwise(points)):
                raise ProfileError(
                    f"{table.source}: {table.name('tokens')} repeats a size for batch {b}"
                )
            curves.append((b, Curve(tuple(t for t, _ in points), tuple(y for _, y in points))))
        return cls(tuple(curves))

    def scaled(self, batch: int, factor: float) -> PassTable:
        """The table with its passes of ``batch`` sequences (a curve it has) ``factor`` times
        as long."""
        if batch not in (b for b, _ in self.curves):
            raise ValueError(f"the pass table has no curve of {batch} sequences to scale")
        return PassTable(
            tuple(
                (b, Curve(c.xs, tuple(y * factor for y in c.ys)) if b == batch else c)
                for b, c in self.curves
            )
        )

    def __call__(self, batch: int, tokens: float) -> float:
        curves = self.curves
        if len(curves) == 1:
            return curves[0][1](tokens)
        sizes = [b for b, _ in curves]
        i = bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return curves[i][1](tokens)
        if i == 0 or i == len(sizes):
            return curves[min(i, len(sizes) - 1)][1](tokens)
        (b0, c0), (b1, c1) = curves[i - 1], curves[i]
        w = (batch - b0) / (b1 - b0)
        return (1 - w) * c0(tokens) + w * c1(tokens)


def experts_read(tokens: float, experts: int, active: int) -> float:
    """Experts of a layer that ``tokens`` tokens, each routed to ``active`` of ``experts``
    independently, read between them: E(1 - (1 - k/E)^T)."""
    return experts * (1.0 - (1.0 - active / experts) ** tokens)


# ---------------------------------------------------------------------------- target


@dataclass(frozen=True)
class MemoryModel:
    """A step bound by whichever is slower: reading the weights it needs, or its arithmetic."""

    weight_bytes: float
    expert_bytes: float
    experts: int
    active_experts: int
    bandwidth_gb_s: float
    flops_per_token: float
    compute_tflops: float

    def step_ms(self, batch: float) -> float:
        read = self.weight_bytes
        if self.experts:
            read += experts_read(batch, self.experts, self.active_experts) * self.expert_bytes
        memory = read / (self.bandwidth_gb_s * 1e9) * 1e3
        compute = batch * self.flops_per_token / (self.compute_tflops * 1e12) * 1e3
        return max(memory, compute)


@dataclass(frozen=True)
class Anchor:
    """A plain step at one user taken from a published speed."""

    tokens_per_s: float
    source: str

    @property
    def ms(self) -> float:
        return 1e3 / self.tokens_per_s


@dataclass(frozen=True)
class TargetProfile:
    name: str
    source: str
    step: Curve | MemoryModel | Anchor | None
    """A plain step by batch size; None: a pass of B tokens (``passes``)."""
    passes: PassTable | None
    """A verification pass by the tokens in it (measured); None: the seed's model below."""
    prefill_tokens_per_s: float = math.inf
    experts: int = 0
    active_experts: int = 0
    expert_ms: float = 0.0
    """Reading one expert's weights, every layer's, once."""
    expert_overlap: float = 0.0
    """How often a drafted token's experts are its predecessor's beyond chance (0..1)."""
    sequence_ms: float = 0.0
    """Reading one sequence's KV cache at the profile's context (the anchored form)."""
    tree_pass: float = 1.0
    """A pass scoring a tree (and keeping the accepted path's cache after it) over a pass
    scoring a chain of as many tokens: 1 where the engine scores a tree as it scores a chain
    (a tree attention mask over the same tokens); ``exstill-bench profile`` times it."""

    def step_ms(self, batch: int) -> float:
        """A plain decode step of ``batch`` sequences."""
        if self.step is None:
            assert self.passes is not None
            return self.passes(batch, batch)
        if isinstance(self.step, MemoryModel):
            return self.step.step_ms(batch)
        if isinstance(self.step, Anchor):
            more = batch - 1
            grown = self._woken(1, batch) + more * (self.sequence_ms + self._token_ms)
            return self.step.ms + grown
        return self.step(batch)

    def verify_ms(self, batch: int, tokens: int) -> float:
        """A pass verifying ``tokens`` tokens (each sequence's K + 1) of ``batch`` sequences."""
        if self.passes is not None:
            return self.passes(batch, tokens)
        extra = max(0, tokens - batch)
        routed = batch + extra * (1.0 - self.expert_overlap)
        return self.step_ms(batch) + extra * self._token_ms + self._woken(batch, routed)

    @property
    def _token_ms(self) -> float:
        """One more token's arithmetic in a pass."""
        return 1e3 / self.prefill_tokens_per_s

    def _woken(self, before: float, after: float) -> float:
        """Reading the experts that ``after`` tokens routed wake beyond ``before``'s."""
        if not self.experts or after <= before:
            return 0.0
        e, k = self.experts, self.active_experts
        return (experts_read(after, e, k) - experts_read(before, e, k)) * self.expert_ms


def load_target(path: str | Path) -> TargetProfile:
    p = resolve(path, "targets")
    top = Fields(p.name, read_document(p), "").only("target")
    t = top.sub("target").only(
        "name", "source", "context", "pass", "step", "memory", "anchor", "verify", "tree_pass"
    )
    src = p.name
    passes = PassTable.read(t.sub("pass").only("batch", "tokens", "ms")) if t.has("pass") else None
    step: Curve | MemoryModel | Anchor | None = None
    forms = [f"target.{f}" for f in ("step", "memory", "anchor") if t.has(f)]
    if len(forms) > 1:
        raise ProfileError(f"{src}: give one of {' and '.join(forms)}, not both")
    if t.has("step"):
        step = Curve.read(t.sub("step").only("batch", "ms"), "batch", "ms")
    elif t.has("memory"):
        step = _memory(t.sub("memory").only(*MEMORY_FIELDS))
    elif t.has("anchor"):
        a = t.sub("anchor").only("tokens_per_s", "source")
        step = Anchor(a.number("tokens_per_s", positive=True), a.text("source"))
    elif passes is None:
        raise ProfileError(
            f"{src}: target.anchor is missing (or target.step, target.memory, target.pass)"
        )
    kw: dict[str, Any] = {}
    if passes is None:
        if not t.has("verify"):
            raise ProfileError(f"{src}: target.verify is missing (or give target.pass)")
        kw = _verify(t.sub("verify").only(*VERIFY_FIELDS), step, t)
    elif t.has("verify"):
        raise ProfileError(f"{src}: target.verify is for the modelled form; target.pass is given")
    kw["tree_pass"] = t.number("tree_pass", 1.0, positive=True)
    return TargetProfile(
        name=t.text("name"), source=t.text("source", ""), step=step, passes=passes, **kw
    )


VERIFY_FIELDS = (
    "prefill_tokens_per_s",
    "experts",
    "active_experts",
    "expert_ms",
    "expert_bytes",
    "expert_overlap",
    "bandwidth_gb_s",
    "kv_bytes_per_token",
)


def _verify(v: Fields, step: Curve | MemoryModel | Anchor | None, t: Fields) -> dict[str, Any]:
    """The modelled form's parts (module docstring), each checked against the step's form."""
    kw: dict[str, Any] = {"prefill_tokens_per_s": v.number("prefill_tokens_per_s", positive=True)}
    memory = step if isinstance(step, MemoryModel) else None

    def bandwidth(field: str) -> float:
        if v.has("bandwidth_gb_s"):
            return v.number("bandwidth_gb_s", positive=True)
        if memory is not None:
            return memory.bandwidth_gb_s
        raise ProfileError(f"{v.source}: {v.name('bandwidth_gb_s')} is missing ({field})")

    if v.has("experts") or (memory is not None and memory.experts):
        kw["experts"], kw["active_experts"] = _experts(v, step)
        if v.has("expert_ms") and v.has("expert_bytes"):
            raise ProfileError(f"{v.source}: give {v.name('expert_ms')} or expert_bytes, not both")
        if v.has("expert_ms"):
            kw["expert_ms"] = v.number("expert_ms")
        else:
            size = (
                memory.expert_bytes
                if memory is not None and not v.has("expert_bytes")
                else v.number("expert_bytes")
            )
            kw["expert_ms"] = size / (bandwidth("to read expert_bytes") * 1e9) * 1e3
        kw["expert_overlap"] = v.number("expert_overlap", 0.0, maximum=1.0)
    if v.has("kv_bytes_per_token"):
        if not isinstance(step, Anchor):
            raise ProfileError(
                f"{v.source}: {v.name('kv_bytes_per_token')} grows an anchored step by batch: "
                "give it with target.anchor"
            )
        context = t.number("context", positive=True) if t.has("context") else None
        if context is None:
            raise ProfileError(f"{v.source}: target.context is missing (for kv_bytes_per_token)")
        per_sequence = v.number("kv_bytes_per_token") * context
        kw["sequence_ms"] = per_sequence / (bandwidth("to read the KV cache") * 1e9) * 1e3
    return kw


def _experts(v: Fields, step: Curve | MemoryModel | Anchor | None) -> tuple[int, int]:
    if isinstance(step, MemoryModel) and step.experts and not v.has("experts"):
        return step.experts, step.active_experts
    experts = v.integer("experts")
    active = v.integer("active_experts")
    if active > experts:
        raise ProfileError(
            f"{v.source}: {v.prefix}.active_experts ({active}) must be at most experts ({experts})"
        )
    return experts, active


MEMORY_FIELDS = (
    "weight_bytes",
    "expert_bytes",
    "experts",
    "active_experts",
    "bandwidth_gb_s",
    "flops_per_token",
    "compute_tflops",
)


def _memory(m: Fields) -> MemoryModel:
    experts = m.integer("experts", 0, minimum=0)
    active = m.integer("active_experts", 0, minimum=0)
    if experts and not 1 <= active <= experts:
        raise ProfileError(f"{m.source}: {m.prefix}.active_experts must be 1..experts ({experts})")
    return MemoryModel(
        weight_bytes=m.number("weight_bytes", positive=True),
        expert_bytes=m.number("expert_bytes", 0.0) if experts else 0.0,
        experts=experts,
        active_experts=active,
        bandwidth_gb_s=m.number("bandwidth_gb_s", positive=True),
        flops_per_token=m.number("flops_per_token", positive=True),
        compute_tflops=m.number("compute_tflops", positive=True),
    )


# ---------------------------------------------------------------------------- card

CARD_FIELDS = (
    "name",
    "source",
    "streams",
    "cards",
    "draft_us_per_token",
    "stream_us_per_token",
    "parallel_streams",
    "round_us",
    "commit_us",
    "miss_us",
    "miss_stream_us",
    "link_rtt_us",
    "prefetch",
    "max_outcomes",
    "candidates",
    "outcome_share",
    "overflow",
    "max_k",
    "max_tree_nodes",
    "ahead_us_per_token",
    "ahead_stream_us_per_token",
    "target_slowdown",
    "outcome_pass_us",
    "outcome_us",
    "tree_level_us",
    "tree_us",
    "prefetch_trees",
)
PREFETCH = ("outcomes", "full-acceptance", "none")
MAX_K = 16
"""The card runtime's longest chain by default (firmware/runtime.py, DEFAULT_MAX_K)."""
MAX_OUTCOMES = 16
"""Most outcomes the card runtime drafts ahead for a stream (firmware/outcomes.py, MAX_WIDTH)."""
CANDIDATES = 4
"""Alternatives to each drafted token the card runtime weighs when it names the outcomes it
drafts ahead for (firmware/outcomes.py, CANDIDATES)."""
MAX_TREE_NODES = 64
"""The largest tree the protocol carries (exstill_sdk/protocol/constants.py)."""
OUTCOME_SHARE = 0.85
"""The share of the host's verification the card runtime fills (firmware/outcomes.py)."""
OVERFLOW = ("waves", "target-alone")


@dataclass(frozen=True)
class CardProfile:
    name: str
    source: str
    streams: int
    """Streams a card holds."""
    cards: int
    draft_us_per_token: float
    """One drafted token of one stream."""
    stream_us_per_token: float
    """What each further stream of a wave adds to a drafted token: 0 where streams are drafted
    side by side in silicon; on a CPU (the emulator) one batched step grows with its rows."""
    parallel_streams: int
    """Streams a card drafts at once (a wave); more cost another wave each."""
    round_us: float
    """The card's fixed time for a round, hit or miss, besides each stream's ``commit_us``
    (taking the COMMITs in, giving up its drafting ahead, answering)."""
    commit_us: float
    """The card's time for each stream's COMMIT and reply in a round, hit or miss, besides
    drafting."""
    miss_us: float
    """The card's fixed cost of drafting anew after a miss (taking in the accepted tokens,
    starting the engine), besides the drafted tokens."""
    miss_stream_us: float
    """What each further stream that missed adds to ``miss_us``."""
    link_rtt_us: float
    prefetch: str
    """``outcomes``: the next draft is made ahead for the likeliest ways the round can end, as
    many as fit (``max_outcomes``, ``outcome_share``); ``full-acceptance``: for the one where
    every drafted token and the card's guess of the bonus are right; ``none``."""
    overflow: str
    """Users beyond the streams: ``waves`` (streams shared in turns) or ``target-alone``
    (K = 0 until a stream frees, as the SDK does)."""
    max_k: int
    """Longest chain the card drafts."""
    max_tree_nodes: int
    """Largest tree the card drafts (0: chains only)."""
    max_outcomes: int
    """Most outcomes a stream's next draft is made ahead for."""
    candidates: int
    """Alternatives to each drafted token (and to its guess of the bonus) the card weighs for
    those outcomes: an outcome whose bonus is the draft's choice of a lower rank is never
    drafted ahead for."""
    outcome_share: float
    """The share of the time from its reply to the next COMMITs the card fills with drafting
    ahead."""
    ahead_us_per_token: float
    ahead_stream_us_per_token: float
    """``draft_us_per_token`` and ``stream_us_per_token`` of drafting ahead, while the target
    verifies: the same in silicon; on a CPU emulator beside a running target, more (the two
    share caches), where a miss is drafted while the host waits."""
    target_slowdown: float
    """How many times as long the target's verification pass takes in a round the card drafts
    for (ahead, beside the pass, or when the COMMIT comes, just before it): 1 for a card of its
    own silicon (the default); above 1 for the emulator, which shares the CPU's caches and
    memory with the target (its drafting evicts a small target's weights from the L3). A plain
    step (K = 0, the card idle) is not slowed."""
    outcome_pass_us: float | None
    """A card that drafts ahead for each stream's other outcomes (besides full acceptance) in
    an outcome tree of its own, one pass a drafted token, after the batched drafting ahead
    for full acceptance, as the card runtime does (firmware/prefetch.py): each pass's fixed
    part, and ``outcome_us`` each outcome in it. None (the default): other outcomes are more
    rows of the batched drafting ahead, as a card that drafts them side by side in silicon."""
    outcome_us: float
    tree_level_us: float | None
    """A card that grows each stream's tree a pass a level, as the card runtime does (one run
    of its tree graph over the level's best nodes): each level after the first costs this, the
    first a chain's first step. None (the default): a tree's levels cost what a chain's steps
    of as many rows do."""
    tree_us: float
    """With ``tree_level_us``: what each stream's tree costs the card beyond a chain's first
    step (taking in the kept path, the tree graph's first level)."""
    prefetch_trees: bool
    """Whether the card drafts a tree ahead, as it does a chain. The card runtime drafts a
    tree when its COMMIT comes, never ahead; the default, true, is the card the seed's figures
    assume."""
    host_us_per_round: float
    """The host's own time a round (its loop), besides the pass."""
    host_us_per_sequence: float
    """The host's time for each sequence drafting on the card: acceptance, its COMMIT and
    the reply (a sequence at K = 0 costs the pass alone)."""

    def with_cards(self, cards: int) -> CardProfile:
        return replace(self, cards=cards)

    def waves(self, streams: int) -> int:
        return math.ceil(streams / (self.parallel_streams * self.cards))

    def drafting_us(self, streams: int, shape: DraftShape, ahead: bool = False) -> float:
        """Drafting ``shape`` for ``streams`` streams at once (``ahead``: while the target
        verifies): each of its steps (``DraftShape.steps``) priced as a chain's step of as
        many rows, or, for a tree with ``tree_level_us``, its first step, then each stream's
        ``tree_us`` and its levels after the first, one after another."""
        if shape.kind == "tree" and self.tree_level_us is not None:
            levels = max(0, len(shape.levels) - 1)
            each = self.tree_us + levels * self.tree_level_us
            return self.draft_us(streams, 1, ahead) + streams * each
        return sum(self.draft_us(streams * rows, 1, ahead) for rows in shape.steps)

    def ahead_us(self, shape: DraftShape, widths: Sequence[int]) -> float:
        """Drafting ``shape`` ahead for streams that each draft ahead for ``widths`` outcomes
        (full acceptance and the others; 0: none): as many rows of one batched drafting, or,
        with ``outcome_pass_us``, full acceptance batched for every stream drafting ahead,
        then each stream's outcome tree, a pass a drafted token, one after another."""
        if self.outcome_pass_us is None:
            return self.drafting_us(sum(widths), shape, ahead=True)
        passes = len(shape.steps)
        trees = sum(self.outcome_pass_us + self.outcome_us * (w - 1) for w in widths if w > 1)
        return self.drafting_us(sum(w > 0 for w in widths), shape, ahead=True) + passes * trees

    def drafts_ahead(self, shape: DraftShape) -> bool:
        """Whether the card drafts the next ``shape`` ahead while the target verifies."""
        return self.prefetch != "none" and (shape.kind != "tree" or self.prefetch_trees)

    def draft_us(self, streams: int, tokens: int, ahead: bool = False) -> float:
        """Drafting ``tokens`` tokens on each of ``streams`` streams: every wave pays a token
        for its first stream and ``stream_us_per_token`` for each other (``ahead``: the
        rates of drafting ahead)."""
        if not streams or not tokens:
            return 0.0
        waves = self.waves(streams)
        first, other = (
            (self.ahead_us_per_token, self.ahead_stream_us_per_token)
            if ahead
            else (self.draft_us_per_token, self.stream_us_per_token)
        )
        return tokens * (waves * first + (streams - waves) * other)


def load_card(path: str | Path) -> CardProfile:
    p = resolve(path, "cards")
    top = Fields(p.name, read_document(p), "").only("card", "host")
    c = top.sub("card").only(*CARD_FIELDS)
    host = (top.sub("host") if top.has("host") else Fields(p.name, {}, "host")).only(
        "us_per_round", "us_per_sequence"
    )
    streams = c.integer("streams")
    return CardProfile(
        name=c.text("name"),
        source=c.text("source", ""),
        streams=streams,
        cards=c.integer("cards", 1),
        draft_us_per_token=c.number("draft_us_per_token", positive=True),
        stream_us_per_token=c.number("stream_us_per_token", 0.0),
        parallel_streams=c.integer("parallel_streams", streams),
        round_us=c.number("round_us", 0.0),
        commit_us=c.number("commit_us", 0.0),
        miss_us=c.number("miss_us", 0.0),
        miss_stream_us=c.number("miss_stream_us", 0.0),
        link_rtt_us=c.number("link_rtt_us", 0.0),
        prefetch=c.text("prefetch", "outcomes", PREFETCH),
        overflow=c.text("overflow", "waves", OVERFLOW),
        max_k=c.integer("max_k", MAX_K),
        max_tree_nodes=c.integer("max_tree_nodes", MAX_TREE_NODES, minimum=0),
        max_outcomes=c.integer("max_outcomes", MAX_OUTCOMES),
        candidates=c.integer("candidates", CANDIDATES),
        outcome_share=c.number("outcome_share", OUTCOME_SHARE, positive=True, maximum=1.0),
        ahead_us_per_token=c.number(
            "ahead_us_per_token", c.number("draft_us_per_token", positive=True), positive=True
        ),
        ahead_stream_us_per_token=c.number(
            "ahead_stream_us_per_token", c.number("stream_us_per_token", 0.0)
        ),
        target_slowdown=c.number("target_slowdown", 1.0, positive=True),
        outcome_pass_us=(
            c.number("outcome_pass_us", positive=True) if c.has("outcome_pass_us") else None
        ),
        outcome_us=c.number("outcome_us", 0.0),
        tree_level_us=c.number("tree_level_us", positive=True) if c.has("tree_level_us") else None,
        tree_us=c.number("tree_us", 0.0),
        prefetch_trees=c.flag("prefetch_trees", True),
        host_us_per_round=host.number("us_per_round", 0.0),
        host_us_per_sequence=host.number("us_per_sequence", 0.0),
    )
