"""The closed loop: the plan's estimate against the measured step, also for plans the fit never saw.

Each run: ``examples/demo.py`` into a fresh folder (it plans the tiny docstring Llama for dp2 x
mp2, calibrates this machine with ``autodist-plan calibrate --model`` on that plan, and trains it,
recording measured and estimated step time), then, priced with that run's ``cluster.toml``, the
same model planned for dp4 and for mp4, each trained 6 steps on 4 ranks with
``examples/train.py`` (median step, first left out). One markdown row per run: measured /
estimate for the three plans. The dp2 x mp2 column is the plan the calibration was fitted on;
dp4 and mp4 are the prediction. The table in docs/benchmarks.md ("Closed loop") comes from here.

    python bench/closed_loop.py --runs 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from demo import MODEL, TRAIN, environment, launch_command, plan_command  # noqa: E402  (examples/ is no package)

HELD_OUT = {"dp4": ["--dp", "4", "--mp", "1"], "mp4": ["--dp", "1", "--mp", "4"]}
TIMEOUT_S = 600


def run_quietly(command: list[str], sizes: dict[str, int] | None = None) -> None:
    """Run ``command`` from the repository root with the demo's environment (the model at
    ``sizes``, default the demo's), output discarded; raise on failure."""
    subprocess.run(
        command,
        cwd=REPO,
        env=environment(sizes),
        check=True,
        timeout=TIMEOUT_S,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _ratio(record_file: Path) -> str:
    record = json.loads(record_file.read_text())
    measured, estimated = record["step_time_s"], record["estimate_step_time_s"]
    return f"{measured * 1e3:.1f} / {estimated * 1e3:.1f} ms = **{measured / estimated:.2f}**"


def one_run(workdir: Path) -> list[str]:
    """The demo, then the held-out plans priced with its cluster.toml: the row's cells."""
    python = sys.executable
    run_quietly([python, "examples/demo.py", str(workdir)])
    cells = [_ratio(workdir / "distributed.json")]
    for name, degrees in HELD_OUT.items():
        plan = workdir / f"plan_{name}.json"
        run_quietly([*plan_command(plan, degrees), "--cluster", str(workdir / "cluster.toml"), "--quiet"])
        run_quietly(
            launch_command(
                str(workdir / f"logs_{name}"),
                TRAIN,
                "--model",
                MODEL,
                "--plan",
                str(plan),
                "--steps",
                "6",
                "--losses-out",
                str(workdir / f"{name}.json"),
            )
        )
        cells.append(_ratio(workdir / f"{name}.json"))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| run | load avg | demo dp2 x mp2 (fitted on) | dp4 (held out) | mp4 (held out) |")
    print("|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="autodist-closed-loop-") as folder:
            cells = one_run(Path(folder))
        print(f"| {run} | {load:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
