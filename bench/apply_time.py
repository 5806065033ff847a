"""Per-rank time of ``apply_plan`` versus ``paddle.distributed.to_distributed``: same model,
same mesh (dp2 x mp2 on 4 ranks, the mesh to_distributed picks for 4 devices), in one run.

Each rank, after a barrier so neither pays for creating the communicator: builds the docstring
Llama from a seed and times ``apply_plan`` (model, optimizer and loader, with a dp2 x mp2
tensor-parallel plan) ``--repeats`` times, each on a fresh model; then times ``to_distributed``
on a fresh model. Imports are done before timing for both. The ratio is per rank:
best apply_plan time / to_distributed time (target <= 5 %). Where apply_plan's time goes is
timed by phase (the functions apply_plan calls, wrapped in this process only): ``agree`` is the
meeting of the ranks, so it holds the wait for the slowest rank; the rank that waited least
(the last to arrive) shows apply_plan's own cost. ``settle`` is their second meeting, once each
rank applied the plan (applier/ranks/agree.py), so it holds the wait for the slowest to shard.

Run: ``make bench`` or ``.venv/bin/python bench/apply_time.py [--layers 4] [--hidden 256] [--seed-apart] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

from llama_bench import bench_main, load_model, model_config, parameter_count  # also puts tests/ on sys.path

RANKS = 4
#: apply_plan's phases: the functions it calls (autodist.applier.apply's names), by phase.
PHASES = {
    "load and check the plan": ("load_plan", "plan_problems", "lacking", "dump_plan", "digest"),
    "model digest": ("parameter_table", "parameter_fingerprint"),
    "agree (waits for the other ranks)": ("agree",),
    "settle (waits for the other ranks)": ("Agreement.settle",),
    "shard parameters": ("shard_parameters", "dropped_parameters"),
    "hooks and recompute": ("register_hooks", "wrap_recompute"),
    "optimizer": ("rebuild_optimizer", "shard_optimizer"),
    "loader": ("shard_loader",),
    "copy rank 0's model and random state": ("equalise_dense", "equalise_random"),
    "readable outputs": ("make_outputs_readable",),
}


def time_phases(module) -> dict[str, float]:
    """Wrap ``module``'s phase functions so each call adds its seconds to the returned dict."""
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(phase, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        return run

    for phase, names in PHASES.items():
        for name in names:
            owner, _, attribute = name.rpartition(".")  # "Class.method": wrapped on the class
            target = getattr(module, owner) if owner else module
            setattr(target, attribute, timed(phase, getattr(target, attribute)))
    return spent


def worker(job_path: str) -> None:
    """One rank: time both methods on fresh models, write ``rank<R>.json``."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig
    from paddle.distributed.auto_parallel.static.tuner import to_distributed_api_patterns  # noqa: F401 (import before timing)

    import autodist.applier.apply as apply_module
    from autodist.applier.apply import apply_plan
    from harness.workloads import BATCH, TokenDataset

    job = json.loads(Path(job_path).read_text())
    model_module = load_model()
    rank = int(os.environ["PADDLE_TRAINER_ID"])

    def fresh():
        paddle.seed(job["seed"] + (rank if job["seed_apart"] else 0))
        model = model_module.build_model(**job["config"])
        optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        dataset = TokenDataset(job["config"]["vocab_size"], 2 * BATCH, job["seed"], seq=job["config"]["seq_length"])
        loader = paddle.io.DataLoader(
            dataset, batch_sampler=paddle.io.BatchSampler(dataset, batch_size=BATCH, drop_last=True)
        )
        return model, optimizer, loader

    dist.init_parallel_env()
    dist.barrier()  # the global communicator exists before anything is timed
    apply_times, phases = [], []
    spent = time_phases(apply_module)
    for _ in range(job["repeats"]):
        model, optimizer, loader = fresh()
        spent.update(dict.fromkeys(spent, 0.0))
        start = time.perf_counter()
        apply_plan(model, optimizer, loader, job["plan"])
        apply_times.append(time.perf_counter() - start)
        phases.append(dict(spent))
        dist.barrier()
    model, optimizer, loader = fresh()
    config = ToDistributedConfig()
    config.input_spec = [paddle.static.InputSpec([BATCH, job["config"]["seq_length"]], "int64", "input_ids")]
    start = time.perf_counter()
    dist.to_distributed(model, optimizer, loader, device_num=RANKS, node_num=1, config=config)
    to_distributed_time = time.perf_counter() - start
    best = min(range(len(apply_times)), key=apply_times.__getitem__)
    result = {
        "rank": rank,
        "apply_plan": apply_times,
        "to_distributed": to_distributed_time,
        "phases": phases[best],
    }
    (Path(job["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))


def run(args) -> list[dict]:
    """Write the plan, start 4 ranks, return each rank's timings."""
    from harness.launcher import launch_ranks
    from harness.plans import tensor_parallel_plan, write_plan

    config = model_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="apply_time_"))
    model = load_model().build_model(**config)
    plan = write_plan(tensor_parallel_plan(model, dp=2, mp=2), workdir / "plan.json")
    job = {"config": config, "plan": plan, "repeats": args.repeats, "seed": 2024, "out_dir": str(workdir)}
    job["seed_apart"] = args.seed_apart
    (workdir / "job.json").write_text(json.dumps(job))
    result = launch_ranks(RANKS, [__file__, "--worker", str(workdir / "job.json")], workdir, timeout_s=args.timeout)
    result.raise_for_failure()
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(RANKS)]


def report(args, ranks: list[dict], markdown: bool) -> str:
    import paddle

    params = parameter_count(args)
    head = (
        f"docstring Llama, {args.layers} layers, hidden {args.hidden}, intermediate {2 * args.hidden}, "
        f"{args.heads} heads, vocabulary {args.vocab}, sequence {args.seq} ({params / 1e6:.1f} M parameters); "
        f"dp2 x mp2 on {RANKS} CPU processes (gloo), ranks seeded {'apart' if args.seed_apart else 'alike'}; "
        f"apply_plan best of {args.repeats}; "
        f"Paddle {paddle.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()})"
    )
    rows = [
        (r["rank"], min(r["apply_plan"]), r["to_distributed"], min(r["apply_plan"]) / r["to_distributed"])
        for r in ranks
    ]
    if markdown:
        lines = [head, "", "| rank | apply_plan (s) | to_distributed (s) | ratio |", "|---|---|---|---|"]
        lines += [f"| {rank} | {ap:.4f} | {td:.3f} | {ratio:.1%} |" for rank, ap, td, ratio in rows]
    else:
        lines = [head] + [
            f"rank {rank}: apply_plan {ap:.4f} s, to_distributed {td:.3f} s, ratio {ratio:.1%}"
            for rank, ap, td, ratio in rows
        ]
    worst = max(ratio for *_, ratio in rows)
    lines.append(f"\nworst rank: apply_plan takes {worst:.1%} of to_distributed's time (target <= 5 %)")
    agree = "agree (waits for the other ranks)"
    least = min(ranks, key=lambda r: r["phases"][agree])
    own = min(least["apply_plan"])
    lines.append(
        f"the rank that waited least (rank {least['rank']}, {least['phases'][agree] * 1e3:.1f} ms in agree): "
        f"apply_plan {own:.4f} s, {own / least['to_distributed']:.1%} of its to_distributed"
    )
    phases = [(phase, [r["phases"][phase] for r in ranks]) for phase in PHASES]
    phases.append(("the rest of apply_plan", [min(r["apply_plan"]) - sum(r["phases"].values()) for r in ranks]))
    if markdown:
        lines += ["", "| phase (ms, best repeat) | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |"]
        lines.append("|---|" + "---|" * len(ranks))
        lines += [f"| {phase} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " |" for phase, times in phases]
    else:
        lines += [f"{phase}: " + ", ".join(f"{t * 1e3:.1f} ms" for t in times) for phase, times in phases]
    return "\n".join(lines)


if __name__ == "__main__":
    apart = "seed each rank 2024 + rank (as a script seeding its dropout does): rank 0's model is copied"
    bench_main(
        __doc__, worker, run, report, layers=4, hidden=256, vocab=1000, timeout=600, switches={"--seed-apart": apart}
    )
