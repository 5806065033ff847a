"""Save and load time of autodist checkpoints against plain ``paddle.save``/``paddle.load`` of the
same model and AdamW optimizer, and, on 2 ranks, against Paddle's ``dist.save_state_dict`` /
``dist.load_state_dict``.

Two jobs, each on the docstring Llama after one AdamW step (so the moments exist):

* one process: ``paddle.save`` of ``model.state_dict()`` and ``optimizer.state_dict()`` versus
  ``save_checkpoint``; ``paddle.load`` + ``set_state_dict`` versus ``load_checkpoint`` into a
  freshly built model and optimizer;
* 2 gloo ranks under an mp2 plan: per rank, ``save_checkpoint`` versus ``dist.save_state_dict``;
  ``load_checkpoint`` under the same mp2 plan and under a dp2 plan (re-planned) versus
  ``dist.load_state_dict`` (same placements; into other placements it needs a GPU, see
  docs/paddle-notes.md, Checkpoints).

Each figure is the best of ``--repeats``; files go to a fresh temp folder (page cache warm for
both methods alike). Run: ``make bench`` or ``.venv/bin/python bench/checkpoint_time.py
[--layers 8] [--hidden 512] [--vocab 4000] [--markdown]``; the figures go to docs/benchmarks.md
by hand, with the machine they came from.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from llama_bench import bench_main, load_model, model_config, parameter_count  # also puts tests/ on sys.path

RANKS = 2


def worker(job_path: str) -> None:
    """One rank of either job: time every method, write ``<job>.rank<R>.json``."""
    import paddle
    import paddle.distributed as dist

    from autodist import apply_plan, load_checkpoint, save_checkpoint

    job = json.loads(Path(job_path).read_text())
    rank, world = int(os.environ.get("PADDLE_TRAINER_ID", 0)), int(os.environ.get("PADDLE_TRAINERS_NUM", 1))
    work = Path(job["out_dir"]) / f"files{world}"

    def fresh(plan=None, step=False):
        """A model and AdamW optimizer, distributed by ``plan``; after one step when ``step``.
        Built with fresh unique names, as a new process would: Paddle's own state dicts are
        keyed by those names (``linear_0.w_0``), so another build's would not match."""
        with paddle.utils.unique_name.guard():
            return _fresh(plan, step)

    def _fresh(plan, step):
        from harness.workloads import BATCH, TokenDataset

        paddle.seed(job["seed"])
        model = load_model().build_model(**job["config"])
        optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.01)
        dataset = TokenDataset(job["config"]["vocab_size"], BATCH, job["seed"], seq=job["config"]["seq_length"])
        loader = paddle.io.DataLoader(dataset, batch_sampler=paddle.io.BatchSampler(dataset, batch_size=BATCH))
        if plan is not None:
            model, optimizer, loader = apply_plan(model, optimizer, loader, plan)
        if step:
            input_ids, labels = next(iter(loader))
            model(input_ids, labels=labels)[0].backward()
            optimizer.step()
            optimizer.clear_grad()
        return model, optimizer

    def best(prepare, action) -> float:
        """Best of the repeats of ``action(prepared)``, timed after a barrier on every rank."""
        times = []
        for i in range(job["repeats"]):
            prepared = prepare(i)
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            action(prepared)
            times.append(time.perf_counter() - start)
        return min(times)

    result = {"rank": rank}
    if world == 1:
        model, optimizer = fresh(step=True)
        plain, ours = work / "plain", work / "autodist"
        plain.mkdir(parents=True, exist_ok=True)

        def plain_save(_):
            paddle.save(model.state_dict(), str(plain / "model.pdparams"))
            paddle.save(optimizer.state_dict(), str(plain / "model.pdopt"))

        def plain_load(target):
            target[0].set_state_dict(paddle.load(str(plain / "model.pdparams")))
            target[1].set_state_dict(paddle.load(str(plain / "model.pdopt")))

        result["paddle.save"] = best(lambda i: None, plain_save)
        result["save_checkpoint"] = best(lambda i: None, lambda _: save_checkpoint(model, optimizer, ours, step=1))
        result["paddle.load"] = best(lambda i: fresh(), plain_load)
        result["load_checkpoint"] = best(lambda i: fresh(), lambda t: load_checkpoint(t[0], t[1], ours))
        result["bytes"] = _folder_bytes(ours)
    else:
        dist.init_parallel_env()
        model, optimizer = fresh(job["plan_mp2"], step=True)
        ours, paddles = work / "autodist", work / "paddle"

        def paddle_state(target):
            state = dict(target[0].state_dict())
            state.update({k: v for k, v in target[1].state_dict().items() if isinstance(v, paddle.Tensor)})
            return state

        def paddle_save(i):
            if rank == 0:
                shutil.rmtree(paddles, ignore_errors=True)
            dist.barrier()
            return paddle_state((model, optimizer))

        result["save_checkpoint"] = best(lambda i: None, lambda _: save_checkpoint(model, optimizer, ours, step=1))
        result["dist.save_state_dict"] = _or_failure(
            lambda: best(paddle_save, lambda s: dist.save_state_dict(s, str(paddles)))
        )
        result["load_checkpoint"] = best(lambda i: fresh(job["plan_mp2"]), lambda t: load_checkpoint(t[0], t[1], ours))
        result["load_checkpoint_replanned"] = best(
            lambda i: fresh(job["plan_dp2"]), lambda t: load_checkpoint(t[0], t[1], ours)
        )

        def paddle_target(i):
            with paddle.utils.unique_name.guard():
                target = fresh(job["plan_mp2"])
                target[1].state_dict()  # _ShardOptimizer creates its states here (a fake step)
            return paddle_state(target)

        result["dist.load_state_dict"] = _or_failure(
            lambda: best(paddle_target, lambda s: dist.load_state_dict(s, str(paddles)))
        )
        result["bytes"] = _folder_bytes(ours)
    (Path(job["out_dir"]) / f"world{world}.rank{rank}.json").write_text(json.dumps(result))


def _or_failure(measure):
    try:
        return measure()
    except Exception as exc:  # reported in the table: what Paddle could not do here
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(args) -> dict[int, list[dict]]:
    """Write the plans, run the one-process job and the 2-rank job; each rank's timings."""
    from harness.launcher import launch_ranks
    from harness.plans import tensor_parallel_plan, write_plan

    config = model_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="checkpoint_time_"))
    try:
        model = load_model().build_model(**config)
        job = {
            "config": config, "repeats": args.repeats, "seed": 2024, "out_dir": str(workdir),
            "plan_mp2": write_plan(tensor_parallel_plan(model, mp=RANKS), workdir / "plan_mp2.json"),
            "plan_dp2": write_plan(tensor_parallel_plan(model, dp=RANKS), workdir / "plan_dp2.json"),
        }  # fmt: skip
        (workdir / "job.json").write_text(json.dumps(job))
        results = {}
        for world in (1, RANKS):
            launch_ranks(
                world, [__file__, "--worker", str(workdir / "job.json")], workdir / f"job{world}", args.timeout
            ).raise_for_failure()
            results[world] = [json.loads((workdir / f"world{world}.rank{r}.json").read_text()) for r in range(world)]
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def report(args, results: dict[int, list[dict]], markdown: bool) -> str:
    import paddle

    params = parameter_count(args)
    head = (
        f"docstring Llama, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab} "
        f"({params / 1e6:.1f} M parameters) + AdamW moments; best of {args.repeats}; "
        f"Paddle {paddle.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()})"
    )
    single = results[1][0]
    rows = [
        ("1 process", "save", single["paddle.save"], "paddle.save (model + optimizer)", single["save_checkpoint"]),
        ("1 process", "load", single["paddle.load"], "paddle.load + set_state_dict", single["load_checkpoint"]),
    ]
    for r in results[RANKS]:
        rows += [
            (f"mp2, rank {r['rank']}", "save", r["dist.save_state_dict"], "dist.save_state_dict", r["save_checkpoint"]),
            (
                f"mp2, rank {r['rank']}",
                "load (same plan)",
                r["dist.load_state_dict"],
                "dist.load_state_dict",
                r["load_checkpoint"],
            ),
            (
                f"mp2 -> dp2, rank {r['rank']}",
                "load (re-planned)",
                "needs a GPU",
                "dist.load_state_dict",
                r["load_checkpoint_replanned"],
            ),
        ]
    fmt = lambda t: f"{t:.3f}" if isinstance(t, float) else t  # noqa: E731
    size = (
        f"checkpoint folder: {single['bytes'] / 2**20:.1f} MiB on one process, "
        f"{results[RANKS][0]['bytes'] / 2**20:.1f} MiB from mp2"
    )
    if markdown:
        lines = [head, "", "| run | what | Paddle (s) | Paddle's way | autodist (s) |", "|---|---|---|---|---|"]
        lines += [f"| {run} | {what} | {fmt(p)} | {how} | {fmt(a)} |" for run, what, p, how, a in rows]
    else:
        lines = [head] + [
            f"{run:18} {what:18} {how:32} {fmt(p):>12}   autodist {fmt(a)}" for run, what, p, how, a in rows
        ]
    return "\n".join(lines + ["", size])


if __name__ == "__main__":
    bench_main(__doc__, worker, run, report, layers=8, hidden=512, vocab=4000, timeout=900)
