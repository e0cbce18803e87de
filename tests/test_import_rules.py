"""Who may import whom, read from the source (every import, function-level ones too; not those
under `if TYPE_CHECKING:`), so a rule breaks here and not in a slim container or a load test
that competes with the server for the CPU.

- serving/ and service.py are the runtime: no torch, transformers, pipeline, loadtest, bench or
  sample_inputs (the serving image has none of them).
- loadtest/ is a load tester for any HTTP endpoint: it may read sample_inputs, never the
  pipeline, the benchmarks or torch.
- sample_inputs/ is a leaf: nothing of the project, and only numpy and Pillow at import time.
- pipeline/ never imports loadtest or bench; bench sits on top and may import all.
- No import cycles between the project's modules.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("serving", "pipeline", "loadtest", "bench", "sample_inputs")
FORBIDDEN = {
    "serving": {"torch", "transformers", "pipeline", "loadtest", "bench", "sample_inputs"},
    "service": {"torch", "transformers", "pipeline", "loadtest", "bench", "sample_inputs"},
    "loadtest": {"torch", "transformers", "pipeline", "bench"},
    "sample_inputs": {"torch", "transformers", "serving", "pipeline", "loadtest", "bench"},
    "pipeline": {"loadtest", "bench"},
}
SAMPLE_INPUTS_AT_IMPORT = {"__future__", "io", "re", "functools", "numpy", "PIL"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_files() -> list[Path]:
    return [REPO / "service.py", *sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))]


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, *, top_level_only: bool = False) -> set[str]:
    """Fully qualified names a module imports (`from a import b` counts as both a and a.b)."""
    found: set[str] = set()
    package = module if (REPO / module.replace(".", "/")).is_dir() else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if top_level_only and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


@cache
def _graph() -> dict[str, set[str]]:
    return {
        _module_name(path): _imports(ast.parse(path.read_text(), str(path)), _module_name(path))
        for path in _project_files()
    }


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_it_must_not(layer: str) -> None:
    broken = {
        f"{module} imports {name}"
        for module, names in _graph().items()
        if module.split(".")[0] == layer
        for name in names
        if name.split(".")[0] in FORBIDDEN[layer]
    }
    assert not broken, "\n".join(sorted(broken))


def test_sample_inputs_import_only_numpy_and_pillow_at_import_time() -> None:
    path = REPO / "sample_inputs" / "__init__.py"
    names = _imports(ast.parse(path.read_text()), "sample_inputs", top_level_only=True)
    assert {name.split(".")[0] for name in names} <= SAMPLE_INPUTS_AT_IMPORT


def test_no_import_cycles_between_project_modules() -> None:
    graph = _graph()
    edges = {module: {name for name in names if name in graph and name != module} for module, names in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def walk(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append([*trail[trail.index(target) :], target])
            elif target not in state:
                walk(target, [*trail, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert not cycles, "\n".join(" → ".join(cycle) for cycle in cycles)


def test_the_rules_see_function_level_imports() -> None:
    """The checker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\ndef f():\n    import pipeline.x\n"
    assert _imports(ast.parse(source), "serving.m") == {"typing", "typing.TYPE_CHECKING", "pipeline.x"}
