"""1F1B and VPP for ordinary models (not rewritten, not ``nn.Sequential``): the planner's pp2
plans, applied to the docstring Llama, the GPT example and PaddleFormers Llama (untied, and
tied: its LM head shares the embedding's table across the two stages), train on 2 CPU ranks
to the single-device losses and parameters; tied PaddleFormers Llama at pp2 x dp2 on 4.

Paddle's schedules exchange activations with ``batch_isend_irecv``, which times out under
gloo, so these runs use the TEST-ONLY blocking send/recv stand-in
(``harness.cpu_substitutes.blocking_p2p``); the schedules, stages and everything autodist
builds are the real ones. The same runs through Paddle's own P2P need a GPU (``gpu`` marker).
"""

from __future__ import annotations

import pytest

from harness.cases import Config, check_against_reference, train_planned

pytestmark = pytest.mark.multiprocess

ONE_F_ONE_B = Config(pp=2, schedule="1F1B", micro_batches=2, p2p="blocking", plan_source="planner")
VPP = Config(pp=2, schedule="VPP", micro_batches=2, p2p="blocking", plan_source="planner")

#: (workload, config): every model at 1F1B, the 4-layer docstring Llama at VPP (2 chunks per rank).
CASES = [
    ("docstring_llama", ONE_F_ONE_B),
    ("gpt", ONE_F_ONE_B),
    ("paddleformers_llama_untied", ONE_F_ONE_B),
    ("paddleformers_llama", ONE_F_ONE_B),
    ("docstring_llama_4_layers", VPP),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    results = train_planned(CASES, tmp_path_factory.mktemp("pipelines"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.parametrize("workload", [w for w, _ in CASES])
def test_pipeline_trains_like_one_device(trained, reference_runs, workload):
    result = trained[workload]
    assert result.plan.strategy.schedule == dict(CASES)[workload].schedule
    check_against_reference(result, reference_runs)


def test_vpp_plan_cycles_the_blocks_over_the_stages(trained):
    plan = trained["docstring_llama_4_layers"].plan
    assert plan.strategy.virtual_stages == 2
    assert [b.stage for b in plan.blocks] == [0, 1, 0, 1]


def test_tied_head_holds_a_copy_on_the_last_stage(trained):
    """The tied run's last stage trained its own copy of the table, equal to the first stage's."""
    result = trained["paddleformers_llama"]
    embedding = result.plan.params["model.embed_tokens.weight"]
    assert embedding.tied_stages == {"lm_head.weight": 1}
    first, last = result.outputs
    assert "model.embed_tokens.weight" in first["params"] and "model.embed_tokens.weight" in last["params"]
    assert first["layout"]["model.embed_tokens.weight"]["mesh"] == [0]
    assert last["layout"]["model.embed_tokens.weight"]["mesh"] == [1]


#: pp2 x dp2 on 4 gloo ranks: one process group per pipeline column, made one at a time
#: (applier/placement/mesh.new_group; made back to back they connected in 2 of 7 attempts, docs/pipelines.md).
WITH_DP = (
    "paddleformers_llama",
    Config(pp=2, dp=2, schedule="1F1B", micro_batches=2, p2p="blocking", plan_source="planner"),
)


def test_a_pipeline_with_dp_inside_its_stages_trains_like_one_device(tmp_path, reference_runs):
    """PaddleFormers Llama (tied head) at pp2 x dp2: each stage's two dp ranks take half of each
    micro-batch, the tied table's copies are summed per pipeline column."""
    (result,) = train_planned([WITH_DP], tmp_path).values()
    reference_runs.prepare([result.run])
    assert (result.plan.strategy.pp, result.plan.strategy.dp, result.plan.strategy.schedule) == (2, 2, "1F1B")
    check_against_reference(result, reference_runs)


#: Paddle's own P2P (no stand-in), with and without dp inside the stages.
ON_GPU = [
    [
        ("docstring_llama", Config(pp=2, schedule="1F1B", micro_batches=2, plan_source="planner")),
        ("docstring_llama_4_layers", Config(pp=2, schedule="VPP", micro_batches=2, plan_source="planner")),
    ],
    [("paddleformers_llama", Config(pp=2, dp=2, schedule="1F1B", micro_batches=2, plan_source="planner"))],
]


@pytest.fixture(scope="module")
def trained_on_gpus(tmp_path_factory, reference_runs):
    import paddle

    needed = max(config.world for cases in ON_GPU for _, config in cases)
    if paddle.device.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA devices (one per rank), found {paddle.device.cuda.device_count()}")
    results = {}
    for cases in ON_GPU:
        results.update(train_planned(cases, tmp_path_factory.mktemp("pipelines_gpu"), backend="nccl"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("workload", [w for cases in ON_GPU for w, _ in cases])
def test_pipeline_with_paddles_p2p_trains_like_one_device(trained_on_gpus, reference_runs, workload):
    check_against_reference(trained_on_gpus[workload], reference_runs)
