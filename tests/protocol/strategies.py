"""Hypothesis strategies for every v1 message."""

from __future__ import annotations

from hypothesis import strategies as st

from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import MAX_TREE_NODES
from exstill_sdk.protocol.drafts import chain_or_tree

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
names = st.text(max_size=20).filter(lambda s: len(s.encode()) <= 64)
f32 = st.floats(width=32, allow_nan=False)

hello_requests = st.builds(m.HelloRequest, u8, u8, names)
targets = st.builds(m.TargetInfo, names, u32, st.binary(min_size=32, max_size=32))
hello_replies = st.builds(
    m.HelloReply,
    version=u8,
    firmware=names,
    slots=u16,
    context=u32,
    max_k=u8,
    wire_modes=u8,
    features=u32,
    max_payload=u16,
    engines=st.lists(names, max_size=4).map(tuple),
    targets=st.lists(targets, max_size=3).map(tuple),
)
stats = st.dictionaries(names, u64, max_size=10)
open_requests = st.builds(m.OpenRequest, u8, names, u8, u8, u16, u8, f32, f32, u64)
open_replies = st.builds(m.OpenReply, u32, u32, u8)
commits = st.builds(m.CommitRequest, u8, u32, u8)
token_lists = st.lists(u32, max_size=64)


@st.composite
def distributions(draw: st.DrawFn) -> m.Distribution:
    n = draw(st.integers(1, 12))
    weights = draw(st.lists(u16, min_size=n, max_size=n).filter(any))
    return m.Distribution(tuple(draw(st.lists(u32, min_size=n, max_size=n))), tuple(weights))


@st.composite
def draft_replies(draw: st.DrawFn) -> m.Draft:
    tokens = tuple(draw(st.lists(u32, max_size=16)))
    dists = None
    if draw(st.booleans()):
        dists = tuple(draw(distributions()) for _ in tokens)
    return m.Draft(tokens, draw(st.booleans()), dists, draw(st.booleans()))


errors = st.builds(m.ErrorReply, u16, st.text(max_size=50).filter(lambda s: len(s.encode()) <= 200))


@st.composite
def tree_replies(draw: st.DrawFn) -> m.Draft:
    """A DRAFT_TREE / COMMIT_TREE reply as the host reads it: a chain-shaped tree as a chain."""
    n = draw(st.integers(0, MAX_TREE_NODES))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.lists(u32, min_size=n, max_size=n)))
    dists = None
    if draw(st.booleans()):  # a sampled tree: siblings share their parent's distribution
        of_parent = {p: draw(distributions()) for p in sorted(set(parents))}
        dists = tuple(of_parent[p] for p in parents)
    return m.Draft(tokens, draw(st.booleans()), dists, draw(st.booleans()), chain_or_tree(parents))


tree_requests = st.builds(m.TreeRequest, u8, u8, u8)
commit_tree_requests = st.builds(
    m.CommitTreeRequest, st.lists(u8, max_size=64).map(tuple), u32, tree_requests
)
