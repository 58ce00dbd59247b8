"""The package's layout: no import cycles between its modules, and layer names a newcomer can
read (the speculative-decoding loop is exstill_sdk.speculative, not a 'spec')."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"exstill_sdk": ROOT / "exstill_sdk", "exstill_firmware": ROOT / "firmware"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that ``name`` imports anywhere in its file (TYPE_CHECKING and lazy
    imports inside functions included: each is a dependency all the same)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, *([node.module] if node.module else [])])
            else:
                prefix = node.module or ""
            candidates = [prefix, *(f"{prefix}.{a.name}" for a in node.names)]
        else:
            continue
        out.update(c for c in candidates if c in modules and c != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 80  # the walk found the package, not an empty folder
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists the packages; a folder missing there works in a checkout and is
    absent from a wheel (pip install .)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed


def test_the_decoding_layer_is_named_for_what_it_does() -> None:
    assert importlib.util.find_spec("exstill_sdk.speculative") is not None
    assert importlib.util.find_spec("exstill_sdk.spec") is None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


SHARED_WITH_FIRMWARE = (
    "exstill_sdk.protocol",
    "exstill_sdk.image",
    "exstill_sdk.execution",
    "exstill_sdk.support",
    "exstill_sdk.errors",
)
"""What the card runtime takes from the SDK: the bytes (protocol, image), running an image's
decoder (execution), shared machinery (support), and the error types whose codes the protocol
carries."""

EMULATOR_STARTERS = {
    "exstill_sdk.transport.emu": "emu:// runs the runtime in process",
    "exstill_sdk.transport.usb": "usb:// finds the emulated USB card of the tests' backend",
    "exstill_sdk.cli.emu": "exstill-emu serves the runtime",
    "exstill_sdk.bench.engine.cost": "exstill-bench engine times the card's own engine, no link",
    "exstill_sdk.bench.decode.trees": "exstill-bench trees grows the card engine's own trees",
    "exstill_sdk.evaluation.drafters": "exstill eval scores the card's own prompt lookup",
    "exstill_sdk.evaluation.trees": "exstill eval --trees grows the card engine's own trees",
}
"""The only SDK modules that import the firmware, and why."""


def _is_under(module: str, packages: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_firmware_takes_only_the_shared_layers_of_the_sdk() -> None:
    wrong = {
        (name, dep)
        for name, deps in _graph().items()
        if name.startswith("exstill_firmware")
        for dep in deps
        if dep.startswith("exstill_sdk") and not _is_under(dep, SHARED_WITH_FIRMWARE)
    }
    assert wrong == set()


def test_the_sdk_imports_the_firmware_only_to_start_an_emulator() -> None:
    importers = {
        name
        for name, deps in _graph().items()
        if name.startswith("exstill_sdk") and any(d.startswith("exstill_firmware") for d in deps)
    }
    assert importers <= set(EMULATOR_STARTERS)


def test_the_demo_does_not_import_the_benchmarks() -> None:
    wrong = {
        (name, dep)
        for name, deps in _graph().items()
        if _is_under(name, ("exstill_sdk.demo",))
        for dep in deps
        if _is_under(dep, ("exstill_sdk.bench",))
    }
    assert wrong == set()


def test_no_module_imports_the_package_root() -> None:
    """The root (exstill_sdk/__init__.py) loads the whole client; a module that needs the
    version takes exstill_sdk.version."""
    importers = {name for name, deps in _graph().items() if "exstill_sdk" in deps}
    assert importers == set()


def test_no_code_replaces_a_cards_link() -> None:
    """A benchmark or a test that needs another link builds a Card on it (Card(transport)),
    never assigns one into a connected card."""
    offenders = []
    for folder in (ROOT / "exstill_sdk", ROOT / "firmware", ROOT / "tests", ROOT / "tools"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if isinstance(node, ast.Assign | ast.AugAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    offenders += [
                        f"{path.relative_to(ROOT)}:{node.lineno}"
                        for t in targets
                        if isinstance(t, ast.Attribute)
                        and t.attr in ("_transport", "transport")
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    ]
    assert offenders == []


def test_the_planner_reads_data_and_never_runs_the_hot_path() -> None:
    """plan/ is profiles in, a simulation out; only plan/measure (exstill-bench profile,
    exstill plan --check) runs a card and a target."""
    hot = ("exstill_sdk.speculative", "exstill_sdk.card", "exstill_sdk.stream")
    hot += ("exstill_sdk.transport", "exstill_sdk.adapters", "exstill_firmware")
    wrong = {
        (name, dep)
        for name, deps in _graph().items()
        if _is_under(name, ("exstill_sdk.plan",))
        and not _is_under(name, ("exstill_sdk.plan.measure",))
        for dep in deps
        if _is_under(dep, hot)
    }
    assert wrong == set()
