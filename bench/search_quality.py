"""Search quality: does the planner pick the strategy that measures fastest here, on three shapes?

On this machine, with 4 gloo ranks, the docstring Llama of ``examples/demo.py`` at three shapes
(:data:`SHAPES`): ``mp`` (wide and few tokens: 2 layers, hidden 512, batch 4 x 16), ``mixed``
(4 layers, hidden 256, batch 8 x 64) and ``dp`` (narrow and many tokens: hidden 64, batch 32 x 64).
For each shape:

1. calibrate: plan dp2 x mp2 (``--device cpu``), then ``autodist-plan calibrate --model`` on that
   plan (matmuls, collectives, real training steps) -> ``cluster.toml``;
2. plan with that cluster file and no degree fixed (the demo's CPU limits: no sequence
   parallelism, no ZeRO, fp32); take the chosen strategy and the next best *distinct* meshes the
   search accepted (its ``alternatives``), each re-planned with its degrees fixed so it has a plan
   file of its own (the same estimate, asserted);
3. train each plan ``--steps`` steps on 4 ranks (``examples/train.py``: the median step, the first
   left out), the plans *alternating*, ``--rounds`` times, so the machine's load drifts over all
   of them alike;
4. report per plan estimate and measurements, the **regret** (measured step of the chosen plan /
   the fastest measured) and whether the estimates rank the top two plans in the measured order,
   by each plan's fastest round (the one the machine's other load disturbed least) and by its median.

Nothing asserts on it. ``python bench/search_quality.py --rounds 5`` (``--shape mixed`` for one;
``make bench`` runs a short version). The machine's other load is printed with each table: on a
shared machine the measurements are noisy, and a regret above 1 within that noise says little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))
from closed_loop import run_quietly  # noqa: E402  (bench/ and examples/ are no packages)
from demo import MODEL, TINY, TRAIN, launch_command, plan_command  # noqa: E402

#: ``name: (the model's sizes, the global batch)``; the sequence length is among the sizes.
SHAPES: dict[str, tuple[dict[str, int], int]] = {
    "mp": ({**TINY, "NUM_LAYERS": 2, "HIDDEN_SIZE": 512, "INTERMEDIATE_SIZE": 1024, "SEQ_LENGTH": 16}, 4),
    "mixed": ({**TINY, "NUM_LAYERS": 4, "HIDDEN_SIZE": 256, "INTERMEDIATE_SIZE": 512, "SEQ_LENGTH": 64}, 8),
    "dp": ({**TINY, "NUM_LAYERS": 4, "HIDDEN_SIZE": 64, "INTERMEDIATE_SIZE": 128, "SEQ_LENGTH": 64}, 32),
}


def calibrate(workdir: Path, shape: str) -> Path:
    """Step 1: a dp2 x mp2 plan on the cpu profile, and the cluster.toml calibrated on it."""
    first, cluster = workdir / "plan_calibrate.json", workdir / "cluster.toml"
    sizes = SHAPES[shape][0]
    run_quietly([*planned(first, shape, ["--dp", "2", "--mp", "2"]), "--device", "cpu"], sizes)
    autodist_plan = str(Path(sys.executable).parent / "autodist-plan")
    run_quietly(
        launch_command(
            workdir / "calibrate_logs",
            autodist_plan,
            "calibrate",
            "--plan",
            str(first),
            "--model",
            MODEL,
            "-o",
            str(cluster),
        ),
        sizes,
    )
    return cluster


def planned(plan: Path, shape: str, degrees: list[str]) -> list[str]:
    """The demo's planner command for ``shape``: its global batch, the ``degrees`` fixed, quiet."""
    return [*plan_command(plan, [*degrees, "--global-batch-size", str(SHAPES[shape][1])]), "--quiet"]


def degrees(strategy: dict) -> list[str]:
    """The planner options that fix ``strategy`` (a plan's ``strategy`` table)."""
    fixed = ["--dp", str(strategy["dp"]), "--mp", str(strategy["mp"]), "--pp", str(strategy["pp"])]
    fixed += ["--micro-batches", str(strategy["micro_batches"])]
    if strategy["pp"] > 1:
        fixed += ["--schedule", strategy["schedule"]]
    return fixed


def contenders(workdir: Path, shape: str, cluster: Path, alternatives: int) -> list[tuple[str, Path, float]]:
    """Step 2: ``(name, plan file, estimated step)`` for the chosen strategy and the next best
    distinct meshes the search accepted, best first."""
    chosen = workdir / "plan_chosen.json"
    run_quietly([*planned(chosen, shape, []), "--cluster", str(cluster)], SHAPES[shape][0])
    plan = json.loads(chosen.read_text())
    candidates = [{"strategy": plan["strategy"], "estimate": plan["estimate"]}, *plan["alternatives"]["accepted"]]
    found, meshes = [], set()
    for candidate in candidates:
        strategy = candidate["strategy"]
        mesh = (strategy["dp"], strategy["mp"], strategy["pp"])
        if mesh in meshes:
            continue
        meshes.add(mesh)
        name = "dp{} mp{} pp{}".format(*mesh)
        path = chosen if not found else workdir / f"plan_{len(found)}.json"
        if found:
            run_quietly([*planned(path, shape, degrees(strategy)), "--cluster", str(cluster)], SHAPES[shape][0])
        estimate = json.loads(path.read_text())["estimate"]["step_time_s"]
        expected = candidate["estimate"]["step_time_s"]
        assert abs(estimate - expected) <= 1e-9 * max(expected, 1e-12), (name, estimate, expected)
        found.append((name, path, estimate))
        if len(found) > alternatives:
            break
    return found


def measure(
    workdir: Path, shape: str, plans: list[tuple[str, Path, float]], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Step 3: every plan trained ``steps`` steps per round, the plans alternating."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in plans}
    for round_ in range(rounds):
        for index, (name, path, _) in enumerate(plans):
            record = workdir / f"run_{round_}_{index}.json"
            run_quietly(
                launch_command(
                    workdir / f"logs_{round_}_{index}",
                    TRAIN,
                    "--model",
                    MODEL,
                    "--plan",
                    str(path),
                    "--steps",
                    str(steps),
                    "--losses-out",
                    str(record),
                ),
                SHAPES[shape][0],
            )
            times[name].append(json.loads(record.read_text())["step_time_s"])
    return times


def report(plans: list[tuple[str, Path, float]], times: dict[str, list[float]], load: tuple[float, float]) -> None:
    """Step 4: the table, the regret and whether the orders agree (markdown), by each plan's
    fastest round (the least disturbed by the machine's other load) and by its median."""
    print(
        "| rank by estimate | strategy | estimate (ms) | rounds (ms) | fastest round (ms) | median (ms) "
        "| fastest / estimate |"
    )
    print("|---|---|---|---|---|---|---|")
    for rank, (name, _, estimate) in enumerate(plans, 1):
        rounds, fastest = times[name], min(times[name])
        cells = [str(rank), name, f"{estimate * 1e3:.1f}", ", ".join(f"{t * 1e3:.1f}" for t in rounds)]
        cells += [f"{fastest * 1e3:.1f}", f"{statistics.median(rounds) * 1e3:.1f}", f"{fastest / estimate:.2f}"]
        print("| " + " | ".join(cells) + " |")
    by_estimate = [name for name, _, _ in plans]
    for label, pick in (("fastest round", min), ("median of rounds", statistics.median)):
        measured = {name: pick(values) for name, values in times.items()}
        best = min(measured, key=measured.__getitem__)
        by_measurement = sorted(measured, key=measured.__getitem__)
        top_two_agree = len(by_estimate) < 2 or measured[by_estimate[0]] <= measured[by_estimate[1]]
        print(
            f"\nby {label}: regret (measured chosen / measured best) "
            f"{measured[by_estimate[0]] / measured[best]:.2f} (chosen {by_estimate[0]}, fastest {best}); "
            f"top two in the measured order: {'yes' if top_two_agree else 'no'}; "
            f"whole order: {'yes' if by_estimate == by_measurement else 'no'} (measured: {', '.join(by_measurement)})"
        )
    print(f"\nload average {load[0]:.1f} before, {load[1]:.1f} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alternatives", type=int, default=2, help="distinct runners-up to measure")
    parser.add_argument("--rounds", type=int, default=3, help="times each plan is trained, alternating")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first not timed)")
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="one shape (repeatable; default all)")
    parser.add_argument("--workdir", help="keep the files here, one folder per shape (default: a temporary folder)")
    args = parser.parse_args()
    for shape in args.shape or SHAPES:
        sizes, batch = SHAPES[shape]
        print(
            f"\n### {shape}: {sizes['NUM_LAYERS']} layers, hidden {sizes['HIDDEN_SIZE']}, batch {batch} x {sizes['SEQ_LENGTH']}\n"
        )
        before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="autodist-search-quality-") as folder:
            workdir = Path(args.workdir or folder) / shape
            workdir.mkdir(parents=True, exist_ok=True)
            cluster = calibrate(workdir, shape)
            plans = contenders(workdir, shape, cluster, args.alternatives)
            times = measure(workdir, shape, plans, args.rounds, args.steps)
        report(plans, times, (before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
