"""The package's shape: every module imports in a fresh interpreter, no import cycle between
packages, and the lower layers import nothing from the layers above them.

Nodes are the packages under loom/ (loom.core, loom.engine, ...), each top-level module
(loom.config, loom.request, ...) and the `loom` facade (loom/__init__.py). Every import counts,
inside functions too; only `if TYPE_CHECKING:` imports (annotations) do not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import loom

ROOT = Path(loom.__file__).parent

# The model and runtime stack, and the model store (hub): these import only each other and
# top-level modules, never a layer above (engine, entrypoints, bench, tools, lang, ...). A new
# package is an upper layer until it is listed here.
LOWER = {"core", "sample", "layers", "attention", "quant", "kernels", "loader", "tokenizer",
         "models", "worker", "structured", "hub"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> list[str]:
    return sorted(_module_name(p) for p in ROOT.rglob("*.py"))


def _node(module: str) -> str:
    """loom.core.scheduler -> loom.core; loom.config -> loom.config; loom -> loom."""
    parts = module.split(".")
    if len(parts) == 1:
        return "loom"
    is_package = (ROOT / parts[1]).is_dir()
    return ".".join(parts[:2]) if is_package or (ROOT / f"{parts[1]}.py").exists() else "loom"


def _imports(path: Path) -> set[str]:
    """The loom modules `path` imports at run time (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    found: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in typing_only:
            continue
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            found.add(n.module)
            found.update(f"{n.module}.{a.name}" for a in n.names)  # `from loom import core`
    return {m for m in found if m == "loom" or m.startswith("loom.")}


def _graph() -> dict[str, dict[str, str]]:
    """node -> {node it imports: one module that does}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        for target in _imports(path):
            a, b = _node(module), _node(target)
            if a != b:
                graph[a].setdefault(b, module)
    return graph


def _cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _is_lower(node: str) -> bool:
    name = node.removeprefix("loom.")
    return name in LOWER or (node != "loom" and (ROOT / f"{name}.py").exists())


def test_no_import_cycle_between_packages() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    if cycle:
        links = [f"{a} -> {b} (in {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle: " + "; ".join(links))


def test_lower_layers_import_nothing_above_them() -> None:
    wrong = [f"{graph_node} imports {target} (in {module})"
             for graph_node, targets in _graph().items() if _is_lower(graph_node)
             for target, module in targets.items() if not _is_lower(target)]
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_a_cycle_and_an_upward_import() -> None:
    assert _cycle({"a": {"b": "a.x"}, "b": {"c": "b.y"}, "c": {"a": "c.z"}}) == ["a", "b", "c",
                                                                                    "a"]
    assert _cycle({"a": {"b": "a.x"}, "b": {}}) is None
    assert _is_lower("loom.core") and _is_lower("loom.config")
    assert not _is_lower("loom.engine") and not _is_lower("loom")
    assert _node("loom.core.scheduler") == "loom.core" and _node("loom.SamplingParams") == "loom"


@pytest.mark.slow
@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_module_imports_in_a_fresh_interpreter(order: str) -> None:
    """Every module, in a new interpreter, in two orders: a module that fails to import, or
    imports only after some other module was, fails here."""
    names = _modules() if order == "sorted" else _modules()[::-1]
    code = ("import importlib, sys, traceback\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as e:\n"
            "        print(f'{name}: {type(e).__name__}: {e}')\n")
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
