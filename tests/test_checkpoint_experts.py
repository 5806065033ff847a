"""Checkpoints of expert-parallel models, on several gloo processes (CPU): an MoE zoo model
(Mixtral; Qwen3-MoE, HF's expert_hit loop, once) trains 2 AdamW steps under plan A, saves, loads
under plan B, trains 1 more step, and the losses and parameters equal 3 uninterrupted
single-device steps (1e-5); every parameter is laid out as plan B says (under ep, each rank
holds only its experts).

Under expert parallelism a rank holds only its experts (applier/modes/expert_dispatch.py), so a checkpoint
written under ep must still describe every expert, each written whole by one rank that holds
it, and loading must fill the experts a rank holds and skip the ones it dropped. The ep plans
are the planner's (``--ep 2``), as tests/test_train_experts.py makes them.

Launches: the savers (2 ranks), then the loaders (1, 2 and 4 ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from harness.cases import Config
from harness.compare import resumed_differences
from harness.jobs import TrainRun
from harness.plans import write_plan
from harness.runner import train_by_world
from harness.workloads import WORKLOADS
from test_train_experts import ep_plan

from autodist import load_checkpoint
from autodist.planner.cli import cli
from autodist.schemas import load_plan, parameter_fingerprint, parameter_table
from autodist.schemas.checkpoint import read_checkpoint

pytestmark = pytest.mark.multiprocess

MIXTRAL, QWEN3 = "zoo_mixtral_moe", "zoo_qwen3_moe_hf"
SAVED_AT = 2
EXPERTS = ".block_sparse_moe.experts."

#: plan name -> (workload, ranks, ep, micro-batches); ep plans from the planner, dp2 by hand.
PLANS = {
    "dp2": (MIXTRAL, 2, 1, 1),
    "dp2_ep2": (MIXTRAL, 2, 2, 1),
    "dp4_ep2": (MIXTRAL, 4, 2, 1),
    "dp2_ep2_m2": (MIXTRAL, 2, 2, 2),  # the optimizer accumulates around the expert gradient sums
    "qwen3_dp2_ep2": (QWEN3, 2, 2, 1),
}
#: scenario -> (plan A, plan B); None is one device without a plan (plan A's workload).
SCENARIOS = {
    "dp2_ep2_to_dp2": ("dp2_ep2", "dp2"),
    "dp2_to_dp2_ep2": ("dp2", "dp2_ep2"),
    "dp2_ep2_to_dp4_ep2": ("dp2_ep2", "dp4_ep2"),
    "dp2_ep2_to_single": ("dp2_ep2", None),
    "dp2_ep2_m2_to_dp2": ("dp2_ep2_m2", "dp2"),
    "qwen3_dp2_ep2_to_single": ("qwen3_dp2_ep2", None),
}
#: The dp4 ep2 run saves again after its step, so its checkpoint is checked too.
RESAVED = "dp2_ep2_to_dp4_ep2"


def world(plan: str | None) -> int:
    return 1 if plan is None else PLANS[plan][1]


def make_run(name: str, workload: str, plan: str | None, paths: dict[str, str], **checkpointing) -> TrainRun:
    if plan is None:
        return TrainRun(name, workload, optimizer="adamw", method="single", **checkpointing)
    return TrainRun(name, workload, optimizer="adamw", plan=paths[plan], **checkpointing)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, reference_runs):
    """Save under every plan A, then resume under every plan B. Returns the plan paths, the
    checkpoints (by the plan, or for the resaved run the scenario, that wrote them), and each
    run's rank outputs."""
    workdir = tmp_path_factory.mktemp("experts_ckpt")
    paths = {}
    for name, (workload, ranks, ep, micro_batches) in PLANS.items():
        if ep > 1:
            plan = ep_plan(workload, ranks, micro_batches, "cpu")
        else:
            plan = Config(dp=ranks, micro_batches=micro_batches).hand_written_plan(WORKLOADS[workload].build(seed=0))
        assert (plan.strategy.ep, plan.strategy.dp, plan.strategy.micro_batches) == (ep, ranks, micro_batches)
        paths[name] = write_plan(plan, workdir / f"plan_{name}.json")
    savers = sorted({a for a, _ in SCENARIOS.values()})
    checkpoints = {name: str(workdir / f"ckpt_{name}") for name in [*savers, RESAVED]}
    saves = [
        (make_run(f"save_{a}", PLANS[a][0], a, paths, steps=SAVED_AT, save_checkpoint=checkpoints[a]), world(a))
        for a in savers
    ]
    loads = [
        (make_run(
            scenario, PLANS[a][0], b, paths, steps=1, first_step=SAVED_AT, load_checkpoint=checkpoints[a],
            save_checkpoint=checkpoints[RESAVED] if scenario == RESAVED else None,
        ), world(b))
        for scenario, (a, b) in SCENARIOS.items()
    ]  # fmt: skip
    outputs = train_by_world(saves, workdir / "save", timeout_s=600.0)
    outputs.update(train_by_world(loads, workdir / "load", timeout_s=600.0))
    runs = {run.name: run for run, _ in saves + loads}
    reference_runs.prepare(list(runs.values()))
    return paths, checkpoints, outputs, runs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_resumed_under_another_plan_trains_like_one_uninterrupted_device(resumed, reference_runs, scenario):
    paths, _, outputs, runs = resumed
    plan_a, plan_b = SCENARIOS[scenario]
    saver = f"save_{plan_a}"
    problems = resumed_differences(
        reference_runs.get(runs[saver]),
        outputs[saver],
        reference_runs.get(runs[scenario]),
        outputs[scenario],
        None if plan_b is None else load_plan(paths[plan_b]),
    )
    assert not problems, f"{scenario}:\n  " + "\n  ".join(problems[:40])


@pytest.mark.parametrize("saver, per_rank", [("dp2_ep2", [0, 1]), (RESAVED, [0, 1, 0, 1])])
def test_each_expert_is_saved_whole_by_the_lowest_rank_holding_it(resumed, saver, per_rank):
    """Written from the design (4 experts per layer, ep2): dp index d holds experts 0-1 when d
    is even, 2-3 when odd; so under dp2 ep2 rank 0 writes experts 0-1 and rank 1 experts 2-3,
    and under dp4 ep2 (ranks 2 and 3 hold copies of ranks 0 and 1) the same. Each expert tensor
    (the weight and each AdamW state) is one shard: whole, at offset 0. The model is described
    as the whole model (its fingerprint is the unsplit model's), whatever each rank held."""
    _, checkpoints, _, _ = resumed
    meta = read_checkpoint(checkpoints[saver])
    assert meta.plan.strategy.ep == 2 and meta.world_size == len(per_rank)
    whole = WORKLOADS[MIXTRAL].build(seed=0)
    assert meta.model.param_fingerprint == parameter_fingerprint(parameter_table(whole.named_parameters()))
    assert sorted(meta.params) == sorted(fqn for fqn, _ in whole.named_parameters())

    experts = {fqn: p for fqn, p in whole.named_parameters() if EXPERTS in fqn}
    assert len(experts) == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    assert sorted(meta.optimizer.states) == sorted(meta.params)
    for fqn, param in experts.items():
        expert = int(fqn.split(EXPERTS)[1].split(".")[0])
        writer = per_rank.index(expert // 2)  # the lowest rank whose dp index holds the expert
        tensors = {"param": meta.params[fqn], **meta.optimizer.states[fqn]}
        assert sorted(tensors) == ["beta1_pow_acc", "beta2_pow_acc", "moment1", "moment2", "param"], fqn
        for kind, tensor in tensors.items():
            whole_shape = [1] if kind.endswith("_pow_acc") else list(param.shape)
            assert [(s.file, s.offset, s.shape) for s in tensor.shards] == [
                (f"rank{writer}.bin", [0] * len(whole_shape), whole_shape)
            ], (fqn, kind)
    # Everything else is replicated and written by rank 0; ranks 2 and 3 hold only copies.
    assert sorted(meta.files) == ["rank0.bin", "rank1.bin"]


def test_the_resaved_dp4_ep2_checkpoint_loads_on_one_device(resumed):
    """The dp4 ep2 checkpoint, loaded into a plain model in this process, holds exactly the
    parameters the dp4 ep2 run held after its step (each expert from a rank that held it)."""
    _, checkpoints, outputs, _ = resumed
    model = WORKLOADS[MIXTRAL].build(seed=7)
    assert load_checkpoint(model, None, checkpoints[RESAVED]).step == SAVED_AT + 1
    held = {fqn: value for out in outputs[RESAVED] for fqn, value in out["params"].items()}
    loaded = dict(model.named_parameters())
    assert sorted(held) == sorted(loaded)
    for fqn, value in held.items():
        assert np.array_equal(loaded[fqn].numpy(), np.asarray(value, dtype=np.float32)), fqn


def test_ckpt_info_shows_an_expert_parallel_checkpoint(resumed):
    _, checkpoints, _, _ = resumed
    result = CliRunner().invoke(cli, ["ckpt", "info", checkpoints["dp2_ep2"]])
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    assert any(line.startswith("plan ") and "experts over 2 dp ranks (ep2)" in line for line in lines), lines
    # Each expert is one shard (written whole), however many ranks held it.
    assert "layers.*.block_sparse_moe.experts.*.w1.weight [32, 64] float32, 8.0 KiB, 1 shard" in lines, lines
