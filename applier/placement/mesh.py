"""Process meshes from a plan: the whole mesh, and each pipeline stage's sub-mesh.

A plan's mesh axes are ordered ``pp, dp, mp`` (size-one axes left out). A stage's mesh is the
slice of the whole mesh at that ``pp`` index, so it drops the ``pp`` dim; placements written
for the whole mesh drop their ``pp`` entry the same way (see :func:`stage_placements`).

Example::

    >>> from autodist.schemas import load_plan
    >>> plan = load_plan("plans/paddleformers_llama/plan_4x8dev_mp8_pp2.json")   # pp2 x dp2 x mp8
    >>> stage_mesh(plan, 1).process_ids == list(range(16, 32))
    True
"""

from __future__ import annotations


import numpy as np
import paddle.distributed as dist

from autodist.schemas import Plan
from autodist.schemas.vocabulary import is_placement, shard_dim


def mesh_ids(plan: Plan) -> np.ndarray:
    """The plan's process ids laid out in the mesh's shape."""
    return np.array(plan.mesh.process_ids, dtype=np.int64).reshape(plan.mesh.shape)


def has_pp_dim(plan: Plan) -> bool:
    return "pp" in plan.mesh.axes


def stage_mesh(plan: Plan, stage: int) -> dist.ProcessMesh:
    """The ProcessMesh a stage's parameters and activations live on.

    Without pipeline parallelism this is the whole mesh. With it, the same sub-mesh as Paddle's
    ``ProcessMesh.get_mesh_with_dim("pp", stage)`` (its pipelining schedules look stage meshes
    up that way): a one-dim ``pp`` mesh gives each stage a one-rank mesh named ``pp``.
    """
    ids = mesh_ids(plan)
    names = list(plan.mesh.axes)
    if has_pp_dim(plan):
        ids, names = ids[stage], names[1:]
        if not names:  # mesh was ["pp"] alone: each stage is one rank
            ids, names = ids.reshape([1]), ["pp"]
    return dist.ProcessMesh(ids.tolist(), dim_names=names)


def stage_placements(plan: Plan, placements: list[str]) -> list[dist.Placement]:
    """Paddle placements for a stage mesh from a plan placement list (one entry per plan
    mesh axis): the ``pp`` entry is dropped, ``"R"``/``"P"``/``"S(k)"`` become
    ``Replicate()``/``Partial()``/``Shard(k)``."""
    kept = [p for d, p in zip(plan.mesh.axes, placements) if d != "pp"] or ["R"]
    return [to_paddle_placement(p) for p in kept]


def to_paddle_placement(placement: str) -> dist.Placement:
    """``"S(1)"`` -> ``dist.Shard(1)``, ``"R"`` -> ``dist.Replicate()``, ``"P"`` -> ``dist.Partial()``."""
    if not is_placement(placement):
        raise ValueError(f"not a placement: {placement!r} (expected R, P or S(k))")
    split = shard_dim(placement)
    if split is not None:
        return dist.Shard(split)
    return dist.Partial() if placement == "P" else dist.Replicate()


def stage_of_rank(plan: Plan, rank: int) -> int:
    """The pipeline stage ``rank`` runs (0 without pp)."""
    if not has_pp_dim(plan):
        return 0
    return int(np.argwhere(mesh_ids(plan) == rank)[0][0])


def pp_group_ranks(plan: Plan) -> list[list[int]]:
    """The ranks of every pipeline group (same dp/mp coordinates, one rank per stage), in a
    fixed order so every rank creates the same groups in the same sequence."""
    ids = mesh_ids(plan)
    if not has_pp_dim(plan):
        return [[int(r)] for r in ids.reshape(-1)]
    columns = ids.reshape(ids.shape[0], -1)
    return [[int(r) for r in columns[:, j]] for j in range(columns.shape[1])]


def new_group(ranks: list[int]) -> dist.communication.group.Group:
    """``dist.new_group(ranks)`` followed by a barrier of the whole world. Every rank calls it
    for every group, in the same order. On gloo, groups made back to back without the barrier
    fail at random: 4 of 6 jobs making ``[0, 2]`` then ``[1, 3]`` on 4 ranks died in
    ``ProcessGroupGloo.create`` (``connect [127.0.0.1]:911: Connection refused``, a port no rank
    listens on: the address a rank read for its peer was not its peer's) or timed out in the
    first all-reduce; with the barrier, 8 of 8 (docs/paddle-notes.md, "gloo: process groups made
    back to back fail")."""
    group = dist.new_group(ranks)
    dist.barrier()
    return group
