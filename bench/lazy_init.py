"""What initialising a lazily built model costs each rank: peak memory and ``apply_plan`` time,
built eagerly, under ``autodist.LazyGuard()`` (every parameter drawn whole, in creation order,
then sharded: the eager values) and under ``paddle.LazyGuard()``.

One 2-process job (mp2, gloo) per way of building, so each rank's peak RSS (``ru_maxrss``) is that
way's own. Each rank: seed, build, an AdamW over the parameters, ``apply_plan``; it reports its
RSS before the build, its peak after ``apply_plan``, the bytes its parameters hold and the time
``apply_plan`` took. Expected: lazily, the peak over the baseline is about the rank's shards
plus one whole parameter (the largest); eagerly, the whole model plus the shards.

Run: ``.venv/bin/python bench/lazy_init.py [--layers 8] [--hidden 1024] [--vocab 4000] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

from llama_bench import bench_main, load_model, model_config, parameter_count  # also puts tests/ on sys.path

RANKS = 2
BUILDS = ("eager", "autodist_lazy", "paddle_lazy")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(job_path: str) -> None:
    """One rank: build as the job says, apply the plan, write ``rank<R>.json``."""
    import warnings

    import paddle
    import paddle.distributed as dist

    import autodist
    from autodist.applier.apply import apply_plan
    from harness.memory import local_parameter_bytes

    job = json.loads(Path(job_path).read_text())
    model_module = load_model()
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    dist.init_parallel_env()
    dist.barrier()
    baseline = rss_mb()
    guard = {"eager": None, "autodist_lazy": autodist.LazyGuard, "paddle_lazy": paddle.LazyGuard}[job["build"]]
    paddle.seed(job["seed"])
    if guard is None:
        model = model_module.build_model(**job["config"])
    else:
        with guard():
            model = model_module.build_model(**job["config"])
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = apply_plan(model, optimizer, None, job["plan"])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result = {
        "rank": rank,
        "baseline_mb": baseline,
        "peak_mb": peak,
        "apply_s": seconds,
        "local_mb": local_parameter_bytes(model) / 2**20,
    }
    (Path(job["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))


def run(args) -> dict[str, list[dict]]:
    """Write the plan, run one job per way of building, return each rank's report."""
    import paddle

    from harness.launcher import launch_ranks
    from harness.plans import tensor_parallel_plan, write_plan

    config = model_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="lazy_init_"))
    with paddle.LazyGuard():  # only names and shapes are needed
        model = load_model().build_model(**config)
    plan = write_plan(tensor_parallel_plan(model, mp=2), workdir / "plan.json")
    results = {}
    for build in BUILDS:
        out = workdir / build
        out.mkdir()
        job = {"config": config, "plan": plan, "seed": 2024, "out_dir": str(out), "build": build}
        (out / "job.json").write_text(json.dumps(job))
        launch_ranks(
            RANKS, [__file__, "--worker", str(out / "job.json")], out, timeout_s=args.timeout
        ).raise_for_failure()
        results[build] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return results


def report(args, results: dict[str, list[dict]], markdown: bool) -> str:
    import paddle

    params = parameter_count(args)
    largest = max(args.vocab * args.hidden, 2 * args.hidden * args.hidden) * 4 / 2**20
    head = (
        f"docstring Llama, {args.layers} layers, hidden {args.hidden}, intermediate {2 * args.hidden}, vocabulary "
        f"{args.vocab} ({params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MB fp32; largest parameter "
        f"{largest:.0f} MB); mp2 on {RANKS} CPU processes (gloo); Paddle {paddle.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"
    )
    rows = [
        (build, r["rank"], r["local_mb"], r["peak_mb"] - r["baseline_mb"], r["apply_s"])
        for build, ranks in results.items()
        for r in ranks
    ]
    if markdown:
        lines = [
            head,
            "",
            "| build | rank | parameters held (MB) | peak RSS over baseline (MB) | apply_plan (s) |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {b} | {r} | {held:.0f} | {peak:.0f} | {s:.2f} |" for b, r, held, peak, s in rows]
    else:
        lines = [head] + [
            f"{b} rank {r}: holds {held:.0f} MB, peak +{peak:.0f} MB, apply_plan {s:.2f} s"
            for b, r, held, peak, s in rows
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main(__doc__, worker, run, report, layers=8, hidden=1024, vocab=4000, timeout=900)
