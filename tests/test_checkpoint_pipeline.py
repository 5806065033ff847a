"""Checkpoints of a 1F1B pipeline, on gloo processes (CPU): the planner's pp2 1F1B plan of the
PaddleFormers Llama, whose LM head shares the embedding's table (the last stage holds a copy).
2 Adam steps under pp2, save, then 1 more step resumed under pp2 again and on one device
(other weights to start from) equal 3 uninterrupted single-device steps (losses and parameters
within 1e-5). The checkpoint names every parameter as the model does, the tied table once.

Before: the pipeline's save named parameters after its stage chunks (``chunks.0.owned.3``), so
the checkpoint loaded under no other plan. gloo's ``batch_isend_irecv`` times out, so the
schedule runs with the TEST-ONLY blocking P2P stand-in (harness/cpu_substitutes.py), as in
test_train_pipeline.py. Launches: the saver (2 ranks), then the loaders (2 ranks; 1 process,
which also makes the single-device references); the plan is made by the ``autodist-plan``
command in the test process (harness/planning.py).
"""

from __future__ import annotations

import pytest
from harness.cases import Config
from harness.compare import assert_resumed_like_one_device
from harness.jobs import TrainRun
from harness.planning import plan_command
from harness.runner import train_by_world
from harness.workloads import WORKLOADS

from autodist.schemas import load_plan
from autodist.schemas.checkpoint import read_checkpoint

WORKLOAD = "paddleformers_llama"
SAVED_AT = 2
#: AdamW with weight decay, a step schedule and global-norm clipping (the clip autodist takes
#: over under a pipeline, applier/placement/clip.py; tests/test_clip_pipeline.py).
OPTIMIZER = "adamw"
PP2 = Config(pp=2, schedule="1F1B", micro_batches=2, p2p="blocking", plan_source="planner")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, reference_runs):
    workdir = tmp_path_factory.mktemp("pipeline_ckpt")
    workload = WORKLOADS[WORKLOAD]
    plan = str(
        plan_command(workload.planner_target, PP2.planner_arguments(), workdir / "plan_pp2.json", workload.planner_env)
    )
    checkpoint = str(workdir / "ckpt")
    common = dict(workload=WORKLOAD, optimizer=OPTIMIZER)
    save = TrainRun("save_pp2", **common, plan=plan, p2p="blocking", steps=SAVED_AT, save_checkpoint=checkpoint)
    resume = dict(steps=1, first_step=SAVED_AT, load_checkpoint=checkpoint)
    loads = [
        (TrainRun("pp2_to_pp2", **common, plan=plan, p2p="blocking", **resume), 2),
        (TrainRun("pp2_to_single", **common, method="single", **resume), 1),
    ]
    outputs = train_by_world([(save, 2)], workdir / "save")
    # The single-device references train in the one-process loading job.
    outputs.update(train_by_world(loads, workdir / "load", references=(reference_runs, [save] + [r for r, _ in loads])))
    return load_plan(plan), checkpoint, outputs, {run.name: run for run in [save] + [run for run, _ in loads]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("into", ["pp2_to_pp2", "pp2_to_single"])
def test_a_pipeline_checkpoint_resumes_like_one_uninterrupted_device(resumed, reference_runs, into):
    plan, _, outputs, runs = resumed
    assert_resumed_like_one_device(
        reference_runs, runs, outputs, "save_pp2", into, plan if into == "pp2_to_pp2" else None
    )


@pytest.mark.multiprocess
def test_a_pipeline_checkpoint_names_the_models_parameters_and_the_tied_table_once(resumed):
    plan, checkpoint, _, _ = resumed
    meta = read_checkpoint(checkpoint)
    model = WORKLOADS[WORKLOAD].build(seed=0)
    assert sorted(meta.params) == sorted(fqn for fqn, _ in model.named_parameters())
    assert plan.params["model.embed_tokens.weight"].tied_stages == {"lm_head.weight": 1}
    assert sorted(meta.optimizer.states) == sorted(meta.params)
    # The table is written once, by the first stage's rank, not again from the last stage's copy.
    assert [s.file for s in meta.params["model.embed_tokens.weight"].shards] == ["rank0.bin"]
