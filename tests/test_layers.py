"""The house rules of the package's layout (docs/architecture.md), checked on every import.

Every ``import`` and ``from ... import`` in ``stream_st/`` counts, at module level or inside a
function (only those under ``if TYPE_CHECKING:`` are left out: they never run). The rules:

* no import circle, among modules or among the folders' packages;
* no layer imports a layer above it (:data:`LAYERS`, lowest first);
* every module imports on its own in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stream_st"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "_util", "_regex"),
    ("core",),
    ("memory",),
    ("transports",),
    ("reader", "writer"),
    ("_api", "connection", "sharded", "kv", "compat", "torch", "numpy", "distributed"),
    ("integrations", "models"),
    ("tools", "server"),
    ("cli", "__main__"),
]
"""Lowest first: a module may import its own layer and those below, never one above. The
package's ``__init__`` and the re-export modules kept for moved paths stand above them all."""

MOVED = {
    "sources",
    "sinks",
    "hub",
    "codecs",
    "integrity",
    "bert",
    "llm",
    "dataset",
    "torch_dataset",
    "header",
    "dtypes",
}
"""Re-export modules for the paths of releases before the layout: nothing imports them."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _run_branch(node: ast.If) -> list[ast.stmt] | None:
    """The branch of an ``if TYPE_CHECKING:`` (or ``if not TYPE_CHECKING:``) that runs; None for
    another ``if``."""
    test = ast.unparse(node.test)
    if "TYPE_CHECKING" not in test:
        return None
    return node.body if test.startswith("not ") else node.orelse


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and (runs := _run_branch(node)) is not None:
            yield from (n for branch in runs for n in _imports_in(branch))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def imported(name: str) -> set[str]:
    """The package's modules that module ``name`` imports (a package counts as its
    ``__init__``; ``from pkg import sub`` counts ``pkg.sub`` when that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            # ``from pkg import sub`` imports ``pkg.sub``; ``pkg`` itself counts only when a
            # name is taken from it (a parent package's __init__ always runs first anyway)
            names_only = all(sub in MODULES for sub in submodules)
            targets = submodules if names_only else [module, *submodules]
        found |= {target for target in targets if target in MODULES and target != name}
    return found


GRAPH = {name: imported(name) for name in MODULES}


def layer_of(name: str) -> int | None:
    """The rank of module ``name`` in :data:`LAYERS`; None for the top (``__init__``, moved
    paths)."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in MOVED:
        return None
    for rank, members in enumerate(LAYERS):
        if parts[1] in members:
            return rank
    raise AssertionError(f"{name} is in no layer: add its folder to LAYERS")


def test_every_module_is_in_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_no_layer_imports_one_above_it() -> None:
    upward = [
        f"{name} (layer {rank}) imports {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        if (rank := layer_of(name)) is not None
        for target in sorted(targets)
        if (above := layer_of(target)) is None or above > rank
    ]
    assert not upward, "\n".join(upward)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    circle = _circle(GRAPH)
    assert circle is None, " -> ".join(circle or [])


def test_the_rules_can_fail() -> None:
    """The checks above find what they are meant to find."""
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
    assert layer_of("stream_st.core.header") == 1
    assert layer_of("stream_st.cli.app") == len(LAYERS) - 1
    assert "stream_st.core.header" in GRAPH["stream_st.reader.header"]


def test_core_imports_no_transport() -> None:
    """Importing the core (and the memory layer) loads nothing of the transports."""
    code = (
        "import sys, stream_st.core.header, stream_st.core.codecs, stream_st.core.digests, "
        "stream_st.memory.delivery; "
        "print(sorted(m for m in sys.modules if m.startswith('stream_st.transports')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


FIRST_READ_SKIPS = (
    "stream_st.writer",
    "stream_st.core.digests",
    "stream_st.transports.cache",
    "stream_st.transports.streams",
)
"""What a first read of a local file without digests imports none of (the writer, the digests,
the cache and the stream adapters: about a tenth of that read's time in a fresh process)."""


def test_a_first_read_imports_only_what_it_needs(tmp_path: Path) -> None:
    plain, summed = tmp_path / "plain.safetensors", tmp_path / "summed.safetensors"
    code = f"""
import asyncio, sys
import numpy as np
import stream_st.numpy
stream_st.numpy.save_file({{"w": np.arange(6, dtype="f4")}}, {str(plain)!r})
import stream_st
assert asyncio.run(stream_st.load({str(plain)!r}))["w"].sum() == 15
first = [m for m in {FIRST_READ_SKIPS!r} if m in sys.modules]
asyncio.run(stream_st.save({str(summed)!r}, {{"w": np.ones(3, "f4")}}, checksums=True))
assert asyncio.run(stream_st.load({str(summed)!r}))["w"].sum() == 3
print(first, "stream_st.core.digests" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]


ALONE = """
import importlib, os, sys, traceback
import numpy, anyio, ml_dtypes  # third-party: loaded once; the package: once per child
running, failed = {}, 0
for name in sys.argv[1:] + [None] * 2:
    if len(running) == 2 or (name is None and running):  # two children at a time
        pid, status = os.wait()
        failed += status != 0
        del running[pid]
    if name is None:
        continue
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(name, traceback.format_exc().strip().splitlines()[-1], flush=True)
            os._exit(1)
        os._exit(0)
    running[pid] = name
sys.exit(1 if failed else 0)
"""
"""Imports each module named on the command line in a child forked before any module of the
package was loaded: each starts from an interpreter that has imported none of them (two
children at a time)."""


def test_every_module_imports_on_its_own() -> None:
    names = sorted(name for name in MODULES if not name.endswith("__main__"))
    result = subprocess.run(
        [sys.executable, "-c", ALONE, *names], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_module_that_cannot_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "broken_layer_probe.py").write_text("import stream_st.no_such_module\n")
    result = subprocess.run(
        [sys.executable, "-c", ALONE, "broken_layer_probe"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{PACKAGE.parent}"},
    )
    assert result.returncode == 1 and "broken_layer_probe" in result.stdout


def test_every_public_name_resolves() -> None:
    """``stream_st.__all__`` names what the package offers, each imported on first use."""
    code = (
        "import stream_st; missing = [n for n in stream_st.__all__ if not hasattr(stream_st, n)]; "
        "print(missing, set(stream_st.__all__) <= set(dir(stream_st)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True"
