"""A latency per ring step that grows with the group: the fitted file's prices against its own
timings, and dp4's estimate against its measured step, with and without the growth.

Each run: the closed loop's (bench/closed_loop.py: examples/demo.py calibrates this machine on
the tiny docstring Llama's dp2 x mp2 plan and trains it; the same model planned for dp4 and mp4
with that cluster.toml and trained 6 steps on 4 ranks), kept in ``--out/run<N>``; then

- each all-reduce timing of the calibration against its price by the fitted link, with the
  growth (the file as written) and as one latency for every group size (the fit before it:
  ``fit_link`` on the same timings with every group's size hidden from the growth term);
- dp4 planned again with a cluster.toml whose link is that one-latency fit, to compare its
  estimate with the same measured dp4 step.

    python bench/latency_growth.py --runs 2 --out /tmp/latency_growth
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from closed_loop import HELD_OUT, one_run, run_quietly  # noqa: E402  (bench/ is no package)
from demo import plan_command  # noqa: E402  (closed_loop put examples/ on the path)

from autodist.planner.cost.calibrate import fit_link  # noqa: E402
from autodist.planner.cost.comm import Link, all_reduce_time  # noqa: E402


def collectives(text: str) -> dict:
    measured = tomllib.loads(text)["measured"]
    points = {}
    for key, timings in measured.items():
        found = re.fullmatch(r"(intra|inter)_(\w+)_(\d+)ranks", key)
        if found:
            points[(found[1], found[2], int(found[3]))] = [tuple(t) for t in timings]
    return points


def one_latency(points: dict) -> Link:
    """The fit calibrate made before: one latency per ring step for every group size."""
    fit = fit_link(points, "intra", growth=False)
    return Link(fit.bandwidth, fit.latency_s, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        workdir = args.out / f"run{run}"
        workdir.mkdir(parents=True, exist_ok=True)
        cells = one_run(workdir)
        text = (workdir / "cluster.toml").read_text()
        points = collectives(text)
        grown = fit_link(points, "intra")
        with_growth = Link(grown.bandwidth, grown.latency_s, grown.latency_per_rank_s or 0.0)
        flat = one_latency(points)
        print(f"## run {run}: {workdir}")
        print(f"demo dp2 x mp2, dp4, mp4 (measured / estimate): {' | '.join(cells)}")
        print(
            f"fit: {grown.latency_s * 1e6:.0f} us + {(grown.latency_per_rank_s or 0) * 1e6:.0f} us per rank "
            f"beyond two, {grown.bandwidth / 1e9:.2f} GB/s; one latency: {flat.latency_s * 1e6:.0f} us, "
            f"{flat.bandwidth / 1e9:.2f} GB/s"
        )
        print("| all-reduce | ranks | measured | priced with growth | priced with one latency |")
        print("|---|---|---|---|---|")
        for (scope, name, p), timings in sorted(points.items()):
            if scope == "intra" and name == "all_reduce":
                for nbytes, seconds in sorted(set(timings)):
                    print(
                        f"| {nbytes} B | {p} | {seconds * 1e3:.2f} ms | {all_reduce_time(nbytes, p, with_growth) * 1e3:.2f} ms "
                        f"| {all_reduce_time(nbytes, p, flat) * 1e3:.2f} ms |"
                    )
        # dp4 priced with the one-latency link instead: the estimate the previous fit gave.
        old = text.split("\n[measured]")[0] + "\n"
        old = re.sub(r"(?m)^intra_node_latency_per_rank_us = .*\n", "", old)
        old = re.sub(r"(?m)^intra_node_latency_us = .*$", f"intra_node_latency_us = {flat.latency_s * 1e6:.6f}", old)
        old = re.sub(
            r"(?m)^intra_node_bandwidth_gb_s = .*$", f"intra_node_bandwidth_gb_s = {flat.bandwidth / 1e9:.6f}", old
        )
        (workdir / "cluster_one_latency.toml").write_text(old)
        plan = workdir / "plan_dp4_one_latency.json"
        run_quietly(
            [*plan_command(plan, HELD_OUT["dp4"]), "--cluster", str(workdir / "cluster_one_latency.toml"), "--quiet"]
        )
        measured = json.loads((workdir / "dp4.json").read_text())["step_time_s"]
        for label, path in (("with growth", workdir / "plan_dp4.json"), ("one latency", plan)):
            estimate = json.loads(path.read_text())["estimate"]["step_time_s"]
            print(
                f"dp4 {label}: measured {measured * 1e3:.1f} ms / estimate {estimate * 1e3:.1f} ms = {measured / estimate:.2f}"
            )


if __name__ == "__main__":
    main()
