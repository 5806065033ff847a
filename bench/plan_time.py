"""How long planning takes and how much memory it needs, by model depth.

For the docstring Llama (``plans/llama_docstring/model.py``) at hidden 4096 and 4, 16, 32 and 80
layers, each in a fresh process (so peak RSS is that run's own): load under ``LazyGuard``, trace,
graph, recognition (the analysis), cost + search, emit (``planner/driver.py``, as the CLI runs them); then, in
another fresh process, the time
``paddle.distributed.to_distributed`` takes to convert the same model as rank 0 of a 4-rank world
(its own tracing + matching + sharding; lazily built first, eagerly where that fails and fits).

Run: ``make bench`` or ``.venv/bin/python bench/plan_time.py [--layers 4 16] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "plans" / "llama_docstring" / "model.py"
SIZES = dict(HIDDEN_SIZE=4096, INTERMEDIATE_SIZE=11008, NUM_HEADS=32, VOCAB_SIZE=32000, SEQ_LENGTH=1024)
DEFAULT_LAYERS = (4, 16, 32, 80)
#: Skip an eager to_distributed run that would need more than this (fp32 parameters alone).
EAGER_LIMIT_BYTES = 6 * 10**9


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def plan_once(layers: int) -> dict:
    """One planning run, as the CLI runs it, timed stage by stage (runs inside the child process)."""
    from autodist.planner import driver
    from autodist.planner.cost.search import SearchRequest

    timer = StageTimer()
    cpu_start = time.process_time()
    start = time.perf_counter()
    made = driver.plan_target(str(MODEL), None, SearchRequest(devices_per_node=8), {"target": str(MODEL)}, timer)
    times = {
        "total": time.perf_counter() - start,
        # CPU seconds of this process: less sensitive than wall time to other work on the machine.
        "cpu": time.process_time() - cpu_start,
    }
    stage = dict(zip(driver.STAGES, timer.seconds))
    times.update(
        load=stage["load"],
        trace=stage["trace"],
        graph=stage["graph"],
        recognise=stage["analyse"],
        search=stage["cost"] + stage["search"],
        emit=stage["emit"],
    )
    return {
        "layers": layers,
        "ops": len(made.traced.ops),
        "nodes": made.analysis.graph.number_of_nodes(),
        "blocks": len(made.analysis.blocks),
        **times,
        "peak_rss_mb": peak_rss_mb(),
    }


class StageTimer:
    """A quiet :class:`autodist.planner.progress.Progress` that keeps each step's wall time, in order."""

    def __init__(self):
        self.seconds: list[float] = []

    @contextlib.contextmanager
    def step(self, what: str):
        start = time.perf_counter()
        yield
        self.seconds.append(time.perf_counter() - start)


def to_distributed_once(layers: int) -> dict:
    """to_distributed's conversion time for the same model, as rank 0 of 4 (inside the child)."""
    import numpy as np
    import paddle
    from paddle.distributed import to_distributed
    from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig

    sys.path.insert(0, str(MODEL.parent))
    import model as docstring

    config = docstring.LlamaConfig.from_env()

    class Tokens(paddle.io.Dataset):
        def __getitem__(self, i):
            return np.zeros([config.seq_length], "int64"), np.zeros([config.seq_length], "int64")

        def __len__(self):
            return 8

    dist_config = ToDistributedConfig()
    dist_config.input_spec = docstring.input_spec(config)
    outcome = "lazy"
    with paddle.LazyGuard():
        net = docstring.build_model(config)
    loader = paddle.io.DataLoader(Tokens(), batch_size=4)
    start = time.perf_counter()
    try:
        to_distributed(net, None, loader, device_num=4, node_num=1, config=dist_config)
    except Exception as lazy_error:  # noqa: BLE001 -- retry eagerly, where memory allows
        fp32_bytes = 4 * sum(int(np.prod(p.shape)) for p in net.parameters())
        if fp32_bytes > EAGER_LIMIT_BYTES:
            return {
                "layers": layers,
                "to_distributed_s": None,
                "to_distributed_note": f"lazy: {type(lazy_error).__name__}; eager needs {fp32_bytes / 1e9:.0f} GB",
            }
        outcome = "eager"
        net = docstring.build_model(config)
        start = time.perf_counter()
        to_distributed(net, None, loader, device_num=4, node_num=1, config=dist_config)
    return {
        "layers": layers,
        "to_distributed_s": time.perf_counter() - start,
        "to_distributed_note": outcome,
        "to_distributed_peak_rss_mb": peak_rss_mb(),
    }


def in_child(function: str, layers: int, timeout: int = 900) -> dict:
    env = {
        **os.environ,
        **{f"LLAMA_DOCSTRING_{k}": str(v) for k, v in SIZES.items()},
        "LLAMA_DOCSTRING_NUM_LAYERS": str(layers),
    }
    if function == "to_distributed_once":
        env.update(
            PADDLE_TRAINER_ID="0",
            PADDLE_TRAINERS_NUM="4",
            PADDLE_RANK_IN_NODE="0",
            PADDLE_LOCAL_SIZE="4",
            PADDLE_GLOBAL_SIZE="4",
            PADDLE_LOCAL_RANK="0",
            PADDLE_GLOBAL_RANK="0",
        )
    code = (
        f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import plan_time; "
        f"print(json.dumps(plan_time.{function}({layers})))"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "error": f"timed out after {timeout} s"}
    if done.returncode != 0:
        return {
            "layers": layers,
            "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
        }
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import paddle

    return (
        f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, paddle {paddle.__version__}"
    )


def markdown(rows: list[dict]) -> str:
    head = (
        "| layers | params | ops | graph nodes | load s | trace s | graph s | recognise s | search s | emit s "
        "| **total s** | CPU s | peak RSS MB | to_distributed s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['layers']} | error: {row['error']} |")
            continue
        td = row.get("to_distributed_s")
        td_text = (
            f"{td:.1f} ({row['to_distributed_note']})"
            if td is not None
            else row.get("to_distributed_note", row.get("to_distributed_error", "n/a"))
        )
        lines.append(
            f"| {row['layers']} | {row['params_b']:.1f} B | {row['ops']} | {row['nodes']} | {row['load']:.2f} | "
            f"{row['trace']:.2f} | {row['graph']:.2f} | {row['recognise']:.2f} | {row['search']:.2f} | {row['emit']:.2f} | "
            f"**{row['total']:.2f}** | {row['cpu']:.2f} | {row['peak_rss_mb']:.0f} | {td_text} |"
        )
    return "\n".join(lines)


def parameter_count(layers: int) -> float:
    h, i, v = SIZES["HIDDEN_SIZE"], SIZES["INTERMEDIATE_SIZE"], SIZES["VOCAB_SIZE"]
    return (layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--no-to-distributed", action="store_true", help="Skip the to_distributed comparison.")
    parser.add_argument("--markdown", action="store_true", help="Print a table for docs/benchmarks.md.")
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        row = in_child("plan_once", layers)
        if not args.no_to_distributed and "error" not in row:
            reference = in_child("to_distributed_once", layers)
            if "error" in reference:
                reference = {"to_distributed_s": None, "to_distributed_note": f"failed: {reference['error']}"}
            row.update({k: v for k, v in reference.items() if k != "layers"})
        row["params_b"] = parameter_count(layers)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    if args.markdown:
        print(f"Machine: {machine()}\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
