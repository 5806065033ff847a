"""apply_plan on a one-rank world: what it builds (placements, ties, lazy initialisation,
optimizer, loader, hooks) and that training through it equals training the plain model."""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS, make_loader

from autodist.applier import apply_plan
from autodist.applier.placement.hooks import register_hooks
from harness.memory import local_parameter_bytes, planned_local_bytes
from autodist.schemas import Reshard, SequenceParallelBegin, SequenceParallelEnd, StageHandoff, Strategy


class TiedLM(paddle.nn.Layer):
    """Embedding table reused as the output projection: one Parameter under two names."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.embed = paddle.nn.Embedding(vocab, hidden)
        self.norm = paddle.nn.LayerNorm(hidden)
        self.proj = paddle.nn.Linear(hidden, hidden)
        self.head = paddle.nn.Layer()
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.proj(self.norm(self.embed(ids)))
        return paddle.matmul(h, self.head.weight, transpose_y=True)


def build_tied(seed: int = 3) -> TiedLM:
    paddle.seed(seed)
    return TiedLM()


def lm_loss(logits, labels):
    return paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1)).mean()


def one_rank_plan(model, **splits):
    """A one-device plan; ``splits`` puts ``S(k)`` on chosen parameters (a split over a size-1
    dim still goes through shard_tensor)."""
    plan = tensor_parallel_plan(model)
    for fqn, placement in splits.items():
        fqn = fqn.replace("__", ".")
        plan.params[fqn] = msgspec.structs.replace(plan.params[fqn], placements=[placement])
    return plan


# -- parameters ---------------------------------------------------------------------------------------


def test_parameters_get_the_planned_mesh_and_placements():
    model = build_tied()
    plan = one_rank_plan(model, proj__weight="S(1)", proj__bias="S(0)")
    model, _, _ = apply_plan(model, None, None, plan)
    assert model.proj.weight.placements == [dist.Shard(1)]
    assert model.proj.bias.placements == [dist.Shard(0)]
    assert model.norm.weight.placements == [dist.Replicate()]
    assert all(p.is_dist() and p.process_mesh.process_ids == [0] for p in model.parameters())


def test_tied_weight_stays_one_object():
    model = build_tied()
    model, _, _ = apply_plan(model, None, None, one_rank_plan(model))
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.is_dist()
    assert len(list(model.parameters())) == 5  # the tie is not split into two parameters


def test_training_through_the_plan_equals_the_plain_model():
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 16, [4, 6]))
    labels = paddle.to_tensor(np.random.RandomState(1).randint(0, 16, [4, 6]))
    runs = []
    for distributed in (False, True):
        model = build_tied()
        schedule = paddle.optimizer.lr.StepDecay(0.05, step_size=1, gamma=0.5)
        opt = paddle.optimizer.AdamW(
            schedule, parameters=model.parameters(), weight_decay=0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5)
        )
        if distributed:
            model, opt, _ = apply_plan(model, opt, None, one_rank_plan(model, proj__weight="S(1)"))
        losses = []
        for _ in range(3):
            loss = lm_loss(model(ids), labels)
            loss.backward()
            opt.step()
            opt.clear_grad()
            schedule.step()
            losses.append(float(loss))
        runs.append((losses, {k: v.numpy() for k, v in model.state_dict().items()}))
    (dense_losses, dense_state), (dist_losses, dist_state) = runs
    np.testing.assert_allclose(dist_losses, dense_losses, rtol=1e-6)
    for key in dense_state:
        np.testing.assert_allclose(dist_state[key], dense_state[key], atol=1e-6, err_msg=key)


def test_lazy_model_is_initialised_to_the_eager_values_then_sharded():
    eager = {fqn: p.numpy() for fqn, p in build_tied().named_parameters()}
    with paddle.LazyGuard():
        model = build_tied()
    assert not any(p._is_initialized() for p in model.parameters())
    plan = one_rank_plan(model, proj__weight="S(1)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: no layer holds parameters of its own and sublayers
        model, _, _ = apply_plan(model, None, None, plan)
    assert all(p._is_initialized() for p in model.parameters())
    for fqn, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), eager[fqn], err_msg=fqn)
    assert local_parameter_bytes(model) == planned_local_bytes(plan, 0) == 4 * (16 * 8 + 8 + 8 + 8 * 8 + 8)


def test_planned_local_bytes_divides_by_the_splitting_dims():
    model = WORKLOADS["docstring_llama"].build(seed=1)
    full = {fqn: int(np.prod(p.shape)) * 4 for fqn, p in model.named_parameters()}
    split = [fqn for fqn, p in tensor_parallel_plan(model, mp=2).params.items() if "S(" in p.placements[-1]]
    assert split  # q/k/v/o/gate/up/down of both layers
    expected = sum(full.values()) - sum(full[f] for f in split) // 2
    assert planned_local_bytes(tensor_parallel_plan(model, dp=2, mp=2), 3) == expected
    assert planned_local_bytes(tensor_parallel_plan(model, dp=2), 1) == sum(full.values())


# -- optimizer -------------------------------------------------------------------------------------------


def test_optimizer_rebuilt_with_the_same_hyper_parameters():
    model = build_tied()
    schedule = paddle.optimizer.lr.CosineAnnealingDecay(0.01, T_max=10)
    clip = paddle.nn.ClipGradByGlobalNorm(2.0)
    no_decay = {model.norm.weight.name, model.norm.bias.name}
    old = paddle.optimizer.AdamW(
        schedule,
        beta1=0.8,
        beta2=0.95,
        epsilon=1e-6,
        parameters=model.parameters(),
        weight_decay=0.05,
        grad_clip=clip,
        apply_decay_param_fun=lambda n: n not in no_decay,
    )
    model, opt, _ = apply_plan(model, old, None, one_rank_plan(model))
    new = opt._inner_opt
    assert type(new) is paddle.optimizer.AdamW and new is not old
    assert new._learning_rate is schedule and new._grad_clip is clip
    assert (new._beta1, new._beta2, new._epsilon, new._weight_decay) == (0.8, 0.95, 1e-6, 0.05)
    decays = {fqn: new._apply_decay_param_fun(p.name) for fqn, p in model.named_parameters()}
    assert decays == {
        "embed.weight": True,
        "norm.weight": False,
        "norm.bias": False,
        "proj.weight": True,
        "proj.bias": True,
    }


def test_optimizer_holds_exactly_the_new_parameters():
    """to_distributed's bug: an optimizer left on the old dense parameters never trains the
    sharded ones. Here the list is the new objects, and one step moves every parameter."""
    model = build_tied()
    old_ids = {id(p) for p in model.parameters()}
    model, opt, _ = apply_plan(
        model, paddle.optimizer.SGD(0.1, parameters=model.parameters()), None, one_rank_plan(model, proj__weight="S(1)")
    )
    held = opt._inner_opt._parameter_list
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    assert not old_ids & {id(p) for p in held}
    before = [p.numpy().copy() for p in model.parameters()]
    lm_loss(model(paddle.to_tensor([[1, 2, 3]])), paddle.to_tensor([[2, 3, 4]])).backward()
    opt.step()
    for fqn, p, b in zip([n for n, _ in model.named_parameters()], model.parameters(), before):
        assert not np.array_equal(p.numpy(), b), f"{fqn} did not train"


def test_the_optimizer_apply_plan_replaced_refuses_to_step():
    """``apply_plan(model, opt, loader, plan)`` without taking its return value: the user's
    optimizer holds the replaced parameters, so its step() would train nothing (measured: exit 0,
    the model never trained); it raises instead, naming the return value."""
    model = build_tied()
    opt = paddle.optimizer.AdamW(0.1, parameters=model.parameters())
    apply_plan(model, opt, None, one_rank_plan(model))
    lm_loss(model(paddle.to_tensor([[1, 2, 3]])), paddle.to_tensor([[2, 3, 4]])).backward()
    for update in (opt.step, lambda: opt.minimize(None)):
        with pytest.raises(ValueError, match=r"use the optimizer apply_plan returns, model, opt, loader = apply_plan"):
            update()
    opt.clear_grad()  # still works: the loop's other lines are harmless


def test_parameter_groups_keep_their_settings():
    model = build_tied()
    groups = [
        {"params": [model.embed.weight], "learning_rate": 0.5},
        {"params": [p for n, p in model.named_parameters() if n != "embed.weight"]},
    ]
    model, opt, _ = apply_plan(model, paddle.optimizer.SGD(0.1, parameters=groups), None, one_rank_plan(model))
    rebuilt = opt._inner_opt._param_groups
    assert rebuilt[0]["params"] == [model.embed.weight] and rebuilt[0]["learning_rate"] == 0.5
    assert len(rebuilt[1]["params"]) == 4


def test_momentum_keeps_l2_decay_and_is_not_wrapped():
    """shard_optimizer takes AdamW and SGD only; at sharding stage 0 others train unwrapped."""
    model = build_tied()
    old = paddle.optimizer.Momentum(
        0.1,
        momentum=0.7,
        use_nesterov=True,
        parameters=model.parameters(),
        weight_decay=paddle.regularizer.L2Decay(0.02),
    )
    model, opt, _ = apply_plan(model, old, None, one_rank_plan(model))
    assert type(opt) is paddle.optimizer.Momentum
    assert (opt._momentum, opt._use_nesterov, opt._regularization_method, opt._regularization_coeff) == (
        0.7,
        True,
        "l2_decay",
        0.02,
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_stage_wraps_with_paddles_shard_fn(stage):
    """On one rank the dp group has one member, so ZeRO changes nothing numerically: the
    wrapped optimizer must train exactly like the plain one. (More ranks need reduce_scatter,
    which Paddle's CPU wheel lacks: the multi-process harness covers that.)"""
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 16, [4, 6]))
    labels = paddle.to_tensor(np.random.RandomState(1).randint(0, 16, [4, 6]))
    losses = {}
    for distributed in (False, True):
        model = build_tied()
        opt = paddle.optimizer.AdamW(0.05, parameters=model.parameters())
        if distributed:
            plan = one_rank_plan(model)
            plan.strategy = msgspec.structs.replace(plan.strategy, sharding_stage=stage)
            model, opt, _ = apply_plan(model, opt, None, plan)
            assert type(opt._shard_fn) is getattr(dist, f"ShardingStage{stage}")
        for _ in range(2):
            loss = lm_loss(model(ids), labels)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.setdefault(distributed, []).append(float(loss))
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


# -- loader and hooks ----------------------------------------------------------------------------------------


def test_loader_yields_dist_tensors():
    model = WORKLOADS["docstring_llama"].build(seed=1)
    loader = make_loader(WORKLOADS["docstring_llama"], steps=2, seed=0)
    _, _, sharded = apply_plan(model, None, loader, tensor_parallel_plan(model))
    batches = list(sharded)
    assert len(batches) == 2
    assert all(t.is_dist() and t.process_mesh.process_ids == [0] for batch in batches for t in batch)


class Recorder:
    """A reshard_fn that records each call and then does the real ``dist.reshard``."""

    def __init__(self):
        self.calls = []

    def __call__(self, tensor, mesh, placements):
        self.calls.append((list(tensor.shape), mesh.process_ids, list(placements)))
        return dist.reshard(tensor, mesh, placements)


def test_reshard_hook_goes_through_the_injected_function():
    model = build_tied()
    plan = one_rank_plan(model, proj__weight="S(1)")
    plan.hooks = [Reshard(layer="proj", when="post", placements=["R"])]
    recorder = Recorder()
    model, _, _ = apply_plan(model, None, None, plan, reshard_fn=recorder)
    model(paddle.to_tensor([[1, 2, 3]]))
    assert recorder.calls == [([1, 3, 8], [0], [dist.Replicate()])]


def test_sequence_parallel_hooks_transpose_and_restore():
    """begin after the embedding: [b, s, h] -> [s, b, h] split over mp; end before the head:
    back to [b, s, h]. The layer in between sees the transposed layout; the result is equal."""
    model = build_tied()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 16, [2, 5]))
    expected = model(ids).numpy()
    plan = one_rank_plan(model)
    plan.mesh = msgspec.structs.replace(plan.mesh, axes=["mp"])
    plan.strategy = Strategy(sequence_parallel=True)
    plan.data = msgspec.structs.replace(plan.data, shard_axes=[])
    plan.hooks = [SequenceParallelBegin(layer="embed", when="post"), SequenceParallelEnd(layer="proj", when="post")]
    recorder = Recorder()
    model, _, _ = apply_plan(model, None, None, plan, reshard_fn=recorder)
    seen = []
    model.norm.register_forward_pre_hook(lambda layer, args: seen.append(list(args[0].shape)))
    out = model(ids)
    assert seen == [[5, 2, 8]]
    assert [call[2] for call in recorder.calls] == [[dist.Shard(0)], [dist.Replicate()]]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def pipeline_plan(model, stage_of):
    """A pp2 plan (ranks 0 and 1) putting each parameter on ``stage_of(fqn)``."""
    plan = one_rank_plan(model)
    plan.mesh = msgspec.structs.replace(plan.mesh, axes=["pp"], shape=[2], process_ids=[0, 1])
    plan.strategy = Strategy(pp=2, schedule="sequential")
    plan.params = {f: msgspec.structs.replace(p, stage=stage_of(f)) for f, p in plan.params.items()}
    return plan


class HandOffReached(Exception):
    """Raised by the recording reshard_fn to stop the forward at the hand-off."""


def test_stage_handoff_targets_the_next_stage_mesh():
    """Plumbing only: a real hand-off is a cross-mesh reshard, which segfaults on Paddle's CPU
    wheel (docs/paddle-notes.md, "Collectives on the CPU wheel"), so the reshard_fn records its arguments and
    stops the forward."""
    from autodist.applier.placement.shard import shard_parameters

    model = build_tied()
    plan = pipeline_plan(model, lambda fqn: int(fqn.startswith("proj")))
    plan.hooks = [StageHandoff(layer="norm", when="post", to_stage=1)]
    shard_parameters(model, plan)
    calls = []

    def record(x, mesh, placements):
        calls.append((x.process_mesh.process_ids, mesh.process_ids, placements))
        raise HandOffReached

    register_hooks(model, plan, record)
    with pytest.raises(HandOffReached):
        model(paddle.to_tensor([[1, 2]]))
    assert calls == [([0], [1], [dist.Replicate()])]


@pytest.mark.parametrize("lazy", [False, True])
def test_other_stages_parameters_hold_no_memory_here(lazy):
    """Rank 0 of a pp2 plan: stage-1 parameters go onto mesh [1] and take no memory on this
    rank, whether the model was built eagerly or under LazyGuard."""
    from autodist.applier.placement.shard import shard_parameters

    if lazy:
        with paddle.LazyGuard():
            model = build_tied()
    else:
        model = build_tied()
    plan = pipeline_plan(model, lambda fqn: int(fqn.startswith("proj")))
    shard_parameters(model, plan)
    assert model.proj.weight.process_mesh.process_ids == [1]
    assert model.embed.weight.process_mesh.process_ids == [0]
    assert local_parameter_bytes(model) == planned_local_bytes(plan, 0) == 4 * (16 * 8 + 8 + 8)


#: One rank of the LazyGuard job below: build lazily, apply a dp2 x mp2 plan, report bytes.
LAZY_RANK = """
import json, paddle, paddle.distributed as dist
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS
from autodist.applier import apply_plan
from harness.memory import local_parameter_bytes, planned_local_bytes
dist.init_parallel_env()
paddle.seed(7)
with paddle.LazyGuard():
    model = WORKLOADS["docstring_llama"].build_unseeded()
plan = tensor_parallel_plan(model, dp=2, mp=2)
model, _, _ = apply_plan(model, None, None, plan)
rank = dist.get_rank()
print(json.dumps({"local": local_parameter_bytes(model), "planned": planned_local_bytes(plan, rank),
                  "embed": model.embed_tokens.weight._local_value().numpy().tolist()}))
"""


@pytest.mark.multiprocess
def test_lazy_model_on_four_ranks_allocates_only_its_shards(tmp_path):
    """dp2 x mp2 under LazyGuard: each rank holds exactly the bytes the plan implies (less
    than the whole model), and a replicated table is initialised identically everywhere."""
    import json

    from harness.launcher import launch_ranks

    job = launch_ranks(4, ["-c", LAZY_RANK], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    reports = [json.loads(p.stdout.strip().splitlines()[-1]) for p in job.processes]
    model = WORKLOADS["docstring_llama"].build(seed=7)
    whole = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    for report in reports:
        assert report["local"] == report["planned"] < whole
    assert all(r["embed"] == reports[0]["embed"] for r in reports)


def test_pipeline_chunks_follow_the_children_stages():
    """Without blocks in the plan, 1F1B and VPP cut a Sequential where the children's planned
    stage changes; a child without parameters (ReLU) stays with the run before it."""
    from autodist.applier.modes.pipeline import chunk_units, pipeline_problems, stage_units

    model = paddle.nn.Sequential(*[paddle.nn.Linear(4, 4) if i != 2 else paddle.nn.ReLU() for i in range(6)])
    stages = {"0": 0, "1": 0, "3": 1, "4": 0, "5": 1}
    plan = pipeline_plan(model, lambda fqn: stages[fqn.split(".")[0]])
    assert chunk_units(stage_units(model, plan)) == [["0", "1", "2"], ["3"], ["4"], ["5"]]
    plan.strategy = msgspec.structs.replace(plan.strategy, schedule="VPP", micro_batches=2, virtual_stages=2)
    assert pipeline_problems(model, plan, loss_fn=paddle.mean) == []
    plan.strategy = msgspec.structs.replace(plan.strategy, schedule="1F1B", virtual_stages=1)
    assert pipeline_problems(model, plan, loss_fn=paddle.mean) == [
        "$.strategy.schedule: 1F1B needs the units' stages in order 0..1, got chunks [0, 1, 0, 1]",
        "$.strategy.virtual_stages: 1 chunks per rank, but the units' stages form 4 chunks over pp=2",
    ]


#: One rank of the pipeline job below, through the TEST-ONLY blocking send/recv stand-in
#: (gloo times out on ``batch_isend_irecv``, docs/paddle-notes.md, "Collectives on the CPU
#: wheel"). The schedule, stages and
#: optimizer are Paddle's and autodist's own.
PIPELINE_RANK = """
import json, sys
import numpy as np, paddle, paddle.distributed as dist
from autodist.applier import apply_plan
from autodist.schemas import load_plan
from harness.cpu_substitutes import blocking_p2p

paddle.seed(3)
model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8),
                             paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 2))
whole = model
opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
loss_fn = lambda out, y: ((out - y) ** 2).mean()
inputs = np.random.RandomState(0).rand(4, 4).astype("float32")
labels = np.random.RandomState(1).rand(4, 2).astype("float32")
dataset = paddle.io.TensorDataset([paddle.to_tensor(inputs), paddle.to_tensor(labels)])
loader = paddle.io.DataLoader(dataset, batch_size=4, shuffle=False)
model, opt, loader = apply_plan(model, opt, loader, load_plan(sys.argv[1]), loss_fn=loss_fn, stand_ins=["batched_p2p"])
losses = []
with blocking_p2p():
    for _ in range(2):
        x, y = next(iter(loader))  # inputs on the first stage's mesh, labels on the last's
        losses.append([float(l) for l in model.step(x, target=y)])  # on every rank (applier/ranks/readable/)
        opt.step()
        opt.clear_grad()
me = dist.get_rank()
params = {n: p._local_value().numpy().tolist() for n, p in whole.named_parameters() if me in p.process_mesh.process_ids}
print(json.dumps({"losses": losses, "params": params, "held": len(opt._inner_opt._parameter_list)}))
"""


def sequential_reference():
    """One device, the whole batch of 4 with a mean loss, 2 SGD steps; per-micro-batch losses."""
    paddle.seed(3)
    model = paddle.nn.Sequential(
        paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 2)
    )
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    x = paddle.to_tensor(np.random.RandomState(0).rand(4, 4).astype("float32"))
    y = paddle.to_tensor(np.random.RandomState(1).rand(4, 2).astype("float32"))
    losses = []
    for _ in range(2):
        out = model(x)
        halves = [((out[i : i + 2] - y[i : i + 2]) ** 2).mean() for i in (0, 2)]
        losses.append([float(h) for h in halves])
        ((out - y) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, stages", [("1F1B", [0, 0, 1, 1]), ("VPP", [0, 1, 0, 1])])
def test_pipeline_schedule_on_two_ranks_trains_like_one_device(tmp_path, schedule, stages):
    """Paddle's 1F1B / VPP schedule built by apply_plan on 2 CPU ranks (P2P stand-in above):
    the last stage's micro-batch losses and every rank's parameters equal one device's."""
    import json

    from harness.launcher import launch_ranks
    from harness.plans import write_plan

    paddle.seed(3)
    model = paddle.nn.Sequential(
        paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 2)
    )
    by_child = dict(zip(["0", "2", "3", "4"], stages))
    plan = pipeline_plan(model, lambda fqn: by_child[fqn.split(".")[0]])
    plan.strategy = msgspec.structs.replace(
        plan.strategy, schedule=schedule, micro_batches=2, virtual_stages=2 if schedule == "VPP" else 1
    )
    plan.cluster = msgspec.structs.replace(plan.cluster, devices_per_node=2)
    plan.data = msgspec.structs.replace(plan.data, input_stage=0, label_stage=1)
    path = write_plan(plan, tmp_path / "plan.json")
    job = launch_ranks(2, ["-c", PIPELINE_RANK, path], workdir=tmp_path, timeout_s=120)
    job.raise_for_failure()
    ranks = [json.loads(p.stdout.strip().splitlines()[-1]) for p in job.processes]
    ref_losses, ref_params = sequential_reference()
    # Only the last stage computes the loss; the first reads it from there (issue 21 item 1: on
    # the old code its step returned [] and rank 0 had no loss to log).
    assert ranks[0]["losses"] == ranks[1]["losses"]
    np.testing.assert_allclose(ranks[1]["losses"], ref_losses, rtol=1e-5)
    held = {}
    for rank in ranks:
        held.update(rank["params"])
        assert rank["held"] == len(rank["params"])  # the optimizer holds this rank's stage only
    assert held.keys() == ref_params.keys()
    for name, value in held.items():
        np.testing.assert_allclose(value, ref_params[name], atol=1e-6, err_msg=name)
