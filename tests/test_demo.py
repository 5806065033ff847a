"""`make demo` works: plan, review, 4 CPU ranks with apply_plan, losses equal to one device."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_losses_match_one_device(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"demo failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = run.stdout
    # the review step printed the plan summary, with the mesh of 4 ranks
    assert "strategy  dp2 · mp2 · pp1" in out and "placements" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\S+)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    for _, single, distributed, _ in rows:
        assert float(distributed) == pytest.approx(float(single), rel=1e-5)
    assert "losses are the same" in out
    assert (tmp_path / "plan.json").exists() and (tmp_path / "distributed.json").exists()
