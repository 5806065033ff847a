"""Small plans written by hand for the tests, from ``model.named_parameters()`` and a readable
table of FQN suffix -> tensor-parallel style. They go through ``autodist.schemas`` like any
planner output (:func:`write_plan` saves and re-loads them, so an invalid one fails here).

Example::

    >>> plan = tensor_parallel_plan(model, dp=2, mp=2, styles=LLAMA_STYLES)   # doctest: +SKIP
    >>> plan.params["model.layers.0.self_attn.q_proj.weight"].placements      # doctest: +SKIP
    ['R', 'S(1)']
"""

from __future__ import annotations

import math
from pathlib import Path

from autodist.schemas import load_plan, save_plan
from autodist.schemas.fingerprint import parameter_fingerprint, parameter_table
from autodist.schemas.plan import (
    Cluster,
    DataPlan,
    DeviceProfile,
    Mesh,
    ModelInfo,
    ParamPlan,
    Plan,
    Provenance,
    Strategy,
)

#: Megatron-style tensor parallelism for Llama-like blocks. A Paddle Linear weight is
#: [in, out]: column-parallel splits dim 1 (its bias dim 0), row-parallel splits dim 0 (its
#: output is partial and Paddle sums it). Anything not listed stays replicated.
LLAMA_STYLES = {
    "self_attn.q_proj.weight": ("ColWiseParallel", "S(1)"),
    "self_attn.k_proj.weight": ("ColWiseParallel", "S(1)"),
    "self_attn.v_proj.weight": ("ColWiseParallel", "S(1)"),
    "self_attn.o_proj.weight": ("RowWiseParallel", "S(0)"),
    "mlp.gate_proj.weight": ("ColWiseParallel", "S(1)"),
    "mlp.up_proj.weight": ("ColWiseParallel", "S(1)"),
    "mlp.down_proj.weight": ("RowWiseParallel", "S(0)"),
}

#: A CPU profile: the figures only feed estimates, which these tests do not look at.
CPU_DEVICE = DeviceProfile(
    name="cpu",
    memory_bytes=8 << 30,
    peak_flops={"fp32": 1e11},
    intra_node_bandwidth=1e10,
    inter_node_bandwidth=1e9,
    intra_node_latency_s=1e-5,
    inter_node_latency_s=1e-4,
)
#: Hand-written plans have no traced graph; the applier checks only the parameter fingerprint.
NO_GRAPH = "0" * 64


def style_of(fqn: str, styles: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """(style, placement on mp) of the longest matching suffix, else replicated."""
    matches = [suffix for suffix in styles if fqn == suffix or fqn.endswith("." + suffix)]
    return styles[max(matches, key=len)] if matches else ("Replicate", "R")


def tensor_parallel_plan(
    model,
    dp: int = 1,
    mp: int = 1,
    styles: dict[str, tuple[str, str]] = LLAMA_STYLES,
    nodes: int = 1,
) -> Plan:
    """A dp x mp plan for ``model`` on ``nodes`` machines with ``dp*mp/nodes`` devices each."""
    dims = [(name, size) for name, size in (("dp", dp), ("mp", mp)) if size > 1] or [("dp", 1)]
    world = dp * mp
    table = parameter_table(model.named_parameters())
    params = {}
    for fqn, (shape, dtype) in table.items():
        style, on_mp = style_of(fqn, styles) if mp > 1 else ("Replicate", "R")
        placements = [on_mp if name == "mp" else "R" for name, _ in dims]
        params[fqn] = ParamPlan(shape=shape, dtype=dtype, placements=placements, style=style)
    return Plan(
        model=ModelInfo(
            class_name=type(model).__name__,
            num_parameters=sum(math.prod(shape) for shape, _ in table.values()),
            param_fingerprint=parameter_fingerprint(table),
            graph_fingerprint=NO_GRAPH,
        ),
        cluster=Cluster(nodes=nodes, devices_per_node=world // nodes, device=CPU_DEVICE),
        mesh=Mesh(dim_names=[n for n, _ in dims], shape=[s for _, s in dims], process_ids=list(range(world))),
        strategy=Strategy(dp=dp, mp=mp),
        params=params,
        data=DataPlan(shard_dims=["dp"] if dp > 1 else []),
        provenance=Provenance(autodist_version="0.1.0", paddle_version="test", arguments={"written_by": "tests/harness/plans.py"}),
    )


def write_plan(plan: Plan, path: Path) -> str:
    """Save ``plan`` and load it back through the strict reader; returns the path as a string."""
    save_plan(plan, path)
    load_plan(path)
    return str(path)
