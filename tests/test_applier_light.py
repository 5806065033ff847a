"""The run-time applier stays light: importing it loads no networkx, no click, no planner.

Each check runs in a fresh interpreter, since this test session has long imported them all."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("networkx", "click", "autodist.planner")


def modules_after(code: str) -> set[str]:
    """Top-level and ``autodist.*`` module names loaded by ``code`` in a fresh interpreter."""
    script = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)}


def test_importing_the_applier_loads_nothing_heavy():
    modules = modules_after("import autodist.applier")
    assert heavy(modules) == set()
    assert "paddle" not in modules  # Paddle comes with the first use of apply_plan


def test_apply_plan_itself_adds_nothing_heavy_to_what_paddle_loads():
    """Paddle 3.3.1 imports click on its own (through httpx, when click is installed), so the
    applier is held to: whatever it loads beyond ``import paddle`` has none of the heavy ones."""
    with_paddle = modules_after("import paddle")
    with_applier = modules_after("import paddle\nfrom autodist.applier import apply_plan")
    assert heavy(with_applier - with_paddle) == set()
    assert "networkx" not in with_applier and "autodist.planner" not in with_applier
