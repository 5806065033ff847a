"""Compare a distributed run with the single-device run: losses within 1e-5 relative,
parameters within 1e-5 absolute, on every rank. Mismatches are listed, never summarised away.

Example::

    >>> ref = {"losses": [4.0], "params": {"w": [1.0, 2.0]}, "unchanged_by_training": []}
    >>> differences(ref, {"rank": 0, **ref})
    []
"""

from __future__ import annotations

import re

import numpy as np

from autodist.schemas.vocabulary import local_shape

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def differences(
    reference: dict, rank_output: dict, loss_rtol: float = LOSS_RTOL, param_atol: float = PARAM_ATOL
) -> list[str]:
    """Every way one rank's result differs from the reference, one line each."""
    rank = rank_output["rank"]
    problems = []
    ref_losses, losses = np.array(reference["losses"]), np.array(rank_output["losses"])
    if ref_losses.shape != losses.shape:
        problems.append(f"rank {rank}: {len(losses)} losses, reference has {len(ref_losses)}")
    else:
        rel = np.abs(losses - ref_losses) / np.maximum(np.abs(ref_losses), 1e-30)
        for step in np.flatnonzero(~(rel <= loss_rtol)):  # a NaN loss counts as different
            problems.append(
                f"rank {rank}: step {step} loss {losses[step]:.8g} vs reference {ref_losses[step]:.8g} "
                f"(relative difference {rel[step]:.2e} > {loss_rtol:.0e})"
            )
    stale = sorted(set(rank_output["unchanged_by_training"]) - set(reference["unchanged_by_training"]))
    if stale:
        problems.append(f"rank {rank}: training never changed {stale} (the single-device run did: stale optimizer?)")
    # A pipeline or ep rank reports the parameters it holds; assert_same_training checks the union.
    missing = (
        [] if rank_output.get("own_params_only") else sorted(set(reference["params"]) - set(rank_output["params"]))
    )
    extra = sorted(set(rank_output["params"]) - set(reference["params"]))
    if missing or extra:
        problems.append(f"rank {rank}: parameter names differ: missing {missing}, unexpected {extra}")
    for fqn in sorted(set(reference["params"]) & set(rank_output["params"])):
        ref, got = np.asarray(reference["params"][fqn]), np.asarray(rank_output["params"][fqn])
        if ref.shape != got.shape:
            problems.append(f"rank {rank}: {fqn} has full shape {list(got.shape)}, reference {list(ref.shape)}")
            continue
        worst = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        if not worst <= param_atol:  # also catches NaN
            problems.append(f"rank {rank}: {fqn} differs by up to {worst:.2e} > {param_atol:.0e}")
    return problems


def resumed_differences(
    saved_reference: dict, saved: list[dict], reference: dict, resumed: list[dict], plan=None
) -> list[str]:
    """Where a resumed run differs from one uninterrupted device. ``saved``: every rank's output
    of the run that saved the checkpoint after its first steps (``saved_reference``: one device
    over those steps); ``resumed``: every rank's output of the run that loaded it and trained on,
    whose losses follow the saver's (``reference``: one device over all steps), laid out as
    ``plan`` says (None: one device, no plan)."""
    first_steps = saved[0]["losses"]
    problems = [f"rank {out['rank']}: losses {out['losses']}, rank 0 {first_steps}" for out in saved
                if out["losses"] != first_steps]  # fmt: skip  # every rank reports the global loss
    problems += [line for out in saved for line in differences(saved_reference, out)]
    for out in resumed:
        problems += differences(reference, {**out, "losses": first_steps + out["losses"]})
        problems += layout_differences(plan, out) if plan is not None else []
    held = set().union(*(out["params"] for out in resumed))
    return problems + [f"no rank reported {fqn}" for fqn in sorted(set(reference["params"]) - held)]


def assert_resumed_like_one_device(
    reference_runs, runs: dict, outputs: dict, saver: str, resumer: str, plan=None
) -> None:
    """AssertionError listing every way run ``resumer``, which loaded the checkpoint run ``saver``
    wrote, differs from one uninterrupted device (:func:`resumed_differences`). ``runs`` and
    ``outputs`` by run name; ``reference_runs``: :class:`harness.runner.ReferenceRuns`."""
    problems = resumed_differences(
        reference_runs.get(runs[saver]), outputs[saver], reference_runs.get(runs[resumer]), outputs[resumer], plan
    )
    assert not problems, f"{resumer}:\n  " + "\n  ".join(problems[:40])


def assert_same_training(name: str, reference: dict, rank_outputs: list[dict]) -> None:
    """AssertionError listing every difference of every rank from the reference run."""
    problems = [line for output in rank_outputs for line in differences(reference, output)]
    unheld = sorted(set(reference["params"]).difference(*(output["params"] for output in rank_outputs)))
    if unheld:
        problems.append(f"no rank reported {unheld}")
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise AssertionError(
            f"{name}: {len(rank_outputs)}-rank training differs from the single-device run "
            f"(reference losses {reference['losses']}):\n  {shown}{more}"
        )


def max_loss_drift(reference: dict, rank_output: dict) -> float:
    """Largest relative loss difference over the steps (for the drift record)."""
    ref, got = np.array(reference["losses"]), np.array(rank_output["losses"])
    return float(np.max(np.abs(got - ref) / np.abs(ref)))


def layout_differences(plan, rank_output: dict) -> list[str]:
    """Where a rank's parameters and optimizer states are not laid out as ``plan`` says.

    Each parameter must be a distributed tensor whose local shard has the planned shape (full
    shape divided by the mesh axes that shard it); ZeRO stage 3 may split it further over dp.
    With a ZeRO stage, every AdamW moment (the bulk of optimizer memory; the scalar ``beta_pow``
    accumulators cannot be split) must be split over dp, but for a 1-D one already split over
    another axis (a column bias over mp): Paddle 3.3.1 splits a tensor along one dim only
    (``sharding.get_placement_with_sharding``), so it stays whole over dp. Guards against a run
    that matches only because nothing was distributed.
    """
    sizes = dict(zip(plan.mesh.axes, plan.mesh.shape))
    dp_index = plan.mesh.axes.index("dp") if "dp" in sizes else None
    stage = plan.strategy.sharding_stage
    rank, problems = rank_output["rank"], []
    others = _other_ranks_experts(plan, rank)
    for fqn, planned in sorted(plan.params.items()):
        got = rank_output["layout"].get(fqn)
        if fqn in others:
            if got is not None:
                problems.append(f"rank {rank}: holds {fqn}, an expert another rank of its ep group holds")
            continue
        if got is None and rank_output.get("own_params_only"):
            continue  # another stage's parameter (others' experts are checked above)
        if got is None or got["placements"] is None:
            problems.append(f"rank {rank}: {fqn} is not a distributed tensor")
            continue
        expected = local_shape(planned.shape, planned.placements, plan.mesh.shape)
        zero3_dim = _shard_dim(got["placements"][dp_index]) if stage == 3 and dp_index is not None else None
        if zero3_dim is not None and planned.placements[dp_index] == "R":
            expected[zero3_dim] //= sizes["dp"]
        if got["local_shape"] != expected:
            problems.append(
                f"rank {rank}: {fqn} local shard {got['local_shape']}, plan says {expected} ({planned.placements})"
            )
    if stage:
        moments = {n: s for n, s in rank_output["optimizer_states"].items() if n.startswith("moment")}
        for name, state in sorted(moments.items()):
            split_elsewhere = any(_shard_dim(p) is not None for p in state["placements"] or [])
            if split_elsewhere and len(state["local_shape"]) == 1:
                continue
            if state["placements"] is None or _shard_dim(state["placements"][dp_index]) is None:
                problems.append(
                    f"rank {rank}: ZeRO stage {stage} but optimizer state {name} is not split over dp: {state}"
                )
    return problems


def _other_ranks_experts(plan, rank: int) -> set[str]:
    """The expert parameters ``rank`` must not hold, written from the design (schemas/plan.py,
    ``Strategy.ep``) independently of the applier: the rank at dp index d holds experts
    ``j*E/ep .. (j+1)*E/ep - 1`` of each container, j = d % ep."""
    ep = plan.strategy.ep
    if ep == 1:
        return set()
    ids = np.array(plan.mesh.process_ids).reshape(plan.mesh.shape)
    d = int(np.argwhere(ids == rank)[0][plan.mesh.axes.index("dp")])
    others = set()
    for block in plan.blocks:
        if block.experts:
            per = block.num_experts // ep
            for fqn in plan.params:
                if fqn.startswith(block.experts + "."):
                    child = fqn[len(block.experts) + 1 :].split(".")[0]  # "3", or "expert_3" (a LayerDict's)
                    if int(re.search(r"[0-9]+$", child).group()) // per != d % ep:
                        others.add(fqn)
    return others


def _shard_dim(placement: str) -> int | None:
    """``"Shard(dim=1)"`` -> 1, anything else -> None (Paddle's placement repr)."""
    return int(placement[len("Shard(dim=") : -1]) if placement.startswith("Shard(dim=") else None


def max_param_difference(reference: dict, rank_output: dict) -> float:
    """Largest absolute difference over all parameters (for the drift record)."""
    return max(
        float(np.max(np.abs(np.asarray(rank_output["params"][fqn]) - np.asarray(value))))
        for fqn, value in reference["params"].items()
    )
