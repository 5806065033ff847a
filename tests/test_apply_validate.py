"""apply_plan's validation on a one-rank world: every bad input raises one PlanError that
names the problem, and leaves the model, optimizer and loader exactly as they were."""

from __future__ import annotations

import msgspec
import numpy as np
import paddle
import pytest
from harness.plans import tensor_parallel_plan, write_plan
from harness.workloads import WORKLOADS, make_loader
from models.gpt import build_model as build_gpt

from autodist.applier import apply_plan
from autodist.applier.placement.data import shard_loader, uneven_problem
from autodist.schemas import Reshard, ParamPlan, PlanError, Strategy, dump_plan


@pytest.fixture
def llama():
    return WORKLOADS["docstring_llama"].build(seed=1)


@pytest.fixture
def setup(llama):
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=llama.parameters())
    loader = make_loader(WORKLOADS["docstring_llama"], steps=1, seed=0)
    return llama, optimizer, loader


def snapshot(model, optimizer, loader):
    """Everything apply_plan could change: parameter objects and values, hooks, the
    optimizer's parameter list, the loader object."""
    return {
        "params": [(fqn, id(p), p.is_dist(), p.numpy().copy()) for fqn, p in model.named_parameters()],
        "hooks": [
            (fqn, len(layer._forward_pre_hooks), len(layer._forward_post_hooks))
            for fqn, layer in model.named_sublayers()
        ],
        "optimizer": [id(p) for p in optimizer._parameter_list] if optimizer else None,
        "loader": id(loader),
    }


def assert_unchanged(before, after):
    assert [p[:3] for p in before["params"]] == [p[:3] for p in after["params"]]
    for (fqn, *_, old), (_, *_, new) in zip(before["params"], after["params"]):
        np.testing.assert_array_equal(old, new, err_msg=fqn)
    assert before["hooks"] == after["hooks"]
    assert before["optimizer"] == after["optimizer"]
    assert before["loader"] == after["loader"]


def rejected(model, optimizer, loader, plan, **kwargs) -> PlanError:
    """Apply a bad plan; assert it fails with PlanError and changes nothing."""
    before = snapshot(model, optimizer, loader)
    with pytest.raises(PlanError) as info:
        apply_plan(model, optimizer, loader, plan, **kwargs)
    assert_unchanged(before, snapshot(model, optimizer, loader))
    return info.value


def test_plan_for_another_model_names_the_difference(setup):
    model, optimizer, loader = setup
    err = rejected(model, optimizer, loader, tensor_parallel_plan(build_gpt()))
    assert "not the model the plan was made for: a Model, not a GPTModel, its parameters differ" in str(err)
    assert 'parameters removed (planned, not in the model): "blocks.0.attn.' in str(err)
    assert 'parameters added (in the model, not planned): "embed_tokens.weight"' in str(err)


def test_a_model_wrapped_by_paddle_data_parallel_is_told_to_pass_the_model_itself(setup):
    """A fleet script's ``paddle.DataParallel`` (or ``fleet.distributed_model``) before apply_plan:
    one line, not a parameter diff of every name under ``_layers.``."""
    model, optimizer, loader = setup
    err = rejected(paddle.DataParallel(model), optimizer, loader, tensor_parallel_plan(model))
    assert str(err) == (
        "plan: invalid plan: model: a DataParallel around the Model the plan was made for: pass the Model itself (drop "
        "the fleet.distributed_model / paddle.DataParallel line: the plan runs the parallelism)"
    )


def test_a_model_of_other_sizes_is_told_what_differs_and_how_to_re_plan(setup):
    """The same class at another intermediate size: the first line counts what differs (once
    "(Model, 21 parameters; this Model has 21)", which named nothing) and how to re-plan."""
    from harness.workloads import DOCSTRING_LLAMA_CONFIG, load_model_file

    model, optimizer, loader = setup
    other = load_model_file("plans/llama_docstring/model.py", "llama_docstring_model").build_model(
        **{**DOCSTRING_LLAMA_CONFIG, "intermediate_size": 72}
    )
    plan = tensor_parallel_plan(other)
    plan.provenance.arguments["target"] = "plans/llama_docstring/model.py"
    err = rejected(model, optimizer, loader, plan)
    assert str(err).splitlines()[1] == (
        f"  - model: this is not the model the plan was made for: another Model, its parameters differ from the "
        f"{len(plan.params)} planned (6 resized); re-plan this model: autodist-plan plans/llama_docstring/model.py "
        "... (with its sizes), or autodist.plan(model, ...)"
    )
    assert '$.params["layers.0.mlp.up_proj.weight"].shape: planned [32, 72] but the model has [32, 64]' in str(err)


def test_plan_for_eight_ranks_on_one(setup):
    model, optimizer, loader = setup
    err = rejected(model, optimizer, loader, tensor_parallel_plan(model, dp=8))
    assert err.problems == [
        "world size: the plan's mesh dp8 needs 8 ranks but this job has 1 (PADDLE_TRAINERS_NUM); "
        "launch 8 ranks or re-plan for 1 device(s)",
        "dataloader: a batch of 4 samples does not divide over dp=8 x 1 micro-batches",
    ]


def test_missing_parameter_is_named(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.params["layers.9.mlp.up_proj.weight"] = ParamPlan(shape=[32, 64], dtype="float32", placements=["R"])
    err = rejected(model, optimizer, loader, plan)
    assert 'parameters removed (planned, not in the model): "layers.9.mlp.up_proj.weight"' in str(err)


def test_unplanned_parameter_is_named(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    del plan.params["norm.weight"]
    err = rejected(model, optimizer, loader, plan)
    assert 'parameters added (in the model, not planned): "norm.weight"' in str(err)


def test_renamed_parameter_is_paired(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.params["final_norm.weight"] = plan.params.pop("norm.weight")
    err = rejected(model, optimizer, loader, plan)
    assert '$.params["final_norm.weight"]: not in the model; renamed to "norm.weight"?' in str(err)


def test_wrong_shape_is_named(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    fqn = "layers.0.mlp.up_proj.weight"
    plan.params[fqn] = msgspec.structs.replace(plan.params[fqn], shape=[32, 128])
    err = rejected(model, optimizer, loader, plan)
    assert f'$.params["{fqn}"].shape: planned [32, 128] but the model has [32, 64] (resized)' in err.problems


def test_wrong_dtype_is_named(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.params["norm.weight"] = msgspec.structs.replace(plan.params["norm.weight"], dtype="bfloat16")
    err = rejected(model, optimizer, loader, plan)
    assert '$.params["norm.weight"].dtype: planned bfloat16 but the model has float32' in err.problems


def test_fingerprint_alone_differs(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.model.param_fingerprint = "f" * 64
    err = rejected(model, optimizer, loader, plan)
    assert "parameter fingerprint" in str(err) and "re-plan this model" in str(err)


def test_unknown_hook_layer(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.hooks = [Reshard(layer="layers.0.self_attn.qkv_proj", when="post", placements=["R"])]
    err = rejected(model, optimizer, loader, plan)
    assert err.problems == ['$.hooks[0].layer: no sub-layer "layers.0.self_attn.qkv_proj" in the model (reshard hook)']


def test_corrupted_file(setup, tmp_path):
    model, optimizer, loader = setup
    path = tmp_path / "plan.json"
    path.write_bytes(dump_plan(tensor_parallel_plan(model))[:-40])
    err = rejected(model, optimizer, loader, str(path))
    assert "not valid JSON" in str(err) and str(path) in str(err)


def test_newer_version(setup, tmp_path):
    model, optimizer, loader = setup
    data = dump_plan(tensor_parallel_plan(model)).replace(b'"version": 2', b'"version": 99')
    err = rejected(model, optimizer, loader, data)
    assert "format version 99" in str(err) and "upgrade autodist" in str(err)


def test_every_problem_is_listed_at_once(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model, dp=2)
    del plan.params["norm.weight"]
    plan.hooks = [Reshard(layer="nowhere", when="pre", placements=["R"])]
    err = rejected(model, optimizer, loader, plan)
    text = str(err)
    assert "world size" in text and '"norm.weight"' in text and '"nowhere"' in text


def test_optimizer_with_foreign_parameters(setup):
    model, _, loader = setup
    stray = paddle.create_parameter([3], "float32")
    optimizer = paddle.optimizer.SGD(parameters=[*model.parameters(), stray])
    err = rejected(model, optimizer, loader, tensor_parallel_plan(model))
    assert "optimizer: holds 1 parameters that are not the model's" in str(err)


def test_optimizer_missing_trainable_parameters(setup):
    model, _, loader = setup
    optimizer = paddle.optimizer.SGD(parameters=list(model.parameters())[1:])
    err = rejected(model, optimizer, loader, tensor_parallel_plan(model))
    assert "does not hold the model's trainable parameters" in str(err)


def test_frozen_parameters_may_stay_out_of_the_optimizer(setup):
    model, _, _ = setup
    model.embed_tokens.weight.stop_gradient = True
    trainable = [p for p in model.parameters() if not p.stop_gradient]
    _, optimizer, _ = apply_plan(model, paddle.optimizer.SGD(parameters=trainable), None, tensor_parallel_plan(model))
    assert len(optimizer._inner_opt._parameter_list) == len(trainable)


def test_optimizer_that_already_stepped(setup):
    model, optimizer, loader = setup
    loss = model(paddle.randint(0, 64, [2, 8]), labels=paddle.randint(0, 64, [2, 8]))[0]
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    err = rejected(model, optimizer, loader, tensor_parallel_plan(model))
    assert "already stepped" in str(err)


def test_sharding_stage_needs_a_shardable_optimizer(setup):
    model, _, loader = setup
    optimizer = paddle.optimizer.Momentum(parameters=model.parameters())
    plan = tensor_parallel_plan(model)
    plan.strategy = msgspec.structs.replace(plan.strategy, sharding_stage=1)
    err = rejected(model, optimizer, loader, plan)
    assert "$.strategy.sharding_stage: 1 needs AdamW or SGD" in str(err)


def test_tie_the_model_does_not_have(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.params["weight"] = msgspec.structs.replace(plan.params["weight"], tied_to=["embed_tokens.weight"])
    err = rejected(model, optimizer, loader, plan)
    assert '$.params["weight"].tied_to: the plan ties it to "embed_tokens.weight"' in str(err)


def test_already_distributed_model(setup):
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    model, optimizer, loader = apply_plan(model, optimizer, loader, plan)
    fresh = paddle.optimizer.SGD(parameters=model.parameters())
    err = rejected(model, fresh, None, plan)
    assert "already distributed parameters" in str(err)


def pipeline_plan(model, stages: dict[str, int], schedule: str):
    """A pp-only plan: parameter ``fqn`` goes to ``stages[first FQN part]``."""
    plan = tensor_parallel_plan(model)
    pp = max(stages.values()) + 1
    plan.mesh = msgspec.structs.replace(plan.mesh, axes=["pp"], shape=[pp], process_ids=list(range(pp)))
    plan.cluster = msgspec.structs.replace(plan.cluster, devices_per_node=pp)
    plan.strategy = Strategy(pp=pp, schedule=schedule, micro_batches=2)
    plan.params = {fqn: msgspec.structs.replace(p, stage=stages[fqn.split(".")[0]]) for fqn, p in plan.params.items()}
    return plan


def test_schedule_needs_blocks_or_a_sequential_model(setup):
    """A plan without blocks gives a schedule nothing to cut an ordinary model at."""
    model, optimizer, loader = setup
    top = {name: 0 for name, _ in model.named_children()} | {"norm": 1, "weight": 1}
    err = rejected(model, optimizer, loader, pipeline_plan(model, top, "1F1B"), loss_fn=lambda out, y: out.mean())
    assert "$.strategy.schedule: 1F1B cuts the model between its blocks, and none was recognised" in str(err)
    assert "world size" in str(err)  # a pp2 plan on one rank: both problems at once


def test_weight_tied_across_stages_needs_a_pipelining_schedule():
    """The sequential schedule would train the two copies of a tied table apart."""
    model = sequential()
    plan = pipeline_plan(model, {"0": 0, "2": 1, "3": 1}, "sequential")
    weight = plan.params["0.weight"]
    plan.params["0.weight"] = msgspec.structs.replace(weight, tied_to=["3.weight"], tied_stages={"3.weight": 1})
    err = rejected(model, None, None, plan)
    assert "$.strategy: a weight tied across stages needs the 1F1B or VPP schedule" in str(err)


def sequential():
    return paddle.nn.Sequential(
        paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 2)
    )


def test_schedule_needs_a_loss_function():
    model = sequential()
    err = rejected(
        model,
        paddle.optimizer.SGD(parameters=model.parameters()),
        None,
        pipeline_plan(model, {"0": 0, "2": 1, "3": 1}, "1F1B"),
    )
    assert "1F1B computes the loss inside the schedule: pass apply_plan(..., loss_fn=fn)" in str(err)


def test_1f1b_needs_stages_in_order():
    model = sequential()
    err = rejected(model, None, None, pipeline_plan(model, {"0": 1, "2": 0, "3": 1}, "1F1B"), loss_fn=paddle.mean)
    assert "1F1B needs the units' stages in order 0..1, got chunks [1, 0, 1]" in str(err)


def test_vpp_needs_stages_that_cycle():
    model = sequential()
    err = rejected(model, None, None, pipeline_plan(model, {"0": 0, "2": 1, "3": 1}, "VPP"), loss_fn=paddle.mean)
    assert "VPP needs the units' stages to cycle 0..1 at least twice, got chunks [0, 1]" in str(err)


class PositionsOnTheRoot(paddle.nn.Layer):
    """ViT-style: a learned position table held by the model itself, used before the blocks."""

    def __init__(self):
        super().__init__()
        self.pos = self.create_parameter([4, 8])
        self.blocks = paddle.nn.LayerList([paddle.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return x


def test_a_parameter_the_later_stages_cannot_skip_is_named():
    """Later stages skip what runs before the first block by stubbing the layer holding it; a
    parameter on the model itself (the layer that runs the blocks) cannot be skipped."""
    from autodist.schemas import Block

    model = PositionsOnTheRoot()
    plan = pipeline_plan(model, {"pos": 0, "blocks": 1}, "1F1B")
    plan.params = {
        fqn: msgspec.structs.replace(p, stage=1 if fqn.startswith("blocks.1.") else 0) for fqn, p in plan.params.items()
    }
    plan.blocks = [Block(layer=f"blocks.{i}", kind="linear", stage=i) for i in range(2)]
    err = rejected(model, None, None, plan, loss_fn=paddle.mean)
    assert '$.params["pos"]: runs before the first block but is held by a layer that also holds blocks' in str(err)
    assert "$.strategy.schedule" not in str(err)  # the blocks themselves can be cut


def test_plan_file_is_named_in_the_error(setup, tmp_path):
    model, optimizer, loader = setup
    path = write_plan(tensor_parallel_plan(model, dp=4), tmp_path / "plan.json")
    err = rejected(model, optimizer, loader, path)
    assert str(err).startswith(f"{path}: invalid plan")


def test_vpp_micro_batches_must_fill_whole_rounds():
    model = sequential()
    plan = pipeline_plan(model, {"0": 0, "2": 1, "3": 0}, "VPP")
    plan.strategy = msgspec.structs.replace(plan.strategy, micro_batches=5)
    err = rejected(model, None, None, plan, loss_fn=paddle.mean)
    assert "VPP needs a multiple of 2 micro-batches (max(1, n // pp)), got 5" in str(err)


# -- the batch --------------------------------------------------------------------------------------


def test_a_loader_batch_other_than_the_planned_global_batch_is_refused(setup):
    """The plan's batch is what the loader yields per step over all ranks; a loader of 4 under a
    plan made for 8 would train another batch than the one priced."""
    model, optimizer, loader = setup
    plan = tensor_parallel_plan(model)
    plan.data.global_batch_size = 8
    err = rejected(model, optimizer, loader, plan)
    assert err.problems == [
        "dataloader: yields batches of 4 samples per step but the plan was made for a global batch of 8 "
        "($.data.global_batch_size); give the loader batch_size=8 or re-plan with --global-batch-size 4"
    ]


def test_an_already_split_loader_counts_its_batch_per_dp_rank(setup):
    model, optimizer, _ = setup
    dataset = make_loader(WORKLOADS["docstring_llama"], steps=2, seed=0).dataset
    sampler = paddle.io.DistributedBatchSampler(dataset, batch_size=2, num_replicas=2, rank=0)
    plan = tensor_parallel_plan(model, dp=2)
    plan.data.global_batch_size = 2
    problems = rejected(model, optimizer, paddle.io.DataLoader(dataset, batch_sampler=sampler), plan).problems
    assert (
        "dataloader: yields batches of 2 per dp rank x dp=2 = 4 samples per step but the plan was made for a "
        "global batch of 2" in problems[-1]
    )


def test_a_loader_split_over_other_ranks_than_the_dp_groups_is_refused_in_one_line(setup):
    """Data-parallel code splits its data over every rank (num_replicas = world size); under a
    plan with mp the ranks of one dp group must read the same samples, or they train on
    different data silently (seen: dp2 x mp2, step-1 loss 4.630 vs 4.508 on one device)."""
    model, optimizer, _ = setup
    dataset = make_loader(WORKLOADS["docstring_llama"], steps=2, seed=0).dataset
    sampler = paddle.io.DistributedBatchSampler(dataset, batch_size=1, num_replicas=4, rank=0)
    plan = tensor_parallel_plan(model, dp=2)
    plan.data.global_batch_size = 2
    problems = rejected(model, optimizer, paddle.io.DataLoader(dataset, batch_sampler=sampler), plan).problems
    assert problems[-1] == (
        "dataloader: its DistributedBatchSampler gives this rank part 0 of 4, but the plan reads each batch in "
        "dp=2 parts (the ranks of one dp group, this one's is part 0, must read the same samples): use "
        "paddle.io.BatchSampler(dataset, batch_size=2) and apply_plan splits it"
    )


#: Paddle's sampler pads the dataset to a multiple of dp: what each refusal says of it.
PADDED = "samples do not split over dp=2: Paddle's shard_dataloader would pad them to"


@pytest.mark.parametrize(
    ("samples", "drop_last", "shuffle", "micro_batches", "problem"),
    [
        (61, False, False, 1, f"61 {PADDED} 62 with repeats of the first samples and train on those; give the "
         "DataLoader drop_last=True"),
        # the repeat completes the last batch, which drop_last then keeps
        (63, True, False, 1, f"63 {PADDED} 64 with repeats of the first samples and train on those; use "
         "paddle.io.Subset(dataset, range(56))"),
        # shuffled, the repeat lands in any batch
        (61, True, True, 1, f"61 {PADDED} 62 with repeats of the first samples and train on those; use "
         "paddle.io.Subset(dataset, range(56))"),
        (62, False, False, 2, "62 samples in batches of 8 end with a batch of 6, which does not split into dp=2 x 2 "
         "micro-batches; give the DataLoader drop_last=True"),
        (61, True, False, 1, None),  # the repeat falls in the dropped last batch
        (60, False, False, 1, None),  # a last batch of 4: 2 rows a rank, each rank's mean over its equal share
        (60, False, True, 2, None),
    ],
)  # fmt: skip
def test_a_last_batch_paddle_would_pad_is_refused_naming_the_fix(samples, drop_last, shuffle, micro_batches, problem):
    """61 samples at batch 8 end with 5 under dp2: Paddle's sampler pads them with sample 0 again
    (measured on 2 gloo ranks: the last loss differed from one device's, with no error)."""
    found = uneven_problem(samples, 8, dp=2, micro_batches=micro_batches, drop_last=drop_last, shuffle=shuffle)
    assert found == (problem and f"dataloader: {problem}")


def test_apply_plan_refuses_a_loader_it_would_pad_and_so_does_each_epoch(setup):
    model, optimizer, _ = setup
    plan = tensor_parallel_plan(model, dp=2)
    plan.data.global_batch_size = 8

    class Tokens(paddle.io.Dataset):
        def __init__(self, samples):
            self.samples = samples

        def __len__(self):
            return self.samples

        def __getitem__(self, i):
            return np.full([4], i, dtype="int64")

    dataset = Tokens(61)
    problems = rejected(model, optimizer, paddle.io.DataLoader(dataset, batch_size=8), plan).problems
    assert problems[-1].startswith("dataloader: 61 samples do not split over dp=2")
    dataset.samples = 64
    loader = shard_loader(paddle.io.DataLoader(dataset, batch_size=8), plan)  # as apply_plan splits it
    dataset.samples = 61  # the length changed after apply_plan checked it
    with pytest.raises(ValueError, match="61 samples do not split over dp=2: .* give the DataLoader drop_last=True"):
        iter(loader)


def test_a_batch_that_does_not_split_over_dp_and_micro_batches_is_refused_in_the_plan():
    from autodist.schemas import check_plan

    model = WORKLOADS["docstring_llama"].build(seed=0)
    plan = tensor_parallel_plan(model, dp=2, micro_batches=2)
    plan.data.global_batch_size = 6
    assert check_plan(plan) == ["$.data.global_batch_size: 6 does not divide over dp=2 x 2 micro-batches"]


@pytest.mark.parametrize("bad", ["soon", "0", "-1", "inf"])
def test_a_bad_read_timeout_is_one_error_naming_it_before_anything_is_touched(setup, monkeypatch, bad):
    """``AUTODIST_READ_TIMEOUT`` is parsed as ``AUTODIST_AGREE_TIMEOUT`` is (agree.seconds_from),
    before the agreement: not a bare ValueError after the plan was applied."""
    model, optimizer, loader = setup
    monkeypatch.setenv("AUTODIST_READ_TIMEOUT", bad)
    err = rejected(model, optimizer, loader, tensor_parallel_plan(model))
    assert err.problems == [f"AUTODIST_READ_TIMEOUT={bad!r}: expected a positive number of seconds"]
