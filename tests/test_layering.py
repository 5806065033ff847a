"""Imports point one way: the layers drawn in docs/internals.md ("Layers"), read from the source.

Every ``import`` of an ``autodist`` module is an arrow, wherever it is written (module level,
inside a function, under ``TYPE_CHECKING``). A package may import its own modules and the layers
below it, never a layer above or a package beside it on its own layer; and no module reaches
itself again through any chain of imports. A new top-level module or package of the planner
must be given its layer here (and in the drawing).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The checkout's folders and the packages they install as (pyproject.toml, package-dir).
FOLDERS = {"schemas": "autodist.schemas", "applier": "autodist.applier", "planner": "autodist.planner",
           "autodist": "autodist"}  # fmt: skip

#: Bottom first. Each entry is a layer: the units on it, which do not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("schemas",),  # the plan format and its words (placements, dtypes, strategy text, the MoE rule)
    ("applier",),  # apply_plan and checkpoints on every rank: the plan format alone
    # the planner's words, and what it keeps off the screen (quiet)
    # and the child processes that contain Paddle's crashes (contained)
    (
        "planner",
        "planner.errors",
        "planner.progress",
        "planner.ops",
        "planner.dense_selection",
        "planner.quiet",
        "planner.contained",
    ),
    ("planner.kernels",),  # the fused kernels a model selects, and which ones a plan prices
    ("planner.trace", "planner.load"),  # tracing the forward, loading the user's model
    ("planner.graph",),  # the traced program as a graph
    ("planner.recognise",),  # blocks, roles, experts, SPMD rules on the graph
    ("planner.cost",),  # pricing and searching strategies
    (
        "planner.emit",
        "planner.local_view_proof",
    ),  # the plan from the analysis and the chosen strategy; local views proven
    ("planner.driver",),  # the stages in order: load, trace, analyse, search, emit
    ("planner.review",),  # show, diff, check, export, render, explain: read plans, re-run stages
    ("planner.cli",),  # autodist-plan
    (
        "autodist",
        "autodist.integrations",
        "autodist.run",
    ),  # the public API (lazy), framework integrations, autodist-run
]

#: Units that are a package's ``__init__`` alone: the modules under them have layers of their own.
WHOLE_PACKAGE_ONLY = frozenset({"autodist", "planner"})


def module_files(root: Path) -> dict[str, Path]:
    """``{module name as installed: file}`` for the three packages and ``autodist`` under ``root``."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def import_arrows(root: Path) -> dict[str, set[str]]:
    """``{module: the autodist modules it imports}``: every import statement, at any depth."""
    files = module_files(root)
    arrows: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name not in files and "." in name:
                    name = name.rpartition(".")[0]
                if name in files and name != module:
                    targets.add(name)
        arrows[module] = targets
    return arrows


def unit_of(module: str) -> str:
    """The layering's unit a module belongs to: a planner package or top-level module, or a package."""
    full = {unit: unit if unit.startswith("autodist") else f"autodist.{unit}" for layer in LAYERS for unit in layer}
    for unit in sorted(full, key=lambda u: len(full[u]), reverse=True):  # the most specific unit
        inside = unit not in WHOLE_PACKAGE_ONLY and module.startswith(full[unit] + ".")
        if module == full[unit] or inside:
            return unit
    return module


def layer_problems(arrows: dict[str, set[str]]) -> list[str]:
    """Arrows that point up or sideways between units, and units with no layer."""
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    problems = []
    for module, targets in sorted(arrows.items()):
        source = unit_of(module)
        if source not in rank:
            problems.append(f"{module}: {source} has no layer (tests/test_layering.py LAYERS, docs/internals.md)")
            continue
        for target in sorted(targets):
            to = unit_of(target)
            if to == source or to not in rank:
                continue
            if rank[to] > rank[source]:
                problems.append(f"{module} imports {target}: {source} is below {to}")
            elif rank[to] == rank[source]:
                problems.append(f"{module} imports {target}: {source} and {to} are on one layer")
    return problems


def loops(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that reach each other through their imports (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(arrows.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def test_every_import_points_down_the_layers():
    assert layer_problems(import_arrows(ROOT)) == []


def test_no_module_imports_itself_back_through_others():
    assert loops(import_arrows(ROOT)) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_reversed_arrow_and_a_loop_are_caught(tmp_path):
    """The checks on a small tree written for them: the cost model importing the review
    package (as cost/search.py did, for strategy_text), and two modules importing each other,
    one of them only for types (as recognise/spmd.py and analysis.py did)."""
    root = _tree(
        tmp_path,
        {
            "autodist/__init__.py": "",
            "schemas/__init__.py": "",
            "applier/__init__.py": "from autodist.schemas import Plan\n",
            "planner/__init__.py": "",
            "planner/cost/__init__.py": "",
            "planner/cost/search.py": "def f():\n    from autodist.planner.review.format import strategy_text\n",
            "planner/review/__init__.py": "",
            "planner/review/format.py": "from autodist.planner.cost import search\n",
            "planner/recognise/__init__.py": "",
            "planner/recognise/a.py": "from autodist.planner.recognise.b import B\n",
            "planner/recognise/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autodist.planner.recognise.a import A\n"
            ),
        },
    )
    arrows = import_arrows(root)
    assert layer_problems(arrows) == [
        "autodist.planner.cost.search imports autodist.planner.review.format: planner.cost is below planner.review"
    ]
    assert loops(arrows) == [
        ["autodist.planner.cost.search", "autodist.planner.review.format"],
        ["autodist.planner.recognise.a", "autodist.planner.recognise.b"],
    ]


@pytest.mark.parametrize(
    "statement, target",
    [
        ("import autodist.applier.apply\n", "autodist.applier.apply"),
        ("from autodist.applier import apply\n", "autodist.applier.apply"),
        ("from autodist.applier import apply_plan\n", "autodist.applier"),
        ("from autodist import applier\n", "autodist.applier"),
    ],
)
def test_every_spelling_of_an_import_is_an_arrow(tmp_path, statement, target):
    root = _tree(
        tmp_path,
        {
            "autodist/__init__.py": "",
            "schemas/__init__.py": statement,
            "applier/__init__.py": "",
            "applier/apply.py": "",
            "planner/__init__.py": "",
        },
    )
    assert import_arrows(root)["autodist.schemas"] == {target}
    assert layer_problems(import_arrows(root)) == [f"autodist.schemas imports {target}: schemas is below applier"]
