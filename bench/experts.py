"""Expert parallelism on CPU ranks: what each rank holds and how long a training step takes with
and without ``--ep``, next to the plan's estimate and to ``paddle.distributed.to_distributed`` on
the same model and ranks.

The model is ``bench/moe_model.py`` (the zoo's Mixtral-style decoder at hidden 256, 8 experts of
intermediate 512, top-2, 4 layers: the experts are 87 % of its 14.4 M parameters), 8 sequences of
128 tokens per step. For each world (2 ranks, then 4): one plan per ep degree dividing it,
``autodist-plan bench/moe_model.py --dp N --mp 1 --ep E --device cpu`` (fp32, no ZeRO, no
sequence parallelism: what gloo runs), and one job of N gloo ranks per plan, then one for
``to_distributed`` (its failure, if it fails, in one line). The plans are priced twice: with the
stock ``cpu`` profile, and with the cluster.toml ``autodist-plan calibrate --model`` writes after
timing the dp N ep2 plan's training steps on N ranks (launched as ``make demo`` launches it): that
plan's estimate is fitted, the others' are predicted. Each rank: seed, build, AdamW,
distribute, ``--steps`` training steps. It reports the bytes it holds (parameters, gradients after
the first backward, AdamW states after the first step: each tensor's local value counted), the
peak of Paddle's host allocator over the steps (``core.host_memory_stat_peak_value``: every
tensor alive at once, activations included), its peak RSS above its RSS before the build, the
median step time (the first step left out) and the losses. Under ep it also counts what the
expert hooks' collectives carry per step (bytes at each of ``applier/modes/expert_dispatch.py``'s gathers and
sums, sent per rank by the ring formulas the planner prices; their gradient sums before the
update are dp traffic and left out) and the time spent in them.

Run: ``make bench`` or ``.venv/bin/python bench/experts.py [--worlds 2 4] [--steps 6] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import moe_model  # also puts tests/ on sys.path
from lazy_init import rss_mb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from demo import launch_command  # noqa: E402  (examples/ is no package)

ROOT = Path(__file__).resolve().parents[1]
TO_DISTRIBUTED = "to_distributed"
#: The ep degree whose plan ``autodist-plan calibrate`` fits the machine on; the others are priced with it.
CALIBRATED_ON = 2
MIB = 2**20


def worker(job_path: str) -> None:
    """One rank: build, distribute, train, write ``rank<R>.json`` (a failure is written too, then raised)."""
    import paddle.distributed as dist

    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    dist.init_parallel_env()
    dist.barrier()
    try:
        result = {"rank": rank, **measure(job, baseline_mb=rss_mb())}
    except Exception as exc:
        result = {"rank": rank, "failed": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"}
        raise
    finally:
        (Path(job["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))


def measure(job: dict, baseline_mb: float) -> dict:
    import paddle
    from paddle.base import core

    from harness.memory import local_gradient_bytes, local_parameter_bytes, optimizer_state_bytes
    from harness.workloads import TokenDataset, to_numpy

    traffic = ExpertTraffic() if job["plan"] else None
    paddle.seed(job["seed"])
    model = moe_model.build_model()
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    dataset = TokenDataset(moe_model.mixtral.VOCAB, job["steps"] * moe_model.BATCH, job["seed"], moe_model.SEQ)
    loader = paddle.io.DataLoader(
        dataset, batch_sampler=paddle.io.BatchSampler(dataset, batch_size=moe_model.BATCH, drop_last=True)
    )
    model, optimizer, loader = distribute(job, model, optimizer, loader)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    seconds, losses, grads, ep_bytes, ep_seconds = [], [], 0, [], []
    for inputs, labels in loader:
        before = traffic.snapshot() if traffic else (0, 0.0)
        start = time.perf_counter()
        loss = moe_model.loss_fn(model(inputs), labels)
        loss.backward()
        if not losses:  # the first step is not timed: count the gradients there
            grads = local_gradient_bytes(model)
        optimizer.step()
        optimizer.clear_grad()
        seconds.append(time.perf_counter() - start)
        after = traffic.snapshot() if traffic else (0, 0.0)
        ep_bytes.append(after[0] - before[0])
        ep_seconds.append(after[1] - before[1])
        losses.append(float(to_numpy(loss)))
    return {
        "params": local_parameter_bytes(model),
        "grads": grads,
        "optimizer": optimizer_state_bytes(optimizer),
        "allocator_peak": core.host_memory_stat_peak_value("Allocated", 0),
        "rss_over_baseline_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mb,
        "step_s": statistics.median(seconds[1:]),
        "ep_bytes": statistics.median(ep_bytes[1:]),
        "ep_s": statistics.median(ep_seconds[1:]),
        "losses": losses,
    }


def distribute(job: dict, model, optimizer, loader):
    import paddle
    import paddle.distributed as dist

    if job["plan"]:
        from autodist import apply_plan

        return apply_plan(model, optimizer, loader, job["plan"])
    from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig

    config = ToDistributedConfig()
    config.input_spec = [paddle.static.InputSpec([moe_model.BATCH, moe_model.SEQ], "int64", "input_ids")]
    return dist.to_distributed(model, optimizer, loader, device_num=job["world"], node_num=1, config=config)


class ExpertTraffic:
    """BENCH-ONLY instrument: wraps ``applier/modes/expert_dispatch.py``'s all-gather (``_gather``) and
    all-reduce (``_sum``) to add up the bytes each call sends from this rank, by the ring
    formulas the planner prices ((n - 1) x the local tensor for a gather over n ranks,
    2 (n - 1) / n x the tensor for a sum), and the seconds spent in them (waiting for the peers
    included). Calls made by the gradient sums before the update (``ExpertGradSync.step``: dp
    traffic, which the plan prices under ``dp``) are not counted."""

    def __init__(self):
        import autodist.applier.modes.expert_dispatch as experts

        self.bytes, self.seconds, self.syncing = 0, 0.0, False
        gather, total, sync = experts._gather, experts._sum, experts.ExpertGradSync.step

        def counted(collective, sent):
            def call(x, mesh):
                start = time.perf_counter()
                out = collective(x, mesh)
                if not self.syncing:
                    n = len(mesh.process_ids)
                    self.bytes += round(sent(n) * x.numel().item() * x.element_size())
                    self.seconds += time.perf_counter() - start
                return out

            return call

        def step(optimizer):
            self.syncing = True
            try:
                sync(optimizer)
            finally:
                self.syncing = False

        experts._gather = counted(gather, lambda n: n - 1)
        experts._sum = counted(total, lambda n: 2 * (n - 1) / n)
        experts.ExpertGradSync.step = step

    def snapshot(self) -> tuple[int, float]:
        return self.bytes, self.seconds


def plan_for(world: int, ep: int, path: Path, cluster: Path | None = None) -> Path:
    """``autodist-plan bench/moe_model.py`` for dp ``world`` x ep ``ep`` on CPU ranks: priced with
    the stock ``cpu`` profile, or with ``cluster`` (a calibrated cluster.toml)."""
    degrees = ["--devices", str(world), "--dp", str(world), "--mp", "1", "--ep", str(ep)]
    device = ["--cluster", str(cluster)] if cluster else ["--device", "cpu"]
    subprocess.run(
        [str(Path(sys.executable).with_name("autodist-plan")), "bench/moe_model.py", *degrees, *device,
         "--sharding-stage", "0", "--no-sequence-parallel", "--dtype", "fp32", "-q", "-o", str(path)],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return path


def calibrate(world: int, plan: Path, workdir: Path) -> Path | None:
    """``autodist-plan calibrate --plan PLAN --model bench/moe_model.py`` on ``world`` ranks
    (launched as training is, like ``make demo``): this machine's cluster.toml, or None when it
    fails (said on stderr)."""
    from harness.launcher import base_env

    cluster = workdir / f"cluster_{world}.toml"
    command = launch_command(
        workdir / f"calibrate_logs_{world}", str(Path(sys.executable).with_name("autodist-plan")), "calibrate",
        "--plan", str(plan), "--model", "bench/moe_model.py", "-o", str(cluster), ranks=world,
    )  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if done.returncode or not cluster.exists():
        print(f"calibrate on {world} ranks fails (logs in {workdir})", file=sys.stderr)
        return None
    return cluster


def run(args) -> list[dict]:
    """Every world's jobs; one row per job: its name, its plan's estimates (stock and calibrated)
    and each rank's report."""
    from autodist.schemas import load_plan
    from harness.launcher import launch_ranks

    workdir = Path(tempfile.mkdtemp(prefix="experts_bench_"))
    args.load_at_start = os.getloadavg()
    rows = []
    for world in args.worlds:
        degrees = [ep for ep in (1, 2, 4) if world % ep == 0]
        plans = {ep: plan_for(world, ep, workdir / f"plan_dp{world}_ep{ep}.json") for ep in degrees}
        # Fitted on the ep2 plan, as when docs/benchmarks.md's figures were taken: calibrate's
        # all-zero token ids left experts without tokens, whose backward failed under plain dp
        # before its MoE layers ran on local tensors too (docs/benchmarks.md, "Expert parallelism").
        cluster = calibrate(world, plans[2], workdir) if CALIBRATED_ON in degrees else None
        for ep, plan in [*plans.items(), (None, None)]:
            name = f"dp{world} {f'ep{ep}' if ep else TO_DISTRIBUTED}"
            out = workdir / name.replace(" ", "_")
            out.mkdir()
            job = {"plan": plan and str(plan), "world": world, "steps": args.steps, "seed": 2024, "out_dir": str(out)}
            (out / "job.json").write_text(json.dumps(job))
            result = launch_ranks(world, [__file__, "--worker", str(out / "job.json")], out, timeout_s=args.timeout)
            ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
            failed = [r["failed"] for r in ranks if "failed" in r]
            if not result.ok and not failed:
                failed = [result.report().splitlines()[-1][:120]]
            estimate = load_plan(plan).estimate if plan else None
            calibrated = None
            if plan and cluster:
                calibrated = load_plan(plan_for(world, ep, workdir / f"calibrated_{plan.name}", cluster)).estimate
            rows.append(
                {"name": name, "world": world, "estimate": estimate, "calibrated": calibrated, "ranks": ranks,
                 "failed": failed}
            )  # fmt: skip
            print(f"{name}: {'fails: ' + failed[0] if failed else 'done'}", file=sys.stderr, flush=True)
    return rows


def worst(row: dict, key: str) -> float:
    """The figure of the rank where it is largest (the slowest rank sets the step)."""
    return max(r[key] for r in row["ranks"])


def held(row: dict) -> float:
    """Parameters + gradients + optimizer states on the rank holding most."""
    return max(r["params"] + r["grads"] + r["optimizer"] for r in row["ranks"])


def report(args, rows: list[dict], markdown: bool) -> str:
    import paddle

    head = (
        f"bench/moe_model.py: Mixtral-style MoE (zoo), hidden 256, 8 experts x intermediate 512, top-2, 4 layers, "
        f"vocabulary 2000, 14.4 M parameters (experts 12.6 M); batch {moe_model.BATCH} x {moe_model.SEQ} tokens, "
        f"AdamW, fp32; {args.steps} steps, median of the last {args.steps - 1}; Paddle {paddle.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores ({cpu_model()}), "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, gloo; load average (1, 5, 15 min) "
        f"{load(args.load_at_start)} at the start, {load(os.getloadavg())} at the end"
    )
    measured = [
        "| ranks | run | params MiB | grads MiB | AdamW states MiB | allocator peak MiB | peak RSS over start MiB "
        "| step ms | ep MiB/step | ep collectives ms/step | loss first / last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    planned = [
        "| run | params + grads + states MiB, plan / measured | total with activations MiB, plan / allocator peak "
        "| step ms, plan (cpu profile / calibrated) / measured | ep MiB/step, plan / counted | dp MiB/step, plan |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for row in rows:
        if row["failed"]:
            measured.append(f"| {row['world']} | {row['name']} | fails: {row['failed'][0]} |" + " |" * 8)
            continue
        ranks = row["ranks"]
        losses = ranks[0]["losses"]
        measured.append(
            f"| {row['world']} | {row['name']} | {worst(row, 'params') / MIB:.1f} | {worst(row, 'grads') / MIB:.1f} "
            f"| {worst(row, 'optimizer') / MIB:.1f} | {worst(row, 'allocator_peak') / MIB:.0f} "
            f"| {worst(row, 'rss_over_baseline_mb'):.0f} | {worst(row, 'step_s') * 1e3:.0f} "
            f"| {worst(row, 'ep_bytes') / MIB:.2f} | {worst(row, 'ep_s') * 1e3:.0f} | {losses[0]:.4f} / {losses[-1]:.4f} |"
        )
        if row["estimate"] is not None:
            e = row["estimate"]
            states = e.memory.params + e.memory.grads + e.memory.optimizer
            planned.append(
                f"| {row['name']} | {states / MIB:.1f} / {held(row) / MIB:.1f} "
                f"| {e.memory.total / MIB:.0f} / {worst(row, 'allocator_peak') / MIB:.0f} "
                f"| {e.step_time_s * 1e3:.0f} / {calibrated_ms(row)} / {worst(row, 'step_s') * 1e3:.0f} "
                f"| {e.comm_bytes.ep / MIB:.2f} / {worst(row, 'ep_bytes') / MIB:.2f} | {e.comm_bytes.dp / MIB:.1f} |"
            )
        ratios += ratio_lines(row, [r for r in rows if r["world"] == row["world"] and not r["failed"]])
    if markdown:
        return "\n".join([head, "", *measured, "", *planned, "", *ratios])
    return "\n".join([head, *measured, *planned, *ratios])


def ratio_lines(row: dict, same_world: list[dict]) -> list[str]:
    """``row`` against plain dp (when it is under ep) and against to_distributed on as many ranks."""
    if row["name"].endswith(TO_DISTRIBUTED):
        return []
    plain = f"dp{row['world']} ep1"
    others = [r for r in same_world if r["name"].endswith(TO_DISTRIBUTED) or (r["name"] == plain != row["name"])]
    return [
        f"- {row['name']} / {other['name']}: params + grads + states {held(row) / held(other):.2f}, "
        f"allocator peak {worst(row, 'allocator_peak') / worst(other, 'allocator_peak'):.2f}, "
        f"step time {worst(row, 'step_s') / worst(other, 'step_s'):.2f}"
        + (
            f" (the plans say {row['estimate'].step_time_s / other['estimate'].step_time_s:.2f}"
            + (
                f", calibrated {row['calibrated'].step_time_s / other['calibrated'].step_time_s:.2f})"
                if other["calibrated"] is not None
                else ")"
            )
            if other["estimate"] is not None
            else ""
        )
        for other in others
    ]


def calibrated_ms(row: dict) -> str:
    return f"{row['calibrated'].step_time_s * 1e3:.0f}" if row["calibrated"] is not None else "-"


def load(average: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.1f}" for x in average)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` is empty on Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per job (2 and 4)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--markdown", action="store_true", help="print tables for docs/benchmarks.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(report(args, run(args), args.markdown))


if __name__ == "__main__":
    main()
