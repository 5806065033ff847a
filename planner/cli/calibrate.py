"""``autodist-plan calibrate``: measure this cluster and write the cluster.toml ``--cluster`` reads.

Launched like training, one process per device::

    python -m paddle.distributed.launch --nproc_per_node 2 -m autodist.planner.cli calibrate \\
        --plan plan.json -o cluster.toml
    autodist-plan plan model.py --devices 2 --cluster cluster.toml -o plan.json

Run in one process it measures the device only (no collectives). The measuring and fitting
live in :mod:`autodist.planner.cost.calibrate`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click

from autodist.planner.errors import PlannerError


@click.command()
@click.option("--plan", "plan_file", type=click.Path(exists=True, dir_okay=False),
              help="Measure matmuls at this plan's per-rank shapes (else only square ones).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="cluster.toml", show_default=True,
              help="cluster.toml to write (rank 0 writes it).")
@click.option("--base", metavar="PROFILE", help="Profile for the figures not measured (default: this GPU's, or cpu).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Matmul dtype (default: bf16 on a GPU, fp32 on CPU).")
@click.option("--name", help="Name of the measured profile (default: <base>-measured).")
def calibrate(plan_file: str | None, output: str, base: str | None, dtype: str | None, name: str | None) -> None:
    """Measure matmuls, memory and collectives here and write a fitted cluster.toml."""
    import paddle
    import paddle.distributed as dist

    from autodist.planner.cost import calibrate as cal
    from autodist.planner.cost.hardware import local_gpu_profile_name, resolve_device
    from autodist.schemas import load_plan

    on_gpu = local_gpu_profile_name() is not None
    profile = resolve_device(base or local_gpu_profile_name() or "cpu")
    dtype = dtype or ("bf16" if on_gpu else "fp32")
    shapes = [(s, s, s) for s in cal.SQUARE_SIZES]
    if plan_file:
        try:
            shapes = sorted({*shapes[:2], *cal.plan_gemm_shapes(load_plan(plan_file))})
        except Exception as err:  # PlanError and friends: one readable line
            raise PlannerError(f"{plan_file}: {err}") from None

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    local = int(os.environ.get("PADDLE_LOCAL_SIZE", str(world)))
    rank, nodes, groups = 0, [list(range(world))], {}
    if world > 1:
        dist.init_parallel_env()
        rank = dist.get_rank()
        nodes = [list(range(n * local, (n + 1) * local)) for n in range(world // local)]
        # Groups first, on every rank in the same order, before the ranks' timings drift apart.
        # One node: the intra-node group is the whole world (the default group).
        if len(nodes) > 1:
            groups["intra"] = [(dist.new_group(ranks), ranks) for ranks in nodes]
            groups["inter"] = [(dist.new_group([node[i] for node in nodes]), [node[i] for node in nodes])
                               for i in range(local)]
        else:
            groups["intra"] = [(None, nodes[0])]
        dist.barrier()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"]) if world > 1 else None
    measured = cal.Measurements(matmuls=cal.measure_matmuls(shapes, dtype, mesh), memory=cal.measure_memory(dtype, mesh))
    notes = [f"{world} rank(s), {len(nodes)} node(s) of {local}; matmuls in {dtype}; paddle {paddle.__version__}"]
    if world > 1:
        dist.barrier()
        mine = {"intra": rank // local, "inter": rank % local}
        for scope, members in groups.items():
            group, ranks = members[mine[scope]]
            if len(ranks) > 1:
                cal.measure_collectives(group, ranks, scope, rank, measured)
            dist.barrier()
    if len(nodes) < 2:
        notes.append("one node: the inter-node link is not measured (the base profile's figures are kept)")
    if rank != 0:
        return
    device = cal.fitted_device(measured, profile, dtype, name or f"{profile.name}-measured", comm_overlap=on_gpu)
    text = cal.cluster_toml(device, measured, notes + [f"not measured: {m}" for m in measured.missing])
    target = Path(output)
    fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    click.echo(f"wrote {output}: {', '.join(f'{k}={v}' for k, v in device.items() if k not in ('name', 'base'))}",
               err=True)
    for missing in measured.missing:
        click.echo(f"not measured: {missing}", err=True)
