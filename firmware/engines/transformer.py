"""The transformer draft engine: the image's decoder in onnxruntime, many streams at once.

Each stream owns one row of per-layer KV buffers ([rows, kv_heads, slot, head_dim], float32,
allocated once); onnxruntime's attention appends to them in place, through IO bindings made once
per row range, so a decode step copies no cache. Rollback is a length change. A stream
remembers which tokens its cache holds (``cached``), including drafted tokens fed back while
drafting, so committing an accepted prefix costs nothing and the next round starts with one
forward step for the bonus token.

Drafting several streams (``propose_many``, used by prefetch and by the benchmark) runs one
batched step per drafted position over each run of adjacent rows: rows are handed out lowest
first, so concurrent streams sit side by side.

Long context (a stream opened with LONG_CONTEXT): when the window would overflow, the engine
keeps ``sinks`` attention-sink tokens and the most recent tokens (StreamingLLM), dropping the
oldest half of the rest; kept keys move to lower cache positions and are re-rotated by the
shift, so positions stay those of the cache and memory stays constant. Drafts then depend only
on the sinks and the window, not on the evicted text (docs/emulator.md).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.runner import OnnxDecoder
from exstill_sdk.execution.trees import TreeRunner, keep_path
from exstill_sdk.image.reader import CardImage
from exstill_sdk.image.rope import inverse_frequencies, rotate
from exstill_sdk.protocol.constants import TREE_ROOT, ModelKind
from exstill_sdk.protocol.messages import Distribution, TreeRequest
from exstill_sdk.support.tokens import common_prefix
from exstill_sdk.support.trees import grow_sampled_tree

from .base import DraftEngine, EngineState, OutcomeDraft, Proposal, Sampling, TreeProposal
from .sampling import choose, distribution, draw_index, ranking_probs, tree_draws


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


class TransformerEngine(DraftEngine):
    kind = ModelKind.TARGET
    supports_long_context = True

    def __init__(
        self,
        image: CardImage,
        rows: int = 12,
        positions: int = 16384,
        sinks: int = 4,
        threads: int = 0,
    ) -> None:
        arch = image.arch
        if not 1 <= rows <= 255 or positions < 16 or not 0 <= sinks < positions // 4:
            raise InvalidArgumentError(
                "bad engine geometry (rows 1..255, positions >= 16, sinks < 1/4)"
            )
        self.image = image
        self.arch = arch
        self.name = image.target
        self.vocab_size = arch.vocab_size
        self.tokenizer_sha256 = image.tokenizer.sha256
        self.rank_temperature = image.rank_temperature
        self.positions = positions
        self.sinks = sinks
        self.inv_freq = inverse_frequencies(arch)[0]
        self.runner = OnnxDecoder(image, rows, positions, threads)
        self.threads = threads
        self.keys, self.values = self.runner.keys, self.runner.values
        self._free = list(range(rows))
        self._trees: TreeRunner | None = None
        """The tree graph's session, made at the first tree drafted."""
        self.lock = threading.RLock()
        """One forward pass at a time; also guards every state's cache bookkeeping."""

    # ------------------------------------------------------------------ streams

    def open_state(
        self, capacity: int, sampling: Sampling, long_context: bool = False
    ) -> TransformerState:
        with self.lock:
            if not self._free:
                raise InvalidArgumentError("the engine has no free KV row")  # runtime guards
            row = min(self._free)
            self._free.remove(row)
        return TransformerState(self, row, sampling, long_context)

    def release(self, row: int) -> None:
        with self.lock:
            self._free.append(row)

    # ------------------------------------------------------------------ drafting

    def draft_tree(self, state: TransformerState, shape: TreeRequest) -> TreeProposal:
        """A greedy stream's token tree, as EAGLE-2 grows one: from the context's distribution
        its ``top_k`` likeliest tokens; then, a pass per level, the model runs on the level's
        ``top_k`` best nodes (by cumulative probability, the product along the path) at once,
        in the tree graph, and their ``top_k`` likeliest children form the next level. The
        tree is the ``nodes`` best of every node so made; a node's value is at most its
        parent's, so each one's ancestors are in it. ``depth`` levels cost ``depth - 1``
        passes of ``top_k`` tokens."""
        with self.lock:
            context = bytes(state.tokens)
            n = len(context) >> 2
            depth = shape.levels
            if not n or n + depth * shape.top_k > self.positions:
                return EngineState.propose_tree(state, shape)  # a chain; it checks the room
            if self._trees is None:
                self._trees = TreeRunner(self.image, self.runner, self.threads)
            valid = min(common_prefix(state.cached, context), n - 1)
            ids = np.frombuffer(context, "<u4", n - valid, 4 * valid).astype(np.int64)
            logits = self.runner.prefill(state.row, ids, valid)[-1:]
            state.cached = bytearray(context)  # the tree's slots after it are scratch
            grown = _Growth(shape.top_k, self.rank_temperature)
            grown.offer(-1, logits)
            fed: list[int] = []  # the nodes fed to the model, in slot order
            for _ in range(depth - 1):
                beam = grown.beam()
                if not beam:
                    break
                first = len(fed)
                fed += beam
                slot = {node: i for i, node in enumerate(fed)}
                logits = self._trees.grow(
                    state.row,
                    n,
                    [grown.tokens[i] for i in fed],
                    [slot.get(grown.parents[i], -1) for i in fed],
                    first,
                )
                grown.offer(beam, logits)
            return grown.best(shape.nodes)

    def draft_sampled_tree(self, state: TransformerState, shape: TreeRequest) -> TreeProposal:
        """A sampled stream's token tree (exstill_sdk.support.trees.grow_sampled_tree): each
        node's children drawn one after another, without replacement, from the distribution a
        chain would draw its token from there, the budget spent best first on child slots
        ranked before they are drawn. The distributions come a batch of nodes per pass of the
        tree graph; each node's children are drawn from a generator of their own
        (``tree_draws``), so a seeded stream's tree is the same however it was scheduled."""
        with self.lock:
            context = bytes(state.tokens)
            n = len(context) >> 2
            if not n or n + shape.nodes > self.positions:
                return EngineState.propose_tree(state, shape)  # a chain; it checks the room
            if self._trees is None:
                self._trees = TreeRunner(self.image, self.runner, self.threads)
            trees = self._trees
            valid = min(common_prefix(state.cached, context), n - 1)
            ids = np.frombuffer(context, "<u4", n - valid, 4 * valid).astype(np.int64)
            root = self.runner.prefill(state.row, ids, valid)[-1]
            state.cached = bytearray(context)  # the tree's slots after it are scratch
            sampling, base = state.sampling, state.evicted + n
            fed: list[int] = []  # the nodes fed to the model, in slot order
            slot: dict[int, int] = {}

            def open_nodes(
                nodes: list[int], tokens: list[int], parents: list[int]
            ) -> list[tuple[np.ndarray, np.ndarray]]:
                new = [node for node in nodes if node >= 0]
                rows: dict[int, np.ndarray] = {}
                if new:
                    first = len(fed)
                    fed.extend(new)
                    slot.update((node, first + i) for i, node in enumerate(new))
                    logits = trees.grow(
                        state.row,
                        n,
                        [tokens[node] for node in fed],
                        [slot.get(parents[node], -1) for node in fed],
                        first,
                    )
                    rows = dict(zip(new, logits, strict=True))
                return [distribution(rows[x] if x >= 0 else root, sampling) for x in nodes]

            generators: dict[int, np.random.Generator] = {}

            def draw(node: int, weights: np.ndarray) -> int:
                if node not in generators:
                    generators[node] = tree_draws(sampling.seed or 0, base, node)
                return draw_index(weights.astype(np.int64), generators[node])

            grown = grow_sampled_tree(open_nodes, shape.nodes, shape.top_k, shape.levels, draw)
        of_parent = {
            node: Distribution(tuple(int(t) for t in ids), tuple(int(w) for w in weights))
            for node, (ids, weights) in grown.drawn_from.items()
        }
        return TreeProposal(
            _pack(grown.tokens),
            bytes(TREE_ROOT if p < 0 else p for p in grown.parents),
            dists=tuple(of_parent[p] for p in grown.parents),
        )

    def draft_outcomes(
        self,
        state: TransformerState,
        pending: bytes,
        roots: Sequence[tuple[int, int]],
        count: int,
        stop: Callable[[], bool],
    ) -> list[OutcomeDraft] | None:
        """Draft ``count`` tokens after each outcome (j, b) of the pending chain draft at once:
        the chain's tokens cached after the context are a tree's first nodes (a chain), each
        outcome's ``b`` is a new node under the chain's j-th token, and each pass of the tree
        graph feeds one more token of every outcome's draft (chosen as a chain draft chooses
        it: the same logits, the same counter-based sampling position). ``count`` passes; the
        lock is let go between them, and ``stop()`` ends the work between passes: the drafts
        then hold the tokens made so far (None when no pass ran)."""
        with self.lock:
            n = len(state.tokens) >> 2
            cached = bytes(state.cached)
            fed = (len(cached) >> 2) - n
            width = len(roots)
            total = fed + width * count
            if (
                not n
                or fed < len(pending) >> 2
                or not cached.startswith(state.tokens + pending)
                or max(j for j, _ in roots) > len(pending) >> 2
                or n + total > self.positions
            ):
                return None
            if self._trees is None:
                self._trees = TreeRunner(self.image, self.runner, self.threads)
        visible = np.zeros((total, total), bool)
        visible[:fed, :fed] = np.tril(np.ones((fed, fed), bool))
        parents = np.array([j - 1 for j, _ in roots])  # -1: the context
        nodes = np.arange(fed, fed + width)
        visible[nodes] = np.where(parents[:, None] >= 0, visible[np.maximum(parents, 0)], False)
        visible[nodes, nodes] = True
        feed = [b for _, b in roots]
        depth = np.array([j + 1 for j, _ in roots])
        out = np.zeros((width, count), np.int64)
        rows = state.outcome_rows(width, count) if state.keep_logits else None
        dists: list[list[Distribution | None]] = [[] for _ in roots]
        done = 0  # passes run: each outcome has that many tokens
        for level in range(count):
            if stop():
                break
            with self.lock:
                if state.cached[: len(cached)] != cached or (len(state.tokens) >> 2) != n:
                    return None  # the stream changed between passes
                logits = self._trees.add_nodes(
                    state.row, n, feed, depth.tolist(), visible[nodes, : nodes[-1] + 1]
                )
            for r in range(width):
                position = state.evicted + n + int(depth[r])  # the drafted token's
                token, dist = choose(logits[r], state.sampling, position)
                out[r, level] = token
                dists[r].append(dist)
            if rows is not None:
                rows[:, level] = logits
            done = level + 1
            if level + 1 < count:  # the tokens just drafted are the next pass's nodes
                nodes, previous = nodes + width, nodes
                visible[nodes] = visible[previous]
                visible[nodes, nodes] = True
                feed = out[:, level].tolist()
                depth = depth + 1
        if not done:
            return None
        drafts = []
        for r, (j, b) in enumerate(roots):
            path = (*range(j), *(fed + level * width + r for level in range(done)))
            sampled = None if state.sampling.greedy else tuple(d for d in dists[r] if d)
            proposal = Proposal(
                _pack(out[r, :done].tolist()),
                sampled,
                logits=None if rows is None else rows[r, :done],
            )
            drafts.append(OutcomeDraft(pending[: 4 * j] + struct.pack("<I", b), proposal, path))
        return drafts

    def propose_many(self, jobs: Sequence[tuple[EngineState, int, bytes]]) -> list[Proposal]:
        with self.lock:
            plans = [_Plan.start(self, state, k, branch) for state, k, branch in jobs]  # type: ignore[arg-type]
            active = [p for p in plans if p.k > 0]
            while active:
                self._feed([p for p in active if p.logits is None])
                for p in active:
                    p.sample()
                active = [p for p in active if len(p.out) < p.k]
            return [p.proposal() for p in plans]

    def _feed(self, plans: list[_Plan]) -> None:
        """One batched step: each plan's pending token at its position, one call per run of
        adjacent rows."""
        runs: list[list[_Plan]] = []
        for p in sorted(plans, key=lambda p: p.state.row) if len(plans) > 1 else plans:
            if runs and runs[-1][-1].state.row + 1 == p.state.row:
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            logits = self.runner.step(
                run[0].state.row,
                np.array([p.feed for p in run], np.int64),
                np.array([p.position for p in run], np.int32),
            )
            for p, row_logits in zip(run, logits, strict=True):
                p.state.cached += struct.pack("<I", p.feed)
                p.logits = row_logits


class _Growth:
    """A tree being grown (``TransformerEngine.draft_tree``): every node made so far, each with
    its parent and its value, and the newest level."""

    def __init__(self, top_k: int, temperature: float) -> None:
        self.top_k = top_k
        self.temperature = temperature
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.values: list[float] = []
        self.level: list[int] = []

    def offer(self, parents: int | list[int], logits: np.ndarray) -> None:
        """The ``top_k`` likeliest children of each of ``parents`` (-1: the context), from
        their rows of logits; they become the newest level."""
        rows = [parents] if isinstance(parents, int) else parents
        probs = ranking_probs(logits, self.temperature)
        k = min(self.top_k, probs.shape[-1])
        top = np.argpartition(-probs, k - 1, axis=-1)[:, :k]
        self.level = []
        for parent, row, choice in zip(rows, probs, top, strict=True):
            base = self.values[parent] if parent >= 0 else 1.0
            for token in sorted(choice.tolist(), key=lambda t: (-row[t], t)):
                self.level.append(len(self.tokens))
                self.tokens.append(token)
                self.parents.append(parent)
                self.values.append(base * float(row[token]))

    def beam(self) -> list[int]:
        """The newest level's ``top_k`` best nodes, to expand next (in the order made)."""
        ranked = sorted(self.level, key=lambda i: (-self.values[i], i))
        return sorted(ranked[: self.top_k])

    def best(self, nodes: int) -> TreeProposal:
        """The ``nodes`` best nodes made, in the order made (a parent before its children),
        as a proposal."""
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.values[i], i))[:nodes])
        index = {node: i for i, node in enumerate(keep)}
        parents = bytes(TREE_ROOT if self.parents[i] < 0 else index[self.parents[i]] for i in keep)
        return TreeProposal(_pack([self.tokens[i] for i in keep]), parents)


@dataclass
class _Plan:
    """One stream's draft in progress: sample from ``logits``, or first feed ``feed`` at cache
    ``position`` to get them."""

    state: TransformerState
    k: int
    feed: int
    position: int
    logits: np.ndarray | None = None
    out: list[int] = field(default_factory=list)
    dists: list[Distribution | None] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    """Copies of the logits each token was chosen from (``EngineState.keep_logits``)."""

    @classmethod
    def start(
        cls, engine: TransformerEngine, state: TransformerState, k: int, branch: bytes
    ) -> _Plan:
        """Bring the cache up to the context; a plan whose last context token still has to be
        fed (the common case: the bonus token) joins the first batched step, a longer
        uncached tail runs now as one chunk."""
        context = bytes(state.tokens) + branch
        n = len(context) >> 2
        if n == 0:
            return cls(state, 0, 0, 0)
        if state.long_context:
            state.make_room(n, k)
            context = bytes(state.tokens) + branch
            n = len(context) >> 2
        k = max(0, min(k, engine.positions - n + 1))  # fed tokens must fit in the cache
        valid = min(common_prefix(state.cached, context), n - 1)
        last = struct.unpack_from("<I", context, 4 * (n - 1))[0]
        plan = cls(state, k, last, n - 1)
        if k and valid < n - 1:
            ids = np.frombuffer(context, "<u4", n - valid, 4 * valid).astype(np.int64)
            plan.logits = engine.runner.prefill(state.row, ids, valid)[-1]
            state.cached = bytearray(context)
            plan.position = n - 1
        else:
            state.cached = bytearray(context[: 4 * (n - 1)])
        return plan

    def sample(self) -> None:
        s = self.state
        assert self.logits is not None
        token, dist = choose(self.logits, s.sampling, s.evicted + self.position + 1)
        self.out.append(token)
        self.dists.append(dist)
        if s.keep_logits:
            self.rows.append(self.logits.copy())
        self.feed, self.position, self.logits = token, self.position + 1, None

    def proposal(self) -> Proposal:
        dists = None if self.state.sampling.greedy else tuple(d for d in self.dists if d)
        return Proposal(_pack(self.out), dists, logits=np.stack(self.rows) if self.rows else None)


class TransformerState(EngineState):
    def __init__(
        self, engine: TransformerEngine, row: int, sampling: Sampling, long_context: bool
    ) -> None:
        self.engine = engine
        self.row = row
        self.sampling = sampling
        self.long_context = long_context
        self.tokens = bytearray()
        """Committed tokens in the cache window (u32 LE)."""
        self.cached = bytearray()
        """Tokens whose keys and values fill cache positions 0.. (drafts may run past tokens)."""
        self.evicted = 0
        """Committed tokens dropped from the window (long context)."""
        self._closed = False
        self._rows: np.ndarray | None = None
        """Logits of the outcome drafts (``outcome_rows``), reused round to round."""

    @property
    def length(self) -> int:
        return self.evicted + (len(self.tokens) >> 2)

    def extend(self, tokens: bytes) -> None:
        with self.engine.lock:
            self.tokens += tokens

    def truncate(self, length: int) -> None:
        with self.engine.lock:
            floor = self.evicted + self.engine.sinks
            if self.evicted and length < floor:
                raise InvalidArgumentError(
                    f"cannot roll back to {length}: tokens before {floor} left the "
                    "long-context window"
                )
            del self.tokens[4 * (length - self.evicted) :]

    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        return self.engine.propose_many([(self, k, branch)])[0]

    def propose_tree(self, shape: TreeRequest) -> TreeProposal:
        if shape.top_k < 2 or self.long_context:
            return super().propose_tree(shape)
        if self.sampling.greedy:
            return self.engine.draft_tree(self, shape)
        return self.engine.draft_sampled_tree(self, shape)

    def draft_outcomes(
        self,
        pending: bytes,
        roots: Sequence[tuple[int, int]],
        count: int,
        stop: Callable[[], bool],
    ) -> list[OutcomeDraft] | None:
        if self.long_context or not roots or count < 1:
            return None
        return self.engine.draft_outcomes(self, pending, roots, count, stop)

    def outcome_rows(self, width: int, count: int) -> np.ndarray:
        """A [width, count, vocab] buffer for the logits of this stream's outcome drafts,
        allocated once at the largest size asked: a round's drafts are thrown away by the
        next round's, and the committed one's rows (the stream's logits then) are read to
        rank the next outcomes before those are grown."""
        vocab = self.engine.vocab_size
        if self._rows is None or self._rows.shape[0] < width or self._rows.shape[1] < count:
            old = (0, 0) if self._rows is None else self._rows.shape[:2]
            self._rows = np.empty((max(width, old[0]), max(count, old[1]), vocab), np.float32)
        return self._rows[:width, :count]

    def adopt_outcome(self, draft: OutcomeDraft) -> None:
        """Move the outcome's cache entries (tree slots) to where a chain puts them."""
        with self.engine.lock:
            n = (len(self.tokens) - len(draft.committed)) >> 2
            keep_path(self.engine.runner, self.row, n, draft.nodes)
            fed = draft.proposal.tokens[: 4 * (len(draft.nodes) - (len(draft.committed) >> 2))]
            self.cached = self.tokens + fed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.release(self.row)

    def make_room(self, n: int, k: int) -> None:
        """Evict from the window until ``n`` context tokens (the window plus any branch) and
        ``k`` drafted ones fit: keep the sinks, drop the oldest half of the rest."""
        engine = self.engine
        if n + k <= engine.positions:
            return
        window = len(self.tokens) >> 2
        sinks = engine.sinks
        keep = max(0, (engine.positions - sinks) // 2 - (n - window) - k)
        evict = window - sinks - keep
        if evict <= 0:
            return
        committed_cached = min(common_prefix(self.cached, self.tokens), window)
        if committed_cached > sinks + evict:
            src = slice(sinks + evict, committed_cached)
            dst = slice(sinks, committed_cached - evict)
            for keys, values in zip(engine.keys, engine.values, strict=True):
                keys[self.row, :, dst] = rotate(keys[self.row, :, src], -evict, engine.inv_freq)
                values[self.row, :, dst] = values[self.row, :, src]
            kept = committed_cached - evict
        else:
            kept = min(committed_cached, sinks)
        self.tokens = self.tokens[: 4 * sinks] + self.tokens[4 * (sinks + evict) :]
        self.cached = bytearray(self.tokens[: 4 * kept])
        self.evicted += evict
