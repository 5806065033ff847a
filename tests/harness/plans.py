"""Small plans written by hand for the tests, from ``model.named_parameters()`` and a readable
table of FQN suffix -> tensor-parallel style. They go through ``autodist.schemas`` like any
planner output (:func:`write_plan` saves and re-loads them, so an invalid one fails here).

Example::

    >>> plan = tensor_parallel_plan(model, dp=2, mp=2, styles=LLAMA_STYLES)      # doctest: +SKIP
    >>> plan.params["model.layers.0.self_attn.q_proj.weight"].placements      # doctest: +SKIP
    ['R', 'S(1)']
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from autodist.schemas import load_plan, save_plan
from autodist.schemas.fingerprint import parameter_fingerprint, parameter_table
from autodist.schemas.plan import (
    Cluster,
    DataPlan,
    DeviceProfile,
    Hook,
    HOOK_TYPES,
    StageHandoff,
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

#: Where sequence parallelism splits and gathers the sequence, by a sub-layer's last name
#: component, as Paddle's SequenceParallelBegin / SequenceParallelDisable / SequenceParallelEnd
#: place them for Llama: the sequence is split over mp after the embedding; attention (which
#: mixes positions) and the column/row-parallel MLP (whose input must be whole on mp) see it
#: gathered; their partial outputs are summed and split again; it is gathered for the LM head.
SEQUENCE_PARALLEL_SITES = [
    ("embed_tokens", "post", "sequence_parallel_begin", "split the sequence over mp after the embedding"),
    ("self_attn", "pre", "sequence_parallel_end", "attention needs the whole sequence"),
    ("self_attn", "post", "sequence_parallel_begin", "sum the row-parallel output, split the sequence"),
    ("mlp", "pre", "sequence_parallel_end", "the column-parallel input must be whole on mp"),
    ("mlp", "post", "sequence_parallel_begin", "sum the row-parallel output, split the sequence"),
    ("norm", "post", "sequence_parallel_end", "gather the sequence for the LM head"),
]

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
    sequence_parallel: bool = False,
    sharding_stage: int = 0,
    pp: int = 1,
    micro_batches: int = 1,
) -> Plan:
    """A pp x dp x mp plan for ``model`` on ``nodes`` machines with ``pp*dp*mp/nodes`` devices
    each: tensor parallelism from ``styles``, optionally sequence parallelism (hooks at
    :data:`SEQUENCE_PARALLEL_SITES`), a ZeRO ``sharding_stage`` over dp, and with ``pp > 1``
    the ``sequential`` schedule over :func:`pipeline_stages`."""
    dims = [(name, size) for name, size in (("pp", pp), ("dp", dp), ("mp", mp)) if size > 1] or [("dp", 1)]
    world = pp * dp * mp
    table = parameter_table(model.named_parameters())
    stage_of, handoffs = pipeline_stages(model, pp)
    params = {}
    for fqn, (shape, dtype) in table.items():
        style, on_mp = style_of(fqn, styles) if mp > 1 else ("Replicate", "R")
        placements = [on_mp if name == "mp" else "R" for name, _ in dims]
        params[fqn] = ParamPlan(shape=shape, dtype=dtype, placements=placements, style=style, stage=stage_of(fqn))
    return Plan(
        model=ModelInfo(
            class_name=type(model).__name__,
            num_parameters=sum(math.prod(shape) for shape, _ in table.values()),
            param_fingerprint=parameter_fingerprint(table),
            graph_fingerprint=NO_GRAPH,
        ),
        cluster=Cluster(nodes=nodes, devices_per_node=world // nodes, device=CPU_DEVICE),
        mesh=Mesh(axes=[n for n, _ in dims], shape=[s for _, s in dims], process_ids=list(range(world))),
        strategy=Strategy(
            dp=dp,
            mp=mp,
            pp=pp,
            sequence_parallel=sequence_parallel,
            sharding_stage=sharding_stage,
            schedule="sequential" if pp > 1 else "none",
            micro_batches=micro_batches,
        ),
        params=params,
        hooks=(sequence_parallel_hooks(model) if sequence_parallel else []) + handoffs,
        data=DataPlan(shard_axes=["dp"] if dp > 1 else [], input_stage=0, label_stage=pp - 1),
        provenance=Provenance(
            autodist_version="0.1.0", paddle_version="test", arguments={"written_by": "tests/harness/plans.py"}
        ),
    )


def pipeline_stages(model, pp: int):
    """Split the decoder layers (``...layers.<i>``) into ``pp`` equal runs: parameters before
    the first layer (embedding) go to stage 0, after the last (final norm, LM head) to the
    last stage. Returns ``(stage_of(fqn), hand-off hooks)``; the hand-off is a pre-hook on each
    stage's first layer, so every input it takes (activations, mask, positions) moves."""
    layers = [name for name, _ in model.named_sublayers() if re.fullmatch(r"(.*\.)?layers\.\d+", name)]
    per_stage = max(1, math.ceil(len(layers) / pp))

    def stage_of(fqn: str) -> int:
        if pp == 1:
            return 0
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", fqn)
        if match:
            return min(int(match.group(1)) // per_stage, pp - 1)
        return 0 if fqn.split(".")[-2:-1] == ["embed_tokens"] else pp - 1

    handoffs = [
        StageHandoff(layer=layers[stage * per_stage], when="pre", to_stage=stage, reason=f"stage {stage} starts here")
        for stage in range(1, pp)
        if stage * per_stage < len(layers)
    ]
    return stage_of, handoffs


def sequence_parallel_hooks(model) -> list[Hook]:
    """The plan's hooks for sequence parallelism, in model order."""
    hooks = []
    for name, _ in model.named_sublayers():
        for site, when, action, reason in SEQUENCE_PARALLEL_SITES:
            if name.rsplit(".", 1)[-1] == site:
                hooks.append(HOOK_TYPES[action](layer=name, when=when, reason=reason))
    return hooks


def write_plan(plan: Plan, path: Path) -> str:
    """Save ``plan`` and load it back through the strict reader; returns the path as a string."""
    save_plan(plan, path)
    load_plan(path)
    return str(path)
