"""Local-view tensor parallelism for a fused ``q|k|v`` projection (GPT-2's ``c_attn``, issue 22)
and a fused ``gate|up`` one (Phi-3's ``gate_up_proj``, ERNIE 4.5's ``up_gate_proj``).

- The planner proves each local view at plan time and records it; the proof fails loudly when an
  attribute's local value is sabotaged; plans made without ``local_view`` are unchanged.
- Applied on 2 gloo ranks: training matches one device (losses and parameters within 1e-5) and
  the attention scores inside the run hold half of the heads on each rank (the gathered layout of
  the default plan runs all 4 on every rank); the same at dp2 x mp2 on 4 ranks.
- A fused ``gate|up`` MLP is a local view too, its gather gone; applied on 2 gloo ranks it trains
  like one device with each rank's ``down_proj`` reading half of the intermediate features.
- At dp2 x mp2 on 4 ranks, Phi-3 (a batch-shaped mask, positions, a fused gate|up MLP), XLM
  (masked_fill) and ERNIE 4.5 (a fused up|gate MLP) train like one device too, each attention
  taking its dp rows of the mask.
- HF Falcon's fused multi-query ``query_key_value`` (one K/V head) is Megatron's local view
  ``q_r|k|v``, its weight held whole over mp: at mp2 and dp2 x mp2 it trains like one device.
- HF OPT (``bmm`` over merged batch x heads) and HF GPT-BigCode (``baddbmm`` of the query folded
  beside its heads against one K/V head, ``c_attn`` held whole as Falcon's) train like one device
  as local views at mp2.
- Composed as Megatron composes them: micro-batches, full and selective recompute (the attention
  recomputed inside its view, on local tensors, its all-reduces once), ZeRO 1 and 2, and the
  pipelines at pp2 x mp2 on 4 gloo ranks: GPT-2 and Falcon under 1F1B (Falcon with selective
  recompute), GPT-2 with four blocks under VPP, their heads tied to the first stage's table.
- Checkpoints keep the model's own layout, for GPT-2's q|k|v, ERNIE 4.5's up|gate (held rank by
  rank) and Falcon's multi-query q|k|v (held whole): saved under the local view, resumed under the
  gathered plan and on one device, and the other way round, each like one uninterrupted device.

Launches: every training above but the pipelines is made by one module fixture (``trained``),
batched into one job per world size and checkpoint phase: every mp2 training with the round trips'
savers (2 ranks) and every dp2 x mp2 training (4), then the loaders (2) and the single-device
resumes with every single-device reference (1); the pipelines are one more job (``pipelined``, 4
ranks, planned by ``autodist-plan``). Five launches, where the tests starting their own jobs made 22: on a
2-core machine each launch costs every rank several seconds of start-up (it imports Paddle), more
than the few steps it trains. A job that fails fails every test reading it, each with the failed
ranks' stderr. Planning is pure (same model, same request, same plan): each plan is made once
(:func:`_planned`).
"""

from __future__ import annotations

import functools

import msgspec
import pytest

from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import load, plan_target
from autodist.applier.modes.local_calls import local_view_problems
from autodist.planner.local_view_proof import NotProven, verify
from autodist.planner.errors import PlannerError
from autodist.planner.review.check import check_plan_for_target
from autodist.planner.review.show import show_text
from autodist.schemas import LocalAttribute, Plan, save_plan
from harness.cases import Config, Trained, check_against_reference, train_planned
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request
from harness.compare import assert_resumed_like_one_device
from harness.runner import train_by_world
from harness.workloads import WORKLOADS

GPT2 = "tests/models/zoo/gpt2_hf.py"
HEADS = 4  # tests/models/zoo/gpt2_hf.py N_HEAD
PHI3 = "tests/models/zoo/phi3_hf.py"
FALCON = "tests/models/zoo/falcon_hf.py"
ERNIE_INTERMEDIATE = 64  # tests/models/paddleformers_models.py _TINY intermediate_size


#: Strategies the local views compose with, Megatron's way, by name: the request's fields beyond
#: dp x mp2, and the run's (ZeRO splits AdamW's moments over dp; on gloo its gradients reach their
#: dp shards through the TEST-ONLY reshard stand-in, harness/cpu_substitutes.py).
COMPOSED: dict[str, tuple[dict, dict]] = {
    "": ({}, {}),
    "m2": ({"micro_batches": 2}, {}),
    "recompute_full": ({"recompute": "full"}, {}),
    "recompute_selective": ({"recompute": "selective"}, {}),
    "zero1": ({"sharding_stage": 1}, {"optimizer": "adamw", "reshard": "via_replicate"}),
    "zero2": ({"sharding_stage": 2}, {"optimizer": "adamw", "reshard": "via_replicate"}),
    "zero1_m2_recompute_full": (
        {"sharding_stage": 1, "micro_batches": 2, "recompute": "full"},
        {"optimizer": "adamw", "reshard": "via_replicate"},
    ),
}


#: workload -> its local-view sub-layers (attentions of 4 heads of 8: 2 heads on each mp rank).
COMPOSED_VIEWS = {
    "zoo_gpt2_hf": [f"transformer.h.{i}.attn" for i in (0, 1)],
    "zoo_falcon_hf": [f"transformer.h.{i}.self_attention" for i in (0, 1)],
}


def _request(dp: int = 1, composed: str = "", **extra) -> SearchRequest:
    return gloo_mp2_request(dp, **COMPOSED[composed][0], **extra)


def _planned(target: str, dp: int = 1, local_view: bool = True, composed: str = "") -> Plan:
    """``target`` planned at dp x mp2 (with the strategies ``COMPOSED[composed]``), with or
    without local views. Planning is pure (the same model and request give the same plan) and
    this module asks for most plans more than once: each is made once and shared, so it is never
    edited in place (``msgspec.structs.replace``)."""
    return _plan_once(target, dp, local_view, composed)  # one cache key however the call spells its arguments


@functools.cache
def _plan_once(target: str, dp: int, local_view: bool, composed: str) -> Plan:
    return plan_target(target, None, _request(dp, composed), {"target": target}, local_view=local_view).plan


@pytest.fixture(scope="module")
def local_plan():
    return _planned(GPT2)


@pytest.fixture(scope="module")
def dp_plan():
    return _planned(GPT2, dp=2)


def test_planner_records_a_proven_local_view(local_plan):
    views = {view.layer: view for view in local_plan.local_view}
    assert sorted(views) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    view = views["transformer.h.0.attn"]
    weights = {w.param.removeprefix("transformer.h.0.attn."): (w.dim, w.segments, w.summed) for w in view.weights}
    assert weights == {
        "c_attn.weight": (1, 3, False),  # q|k|v along the output features of Conv1D's [nx, nf]
        "c_attn.bias": (0, 3, False),
        "c_proj.weight": (0, 1, False),
        "c_proj.bias": (None, 1, True),
    }
    attributes = {(a.layer.rpartition("h.0.")[2], a.name): (a.whole, a.local) for a in view.attributes}
    # the row projection's ``nf`` (the whole output width, 32 too) is not localised, nor is
    # ``embed_dim`` (32 too), which the forward never reads: the proof finds what it reads
    assert attributes == {
        ("attn", "num_heads"): (4, 2),
        ("attn", "split_size"): (32, 16),
        ("attn.c_attn", "nf"): (96, 48),
    }
    assert "equal the global run" in view.verified
    assert "transformer.h.*.attn  c_attn.weight 3 segments;" in show_text(local_plan)
    assert "c_attn.nf 96->48" in show_text(local_plan)
    # the local sub-layers' fused projections are not gathered any more
    assert not [h for h in local_plan.hooks if h.action == "reshard" and ".attn." in h.layer]


def test_the_estimate_prices_what_runs(local_plan):
    """GPT-2 (h = 32, 4 heads, 2 layers) at mp2, 4 x 8 = 32 tokens a step, fp32 (its parameters').
    Gathered, each layer all-gathers c_attn's output (3 x 32 elements a token) forward and
    c_proj's input gradient (32) backward, each rank sending half: 2 x (48 + 16) x 32 tokens x 4
    bytes = 16384 bytes more over mp than the local view, whose cores run on half the heads (less
    memory and time). The Megatron all-reduces are the same in both. --no-local-view also leaves
    the token lookup in the global view: the [64, 32] table all-gathered twice (each rank sending
    half: 2 x 64 x 32 x 4 / 2 = 8192 bytes) instead of one all-reduce of the 32 x 32 output (each
    rank sending 2 x (2 - 1) / 2 of it: 4096 bytes), 4096 bytes more."""
    gathered = _planned(GPT2, local_view=False)
    local, whole = local_plan.estimate, gathered.estimate
    assert whole.comm_bytes.mp - local.comm_bytes.mp == 2 * (48 + 16) * 32 * 4 + 4096
    assert local.memory.activations < whole.memory.activations and local.step_time_s < whole.step_time_s
    assert local.memory.params == whole.memory.params


def test_no_local_view_still_gathers_the_fused_projection():
    plan = _planned(GPT2, local_view=False)
    assert plan.local_view == []
    assert {h.layer for h in plan.hooks if h.action == "reshard"} >= {"transformer.h.0.attn.c_attn"}


def test_local_view_with_data_parallelism(dp_plan):
    assert [v.layer for v in dp_plan.local_view] == ["transformer.h.0.attn", "transformer.h.1.attn"]


def test_the_plan_records_local_views_under_accumulation_zero_and_full_recompute():
    """Emit lists the proven views and the local lookup under each strategy they compose with,
    with full recompute listing the blocks (which then run their views again in the backward)."""
    for composed in ("m2", "recompute_full", "recompute_selective", "zero2", "zero1_m2_recompute_full"):
        dp = 2 if "zero" in composed else 1
        plan = _planned(GPT2, dp, composed=composed)
        views = ["transformer.h.0.attn", "transformer.h.1.attn"]
        assert [view.layer for view in plan.local_view] == views, composed
        assert [lookup.layer for lookup in plan.vocab_lookup] == ["transformer.wte"]
        assert not [note for note in plan.notes if "do not run" in note or "does not run" in note], plan.notes
        recomputed = {"none": [], "full": ["transformer.h.0", "transformer.h.1"], "selective": views}
        assert plan.recompute == recomputed[plan.strategy.recompute], composed


#: pp2 x mp2 under the 1F1B schedule, 2 micro-batches, on 4 devices.
ONE_F_ONE_B = {"pp": 2, "schedule": "1F1B", "micro_batches": 2, "devices_per_node": 4}


@pytest.mark.parametrize("workload", sorted(COMPOSED_VIEWS))
def test_a_1f1b_pipeline_runs_each_stages_views_and_the_tied_tables_first_stage_lookup(workload):
    """GPT-2 and Falcon (2 blocks, LM heads tied to the table by a call) at pp2 x mp2 1F1B: each
    stage's block runs its attention as a local view, the first stage looks the tokens up on
    local tensors, and the last stage holds the table's copy for the head (``tied_stages``)."""
    target = WORKLOADS[workload].planner_target
    plan = plan_target(target, None, _request(**ONE_F_ONE_B), {"target": target}, local_view=True).plan
    assert (plan.strategy.pp, plan.strategy.mp, plan.strategy.schedule) == (2, 2, "1F1B")
    assert [view.layer for view in plan.local_view] == COMPOSED_VIEWS[workload]
    assert [block.stage for block in plan.blocks] == [0, 1]
    (lookup,) = plan.vocab_lookup
    table = plan.params[lookup.weight]
    assert table.stage == 0 and table.tied_stages == {lookup.weight: 1}


#: The pipelines trained on 4 gloo ranks, in one job: (workload, schedule, recompute) -> its
#: local views. Falcon's attentions recomputed selectively inside the stages; GPT-2 with four
#: blocks under VPP: two chunks a stage, blocks 0 and 2 on stage 0.
PIPELINED = {
    ("zoo_gpt2_hf", "1F1B", "none"): COMPOSED_VIEWS["zoo_gpt2_hf"],
    ("zoo_falcon_hf", "1F1B", "selective"): COMPOSED_VIEWS["zoo_falcon_hf"],
    ("zoo_gpt2_hf_4_layers", "VPP", "none"): [f"transformer.h.{i}.attn" for i in range(4)],
}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, reference_runs) -> dict[str, Trained]:
    """The plans of :data:`PIPELINED`, made by ``autodist-plan`` (local views on by default) at pp2
    x mp2 with 2 micro-batches, trained on 4 gloo ranks. The pipeline columns' process groups are
    made one at a time (applier/placement/mesh.new_group); the stages exchange activations through the
    TEST-ONLY blocking P2P (gloo times out on Paddle's batched P2P, harness/cpu_substitutes.py)."""
    cases = [
        (
            workload,
            Config(
                pp=2,
                mp=2,
                schedule=schedule,
                micro_batches=2,
                recompute=recompute,
                p2p="blocking",
                plan_source="planner",
            ),
        )
        for workload, schedule, recompute in PIPELINED
    ]
    trained = train_planned(cases, tmp_path_factory.mktemp("pipelined"))
    reference_runs.prepare([t.run for t in trained.values()])
    return trained


@pytest.mark.multiprocess
@pytest.mark.parametrize(("workload", "schedule", "recompute"), sorted(PIPELINED))
def test_local_views_in_a_pipeline_train_like_one_device(pipelined, reference_runs, workload, schedule, recompute):
    """Each stage's chunks run their attentions as local views (recomputed on local tensors where
    asked), the first stage its token lookup on local tensors, the last stage the tied head on its
    copy of the table: losses and parameters as one device."""
    run = pipelined[workload]
    plan = run.plan
    strategy = plan.strategy
    assert (strategy.schedule, strategy.virtual_stages, strategy.recompute) == (
        schedule,
        2 if schedule == "VPP" else 1,
        recompute,
    )
    views = PIPELINED[workload, schedule, recompute]
    assert [view.layer for view in plan.local_view] == views
    assert plan.recompute == (views if recompute == "selective" else [])
    (lookup,) = plan.vocab_lookup
    assert plan.params[lookup.weight].tied_stages == {lookup.weight: 1}
    assert [block.stage for block in plan.blocks] == [i % 2 for i in range(len(plan.blocks))]
    check_against_reference(run, reference_runs)


def test_the_search_chooses_local_views_with_zero1_and_accumulation_where_memory_is_short():
    """GPT-2 at dp2 x mp2, 16 sequences a step, ZeRO stage and micro-batches left to the search,
    on a device one byte short of the plain plan's memory (ZeRO 0, one micro-batch): the search
    chooses ZeRO 2 (local views run under it, priced with their cores on half of the heads; ZeRO 3
    runs them too but gathers every parameter over dp in each forward and backward; ZeRO 1 is
    priced as fast, with more memory); with ZeRO 0 asked, 2
    micro-batches. Each plan runs its attentions as
    local views and its lookup on local tensors."""
    from autodist.planner.cost.step_time import MEMORY_USABLE

    def chosen(**fixed) -> Plan:
        request = _request(2, global_batch_size=16, **fixed)
        return plan_target(GPT2, None, request, {"target": GPT2}, local_view=True).plan

    def short_of(plan: Plan) -> SearchRequest:
        device = _request().device
        return msgspec.structs.replace(device, memory_bytes=int((plan.estimate.memory.total - 1) / MEMORY_USABLE))

    plain = chosen(micro_batches=1)
    assert (plain.strategy.sharding_stage, plain.strategy.micro_batches) == (0, 1) and plain.local_view
    zero = chosen(sharding_stage=None, micro_batches=None, device=short_of(plain))
    assert (zero.strategy.sharding_stage, zero.strategy.micro_batches) == (2, 1)
    accumulating = chosen(micro_batches=None, device=short_of(plain))
    assert (accumulating.strategy.sharding_stage, accumulating.strategy.micro_batches) == (0, 2)
    for plan in (zero, accumulating):
        assert len(plan.local_view) == 2 and len(plan.vocab_lookup) == 1


def test_verification_fails_loudly_on_a_sabotaged_attribute(local_plan):
    model = load(GPT2).model
    view = local_plan.local_view[0]
    layer = dict(model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in local_plan.params.items()}

    def sabotaged(**values):
        kept = [a for a in view.attributes if a.name not in values]
        return msgspec.structs.replace(
            view,
            attributes=kept
            + [LocalAttribute(layer=view.layer, name=n, whole=w, local=v) for n, (w, v) in values.items()],
        )

    # the whole head count at 1/mp width: the head reshape cannot run
    with pytest.raises(NotProven, match="running it failed: ValueError"):
        verify(layer, sabotaged(num_heads=(4, 4)), params, 2, [2, 8, 32])
    # 4 heads of 4 features instead of 2 of 8: it runs, and computes something else
    with pytest.raises(NotProven, match="output differs from the global run's by up to"):
        verify(layer, sabotaged(num_heads=(4, 4), head_dim=(8, 4)), params, 2, [2, 8, 32])
    assert "equal the global run" in verify(layer, view, params, 2, [2, 8, 32])


#: Every local-view training of this module, ``(workload, dp)``, its plan made at dp x mp2 (with
#: the tests that read it); GPT-2's mp2 plan is trained a second time, its model built lazily.
TRAININGS = [
    # test_local_view_trains_like_one_device_with_half_the_heads
    ("zoo_gpt2_hf", 1),
    ("zoo_gpt2_hf", 2),
    # test_a_fused_mlp_local_view_trains_like_one_device_at_half_the_width
    ("zoo_pf_ernie45", 1),
    # test_attentions_taking_masks_and_positions_train_like_one_device_as_local_views
    ("zoo_gpt_neox_hf", 1),
    ("zoo_phi3_hf", 1),
    # test_attentions_paddle_cannot_keep_split_train_like_one_device_as_local_views
    ("zoo_mixtral_mistral_ref", 1),
    ("zoo_xlm_hf", 1),
    ("zoo_x_transformers", 1),
    # test_local_views_with_batch_inputs_train_like_one_device_at_dp2_mp2
    ("zoo_phi3_hf", 2),
    ("zoo_xlm_hf", 2),
    ("zoo_pf_ernie45", 2),
    # test_a_fused_multi_query_attention_trains_like_one_device_with_k_and_v_whole
    ("zoo_falcon_hf", 1),
    ("zoo_falcon_hf", 2),
    # test_attentions_scored_by_batched_products_train_like_one_device_as_local_views
    ("zoo_opt_hf", 1),
    ("zoo_gpt_bigcode_hf", 1),
    # test_attentions_whose_sizes_the_proof_finds_train_like_one_device_as_local_views
    ("zoo_internlm2_hf", 1),
    ("zoo_persimmon_hf", 1),
    ("zoo_chatglm3_hf", 1),
    ("zoo_baichuan_hf", 1),
]
LAZY = "zoo_gpt2_hf_dp1_local_view_lazy"
#: Fused weights whose checkpoints round trip: workload -> its segments (GPT-2's c_attn q|k|v,
#: ERNIE 4.5's up_gate_proj up|gate, Falcon's multi-query query_key_value q|k|v, held whole).
ROUND_TRIPS = {"zoo_gpt2_hf": 3, "zoo_pf_ernie45": 2, "zoo_falcon_hf": 3}
#: Checkpoints saved under the dp2 x mp2 ZeRO 1 local-view plan (AdamW's moments of the local
#: slices split over dp) and resumed on one device.
ZERO1_ROUND_TRIPS = ("zoo_falcon_hf", "zoo_gpt2_hf")


#: Trainings whose local views compose with more strategies, ``(workload, dp, COMPOSED key)``
#: (test_local_views_compose_with_accumulation_zero_and_recompute): GPT-2's fused q|k|v and
#: Falcon's multi-query one (K and V whole on every mp rank).
COMPOSED_TRAININGS = [
    (workload, dp, composed)
    for workload in ("zoo_gpt2_hf", "zoo_falcon_hf")
    for dp, composed in (
        (1, "m2"),
        (1, "recompute_full"),
        (1, "recompute_selective"),
        (2, "zero1"),
        (2, "zero2"),
        (2, "zero1_m2_recompute_full"),
    )
]


def _name(workload: str, dp: int, composed: str = "") -> str:
    return f"{workload}_dp{dp}{'_' * bool(composed)}{composed}_local_view"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    """Every training of this module, ``(plans, runs, outputs)`` by run name, in one launch per
    world size (see the module's docstring): the :data:`TRAININGS`, and for each of
    :data:`ROUND_TRIPS` AdamW, 2 steps saved under the local-view plan and under the default
    (gathered) one, each resumed for 1 step under the other and the local-view one on one device.
    The savers train beside the mp2 trainings; the loaders need their checkpoints, so they start
    a second pair of jobs, the one-process one also making every single-device reference."""
    workdir = tmp_path_factory.mktemp("local_view")
    plans: dict[str, Plan] = {}
    first: list[tuple[TrainRun, int]] = []
    for workload, dp, composed in [(*training, "") for training in TRAININGS] + COMPOSED_TRAININGS:
        name = _name(workload, dp, composed)
        plans[name] = _planned(WORKLOADS[workload].planner_target, dp, composed=composed)
        save_plan(plans[name], workdir / f"{name}.json")
        run = TrainRun(name, workload, plan=str(workdir / f"{name}.json"), **COMPOSED[composed][1])
        first.append((run, 2 * dp))
    # built under autodist.LazyGuard: apply_plan initialises the fused weights, then lays them out
    plans[LAZY] = plans[_name("zoo_gpt2_hf", 1)]
    first.append(
        (TrainRun(LAZY, "zoo_gpt2_hf", plan=str(workdir / f"{_name('zoo_gpt2_hf', 1)}.json"), build="autodist_lazy"), 2)
    )
    loads: list[tuple[TrainRun, int]] = []
    for workload in sorted(ROUND_TRIPS):
        target = WORKLOADS[workload].planner_target
        paths, checkpoints = {}, {}
        for layout in ("local", "gathered"):
            plans[f"{workload}_save_{layout}"] = _planned(target, local_view=layout == "local")
            paths[layout] = str(workdir / f"{workload}_{layout}.json")
            save_plan(plans[f"{workload}_save_{layout}"], paths[layout])
            checkpoints[layout] = str(workdir / f"{workload}_ckpt_{layout}")
        common = dict(workload=workload, optimizer="adamw")
        first += [
            (TrainRun(f"{workload}_save_{k}", plan=paths[k], steps=2, save_checkpoint=checkpoints[k], **common), 2)
            for k in paths
        ]
        resume = dict(steps=1, first_step=2, **common)
        plans[f"{workload}_gathered_from_local"] = plans[f"{workload}_save_gathered"]
        plans[f"{workload}_local_from_gathered"] = plans[f"{workload}_save_local"]
        loads += [
            (
                TrainRun(
                    f"{workload}_gathered_from_local",
                    plan=paths["gathered"],
                    load_checkpoint=checkpoints["local"],
                    **resume,
                ),
                2,
            ),
            (
                TrainRun(
                    f"{workload}_local_from_gathered",
                    plan=paths["local"],
                    load_checkpoint=checkpoints["gathered"],
                    **resume,
                ),
                2,
            ),
            (
                TrainRun(
                    f"{workload}_single_from_local", method="single", load_checkpoint=checkpoints["local"], **resume
                ),
                1,
            ),
        ]
    for workload in ZERO1_ROUND_TRIPS:
        name, checkpoint = _name(workload, 2, "zero1"), str(workdir / f"{workload}_ckpt_zero1")
        plans[f"{name}_save"] = plans[name]
        first.append(
            (
                TrainRun(
                    f"{name}_save",
                    workload,
                    plan=str(workdir / f"{name}.json"),
                    steps=2,
                    save_checkpoint=checkpoint,
                    **COMPOSED["zero1"][1],
                ),
                4,
            )
        )
        single = TrainRun(
            f"{name}_single", workload, "adamw", method="single", steps=1, first_step=2, load_checkpoint=checkpoint
        )
        loads.append((single, 1))
    outputs = train_by_world(first, workdir / "first", timeout_s=600.0)
    everything = [run for run, _ in first + loads]
    outputs.update(train_by_world(loads, workdir / "resumed", timeout_s=600.0, references=(reference_runs, everything)))
    return plans, {run.name: run for run in everything}, outputs


def _trained(trained, name: str) -> Trained:
    plans, runs, outputs = trained
    return Trained(runs[name], plans[name], outputs[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [1, 2])
def test_local_view_trains_like_one_device_with_half_the_heads(dp, local_plan, dp_plan, trained, reference_runs):
    """mp2 on 2 ranks, dp2 x mp2 on 4: losses and parameters as on one device, and every rank's
    attention scores hold 2 of the 4 heads (the gathered layout of the default plan: all 4)."""
    plan = local_plan if dp == 1 else dp_plan
    assert (plan.strategy.dp, plan.strategy.mp) == (dp, 2)
    names = [_name("zoo_gpt2_hf", dp)] + [LAZY] * (dp == 1)
    assert WORKLOADS["zoo_gpt2_hf"].planner_target.endswith("gpt2_hf.py")
    for name in names:
        run = _trained(trained, name)
        assert run.plan is plan
        check_against_reference(run, reference_runs)
        for output in run.outputs:
            heads = {shape[1] for shape in output["score_shapes"]}
            assert output["score_shapes"] and heads == {HEADS // 2}, output["score_shapes"]


def test_a_fused_gate_up_mlp_runs_as_a_local_view_without_its_gather():
    """Phi-3's MLP (``gate_up_proj`` cut by ``chunk(2)``) is proven like an attention: each rank
    holds ``gate_r|up_r`` and its rows of ``down_proj``; no size attribute to localise (``chunk``
    halves whatever it gets). It has no gather hook. (Gathered, the model is refused: its
    attention's rotary takes a zero-width slice, which segfaults Paddle on distributed tensors.)"""
    with pytest.raises(PlannerError, match="zero-width slice"):
        _planned(PHI3, local_view=False)
    plan = _planned(PHI3)
    views = {view.layer: view for view in plan.local_view}
    assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(views)
    view = views["model.layers.0.mlp"]
    weights = {w.param.removeprefix("model.layers.0.mlp."): (w.dim, w.segments, w.summed) for w in view.weights}
    assert weights == {"gate_up_proj.weight": (1, 2, False), "down_proj.weight": (0, 1, False)}
    assert view.attributes == [] and "equal the global run" in view.verified
    assert not [h for h in plan.hooks if h.layer.endswith("gate_up_proj")]


@pytest.mark.multiprocess
def test_a_fused_mlp_local_view_trains_like_one_device_at_half_the_width(trained, reference_runs):
    """ERNIE 4.5 (PaddleFormers), whose MLP holds ``self.intermediate_size`` but never reads it
    (``chunk`` halves whatever it gets): not localised, each rank's ``down_proj`` reads 32 of the
    64 intermediate features (the gathered layout: all 64 on every rank), and training matches one
    device. Its attention (``qkv_proj`` laid out KV group by KV group, cut by a reshape reading
    ``num_key_value_groups``, 2 as its KV heads, which stays whole) is a local view too, each
    rank's ``o_proj`` reading its 2 heads' 16 features."""
    run = _trained(trained, _name("zoo_pf_ernie45", 1))
    views = {view.layer: view for view in run.plan.local_view}
    assert sorted(views) == [f"model.layers.{i}.{sub}" for i in (0, 1) for sub in ("mlp", "self_attn")]
    assert views["model.layers.0.mlp"].attributes == []
    attention = [(a.name, a.whole, a.local) for a in views["model.layers.0.self_attn"].attributes]
    assert attention == [("num_heads", 4, 2), ("num_key_value_heads", 2, 1)]
    check_against_reference(run, reference_runs)
    for output in run.outputs:
        widths = output["linear_input_widths"]
        assert [widths[f"model.layers.{i}.mlp.down_proj"] for i in (0, 1)] == [[ERNIE_INTERMEDIATE // 2]] * 2, widths
        assert [widths[f"model.layers.{i}.self_attn.o_proj"] for i in (0, 1)] == [[4 * 8 // 2]] * 2, widths


def test_a_dist_parallelize_config_leaves_local_views_to_autodist(local_plan):
    """``dist.parallelize`` (the export, PaddleFormers' Trainer) would shard the fused weights in
    the model's own layout and run the sub-layer on DistTensors without its gather: its config
    leaves the local views' and the local lookup's parameters out, and names their layers for
    ``autodist.apply_local_views`` (tests/test_export.py trains such an export)."""
    from autodist.schemas.parallelize import local_parameters, parallelize_config

    config = parallelize_config(local_plan)
    assert config.local_layers[:1] == ["transformer.h.0.attn"] and "transformer.wte" in config.local_layers
    local = set(local_parameters(local_plan))
    assert "transformer.wte.weight" in local and any(name.endswith("attn.c_attn.weight") for name in local)
    local_layers = {name.rsplit(".", 1)[0] for name in local}
    assert not [entry.key for entry in config.entries if entry.key in local_layers]
    gathered_keys = {entry.key for entry in parallelize_config(_planned(GPT2, local_view=False)).entries}
    assert "transformer.h.0.attn.c_attn" in gathered_keys  # without local views the config holds it
    gathered = _planned(GPT2, local_view=False)
    assert not gathered.local_view and not gathered.vocab_lookup  # --no-local-view: the lookup too
    assert any("local tensors are off: --no-local-view" in note for note in gathered.notes), gathered.notes
    assert parallelize_config(gathered).entries and not parallelize_config(gathered).local_layers


def _with_attribute(plan, name: str, **changed):
    """``plan`` with attribute ``name`` of every local view changed (an edited, untrusted plan)."""
    views = [
        msgspec.structs.replace(
            view,
            attributes=[msgspec.structs.replace(a, **changed) if a.name == name else a for a in view.attributes],
        )
        for view in plan.local_view
    ]
    return msgspec.structs.replace(plan, local_view=views)


def test_check_proves_the_views_again(local_plan):
    assert check_plan_for_target(local_plan, GPT2, trace=False) == []
    # an attribute whose local value no longer runs: proven again, it fails
    reasons = check_plan_for_target(_with_attribute(local_plan, "num_heads", local=4), GPT2, trace=False)
    assert len(reasons) == 2 and all("no longer holds: running it failed" in r for r in reasons), reasons


def test_apply_plan_refuses_a_view_the_model_does_not_match(local_plan):
    model = load(GPT2).model
    assert local_view_problems(model, local_plan) == []
    problems = local_view_problems(model, _with_attribute(local_plan, "num_heads", whole=8))
    assert problems == [
        f"local_view transformer.h.{i}.attn: transformer.h.{i}.attn.num_heads should be the integer 8, the model has 4"
        for i in (0, 1)
    ]
    sequential = msgspec.structs.replace(local_plan.strategy, pp=2, schedule="sequential")
    pipelined = msgspec.structs.replace(local_plan, strategy=sequential)
    assert any(
        "does not run on local tensors with the sequential pipeline schedule" in p
        for p in local_view_problems(model, pipelined)
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "saver, resumer, plan",
    [
        ("save_local", "gathered_from_local", "gathered"),
        ("save_gathered", "local_from_gathered", "local"),
        ("save_local", "single_from_local", None),
    ],
)
@pytest.mark.parametrize("workload", sorted(ROUND_TRIPS))
def test_a_local_view_checkpoint_round_trips_in_the_models_own_layout(
    trained, reference_runs, workload, saver, resumer, plan
):
    """Saved under one layout, resumed under the other or on one device: like one uninterrupted
    device (AdamW, 2 steps saved, 1 resumed: the ``trained`` fixture)."""
    plans, runs, outputs = trained
    local = plans[f"{workload}_save_local"]
    fused = {w.segments for view in local.local_view for w in view.weights} - {1}
    assert fused == {ROUND_TRIPS[workload]}, local.local_view
    resumed_under = plans[f"{workload}_save_{plan}"] if plan else None
    assert_resumed_like_one_device(
        reference_runs, runs, outputs, f"{workload}_{saver}", f"{workload}_{resumer}", resumed_under
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", ZERO1_ROUND_TRIPS)
def test_a_zero1_local_view_checkpoint_resumes_on_one_device(trained, reference_runs, workload):
    """Saved under the dp2 x mp2 ZeRO 1 plan with local views (GPT-2's q|k|v held rank by rank,
    Falcon's multi-query one held whole; AdamW's moments split over dp on top), resumed on one
    device: like one uninterrupted device (2 steps saved, 1 resumed)."""
    plans, runs, outputs = trained
    name = _name(workload, 2, "zero1")
    assert plans[f"{name}_save"].strategy.sharding_stage == 1 and plans[f"{name}_save"].local_view
    assert_resumed_like_one_device(reference_runs, runs, outputs, f"{name}_save", f"{name}_single")


def test_a_forward_that_reads_widths_from_its_input_is_proven_reading_them_as_its_share():
    """nanoGPT's attention takes its head dim from the input, ``C // self.n_head``, and sizes its
    output with ``C``: with the whole input a rank reads the whole width, so it is proven with
    that read as 1/mp (``input_width`` ``local``), and its c_attn is not gathered."""
    target = "tests/models/zoo/nanogpt.py"
    plan = plan_target(target, None, _request(), {"target": target}, local_view=True).plan
    views = [v for v in plan.local_view if v.layer.endswith(".attn")]
    assert [(v.layer, v.input_width) for v in views] == [
        ("transformer.h.0.attn", "local"),
        ("transformer.h.1.attn", "local"),
    ]
    assert not [h for h in plan.hooks if h.action == "reshard" and h.layer.endswith("c_attn")]


def test_verification_leaves_the_layer_as_it_was(local_plan):
    model = load(GPT2).model
    view = local_plan.local_view[0]
    layer = dict(model.named_sublayers())[view.layer]
    layer.train()
    before = {id(p) for p in layer.parameters()}, layer.num_heads, layer.c_attn.nf
    verify(layer, view, {fqn: (p.shape, p.dtype) for fqn, p in local_plan.params.items()}, 2, [2, 8, 32])
    assert ({id(p) for p in layer.parameters()}, layer.num_heads, layer.c_attn.nf) == before
    assert layer.training and layer.attn_dropout.training


def test_a_sub_layer_too_large_to_prove_keeps_the_gather(monkeypatch):
    import autodist.planner.local_view_proof as local_view

    monkeypatch.setattr(local_view, "MAX_PROOF_ELEMENTS", 1000)  # GPT-2's attention weights: 4224
    plan = plan_target(GPT2, None, _request(), {"target": GPT2}).plan
    assert plan.local_view == []
    assert any("too large to prove on the planning machine" in note for note in plan.notes)


def test_a_forward_returning_hf_style_tuples(local_plan):
    """HF's attention returns ``(attn_output, present)``, ``present`` None without a cache: proven
    on its first item. Attention weights returned beside it hold only a rank's heads: not proven."""
    from models.zoo.gpt2_hf import GPT2Attention

    class WithoutCache(GPT2Attention):
        def forward(self, hidden_states):
            return super().forward(hidden_states), None

    class WithWeights(GPT2Attention):
        def forward(self, hidden_states):
            out = super().forward(hidden_states)
            return out, out.sum(-1)

    view = local_plan.local_view[0]
    params = {fqn: (p.shape, p.dtype) for fqn, p in local_plan.params.items()}
    assert "equal the global run" in verify(WithoutCache(), view, params, 2, [2, 8, 32])
    with pytest.raises(NotProven, match="returns more than one tensor"):
        verify(WithWeights(), view, params, 2, [2, 8, 32])


NEOX = "tests/models/zoo/gpt_neox_hf.py"
#: Read from the zoo files: what each attention is called with (role, keyword) and its row
#: projection's input width under mp2 (half of the heads' width).
CALLED = {
    # GPTNeoXLayer: self.attention(self.input_layernorm(hidden_states), position_ids), returning
    # (attn_output, attn_weights), of which the layer reads [0]; q, k, v interleaved head by head
    NEOX: (
        "gpt_neox.layers.{}.attention",
        [("hidden", ""), ("positions", "")],
        {"query_key_value.weight": 1, "query_key_value.bias": 1},
        "dense",
        32 // 2,
    ),
    # Phi3DecoderLayer: self.self_attn(hidden_states=..., attention_mask=..., position_ids=...),
    # unpacked as hidden_states, self_attn_weights (never read); q|k|v in three blocks
    PHI3: (
        "model.layers.{}.self_attn",
        [("hidden", "hidden_states"), ("tensor", "attention_mask"), ("positions", "position_ids")],
        {"qkv_proj.weight": 3},
        "o_proj",
        64 // 2,
    ),
}


@pytest.mark.parametrize("target", [NEOX, PHI3])
def test_an_attention_taking_a_mask_and_positions_is_a_local_view(target):
    """HF attentions take more than the hidden state and return their weights beside it: proven
    called as the trace called them, the weights returned as None (nothing reads them), the
    fused column's gather gone."""
    layer, roles, segments, _, _ = CALLED[target]
    plan = _planned(target)
    views = {view.layer: view for view in plan.local_view}
    assert {layer.format(i) for i in (0, 1)} <= set(views), sorted(views)
    view = views[layer.format(0)]
    assert [(c.role, c.keyword) for c in view.call] == roles
    assert view.dropped_outputs == [1]
    fused = {
        w.param.removeprefix(view.layer + "."): w.segments for w in view.weights if w.param.endswith(tuple(segments))
    }
    assert fused == segments
    assert "equal the global run" in view.verified
    assert not [h for h in plan.hooks if h.action == "reshard"]


def test_phi3_attention_localises_the_head_counts_its_config_holds():
    """HF Phi-3 cuts q at ``self.config.num_attention_heads * self.head_dim``: the config's head
    count is localised with the layer's own KV head count (the config's, which the forward never
    reads, is left alone); without the config's, the proof fails."""
    plan = _planned(PHI3)
    view = next(v for v in plan.local_view if v.layer == "model.layers.0.self_attn")
    assert {(a.name, a.whole, a.local) for a in view.attributes} == {
        ("num_key_value_heads", 4, 2),
        ("config.num_attention_heads", 4, 2),
    }
    model = load(PHI3).model
    layer = dict(model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    kept = [a for a in view.attributes if a.name != "config.num_attention_heads"]
    with pytest.raises(NotProven, match="running it failed"):
        verify(layer, msgspec.structs.replace(view, attributes=kept), params, 2, [2, 8, 64])


def test_an_extra_output_read_after_the_call_keeps_the_gather():
    """A decoder layer that reads the attention weights GPT-NeoX's attention returns: a local
    view would hand it only each rank's heads, so the attention keeps its gather, with one note."""
    import paddle

    from autodist.planner.driver import plan_model
    from models.zoo import gpt_neox_hf

    class ReadingWeights(gpt_neox_hf.GPTNeoXLayer):
        def forward(self, hidden_states, position_ids):
            out, weights = self.attention(self.input_layernorm(hidden_states), position_ids)
            return hidden_states + out + self.mlp(self.post_attention_layernorm(hidden_states)) + weights.mean()

    with paddle.LazyGuard():
        model = gpt_neox_hf.build_model()
        model.gpt_neox.layers = paddle.nn.LayerList([ReadingWeights() for _ in range(2)])
    plan = plan_model(model, gpt_neox_hf.input_spec(), _request(), {"target": NEOX}, local_view=True).plan
    assert plan.local_view == []
    notes = [note for note in plan.notes if note.startswith("local view: gpt_neox.layers.0.attention")]
    assert len(notes) == 1 and "item 1 of its output, a tensor beside the hidden state, is read after it" in notes[0]
    assert {h.layer for h in plan.hooks if h.action == "reshard"} == {
        f"gpt_neox.layers.{i}.attention.query_key_value" for i in (0, 1)
    }


def test_a_local_view_refuses_a_call_other_than_the_proven_one():
    """The applier checks each call against the plan's: another keyword, or a literal changed
    (HF's ``output_attentions=True`` would read the per-head weights), is refused."""
    from autodist.applier.modes.local_calls import _called_as_proven
    from autodist.schemas import CallInput, LocalView

    view = LocalView(
        layer="attn",
        weights=[],
        call=[CallInput(role="hidden"), CallInput(role="literal", keyword="output_attentions", value=False)],
    )
    assert _called_as_proven(view, ("h",), {"output_attentions": False}, None, None) == (
        ("h",),
        {"output_attentions": False},
    )
    with pytest.raises(RuntimeError, match="got output_attentions=True; the plan proved it with False"):
        _called_as_proven(view, ("h",), {"output_attentions": True}, None, None)
    with pytest.raises(
        RuntimeError, match=r"keywords \['mask'\]; the plan proved it with 1 and \['output_attentions'\]"
    ):
        _called_as_proven(view, ("h",), {"mask": None}, None, None)


@pytest.mark.multiprocess
def test_attentions_taking_masks_and_positions_train_like_one_device_as_local_views(trained, reference_runs):
    """GPT-NeoX and Phi-3 at mp2 on 2 gloo ranks, their attentions local views: losses and
    parameters as one device, each rank's output projection reading half of the heads' width
    (Phi-3's gathered plan does not train at all: Paddle's slice_grad of its rotary's empty slice
    of a DistTensor segfaults, docs/paddle-notes.md; under the local view it runs on plain tensors)."""
    cases = {"zoo_gpt_neox_hf": NEOX, "zoo_phi3_hf": PHI3}
    rows = {w: ([CALLED[t][0].format(i) for i in (0, 1)], *CALLED[t][3:]) for w, t in cases.items()}
    _trained_at_half_width(trained, rows, reference_runs)


def _trained_at_half_width(trained, rows: dict, reference_runs, dp: int = 1) -> None:
    """Each workload of ``rows``, its local-view plan at dp x mp2 trained on ``2 * dp`` gloo
    ranks (by the ``trained`` fixture): losses and parameters as one device, and the row
    projection of each sub-layer (``rows[workload]``: the sub-layers, the row's name, its input
    width on one rank) reading that width."""
    for workload, (layers, row, width) in rows.items():
        run = _trained(trained, _name(workload, dp))
        assert (run.plan.strategy.dp, run.plan.strategy.mp) == (dp, 2)
        check_against_reference(run, reference_runs)
        for output in run.outputs:
            widths = output["linear_input_widths"]
            assert [widths[f"{layer}.{row}"] for layer in layers] == [[width]] * len(layers), widths


MISTRAL = "tests/models/zoo/mixtral_mistral_ref.py"
XLM = "tests/models/zoo/xlm_hf.py"
X_TRANSFORMERS = "tests/models/zoo/x_transformers.py"
#: target -> (workload, its attentions, their row projection, the heads' width on one rank, the
#: call's (role, dtype)), read from the models: Mistral's ModelArgs 4 heads x 8, called with the
#: complex freqs_cis and the additive mask; XLM's 32-wide attention over 4 heads, called with its
#: bool causal mask; x-transformers' Decoder(dim=32, heads=4, attn_dim_head=8), its attentions
#: every other layer, called with mask=None and return_intermediates=True (the Intermediates it
#: returns, read by nothing, dropped).
STOPPED = {
    MISTRAL: (
        "zoo_mixtral_mistral_ref",
        ["layers.0.attention", "layers.1.attention"],
        "wo",
        4 * 8 // 2,
        [("hidden", "float32"), ("tensor", "complex64"), ("tensor", "float32")],
    ),
    XLM: (
        "zoo_xlm_hf",
        ["transformer.attentions.0", "transformer.attentions.1"],
        "out_lin",
        32 // 2,
        [("hidden", "float32"), ("mask", "bool")],
    ),
    X_TRANSFORMERS: (
        "zoo_x_transformers",
        ["attn_layers.layers.0.1", "attn_layers.layers.2.1"],
        "to_out",
        4 * 8 // 2,
        [("hidden", "float32"), ("literal", ""), ("literal", "")],
    ),
}


@pytest.mark.multiprocess
def test_attentions_paddle_cannot_keep_split_train_like_one_device_as_local_views(trained, reference_runs):
    """Mistral's reference attention rotates q and k by complex multiplication (``as_complex``),
    XLM's masks its scores by ``masked_fill``, x-transformers' scores and mixes by ``einsum``:
    none of these ops has an SPMD rule (Paddle's global view would gather the heads there, and
    does not run einsum at all). Planned at mp2, their q/k/v are split by columns and the
    output projection by rows only as local views, proven called as the trace called them. On 2
    gloo ranks: losses and parameters as one device, each rank's output projection reading half
    of the heads' width."""
    plans = trained[0]
    for workload, layers, _, _, call in STOPPED.values():
        views = {view.layer: view for view in plans[_name(workload, 1)].local_view}
        assert sorted(views) == layers
        assert [(c.role, c.dtype) for c in views[layers[0]].call] == call
    _trained_at_half_width(trained, {workload: rows for workload, *rows, _ in STOPPED.values()}, reference_runs)


#: workload -> (its local views, the call inputs cut to the rank's dp rows, the sub-layers whose row
#: projection is checked, that projection, its input width on one rank), read from the models:
#: Phi-3's attention is called with create_causal_mask's ``[batch, 1, q, kv]`` mask (the batch's
#: rows) and ``position_ids`` ``[1, seq]`` (not), its MLP a fused gate|up (64 x 2 features); XLM's
#: attention with get_masks' ``[bs, slen, slen]`` bool mask, scored by masked_fill; ERNIE 4.5's
#: MLP a fused up|gate, ``self.intermediate_size`` 64, its attention called with a ``[batch, 1, q,
#: kv]`` mask.
DP_MP = {
    "zoo_phi3_hf": (
        [f"model.layers.{i}.{sub}" for i in (0, 1) for sub in ("mlp", "self_attn")],
        {"attention_mask"},
        ["model.layers.0.self_attn", "model.layers.1.self_attn"],
        "o_proj",
        64 // 2,
    ),
    "zoo_xlm_hf": (
        ["transformer.attentions.0", "transformer.attentions.1"],
        {"argument 1"},
        ["transformer.attentions.0", "transformer.attentions.1"],
        "out_lin",
        32 // 2,
    ),
    "zoo_pf_ernie45": (
        [f"model.layers.{i}.{sub}" for i in (0, 1) for sub in ("mlp", "self_attn")],
        {"attention_mask"},
        ["model.layers.0.mlp", "model.layers.1.mlp"],
        "down_proj",
        ERNIE_INTERMEDIATE // 2,
    ),
}


@pytest.mark.multiprocess
def test_local_views_with_batch_inputs_train_like_one_device_at_dp2_mp2(trained, reference_runs):
    """Phi-3 (an attention taking a batch-shaped mask and positions, and a fused gate|up MLP),
    XLM (masked_fill, which has no SPMD rule) and ERNIE 4.5 (a fused up|gate MLP) planned at
    dp2 x mp2 as local views, trained on 4 gloo ranks: each rank's attention takes
    its dp rows of the batch-shaped mask (whole, it would not broadcast against the rank's scores),
    its row projection reads half of the width, and losses and parameters match one device."""
    for workload, (layers, batched, *_) in DP_MP.items():
        plan = trained[0][_name(workload, 2)]
        assert sorted(v.layer for v in plan.local_view) == layers
        calls = [view.call for view in plan.local_view]
        cut = {
            c.keyword or f"argument {i}" for call in calls for i, c in enumerate(call) if c.batch and c.role != "hidden"
        }
        assert cut == batched, calls
    rows = {workload: tuple(rows) for workload, (_, _, *rows) in DP_MP.items()}
    _trained_at_half_width(trained, rows, reference_runs, dp=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [1, 2])
def test_a_fused_multi_query_attention_trains_like_one_device_with_k_and_v_whole(dp, trained, reference_runs):
    """HF Falcon's ``query_key_value`` (q of 4 heads, then one K and one V head) as Megatron's
    local view at dp x mp2: the weight held whole over mp, each rank computing with its 2 query
    heads' columns and the whole K and V, the K and V columns' gradient summed over mp. On
    ``2 * dp`` gloo ranks: losses and parameters as one device, each rank's ``dense`` reading the
    2 heads' 16 features (tests/models/zoo/falcon_hf.py: 4 heads of 8)."""
    plan = trained[0][_name("zoo_falcon_hf", dp)]
    layers = [f"transformer.h.{i}.self_attention" for i in (0, 1)]
    assert [view.layer for view in plan.local_view] == layers
    assert [w.replicated for w in plan.local_view[0].weights] == [[1, 2], []]
    _trained_at_half_width(trained, {"zoo_falcon_hf": (layers, "dense", 4 * 8 // 2)}, reference_runs, dp=dp)


@pytest.mark.multiprocess
def test_attentions_scored_by_batched_products_train_like_one_device_as_local_views(trained, reference_runs):
    """HF OPT scores and mixes by ``bmm`` over ``[bsz * heads, tgt, head_dim]``; HF GPT-BigCode by
    ``baddbmm`` and ``bmm`` of the query reshaped to ``[batch, q_len * heads, head_dim]`` against
    its one K/V head, fused with q in ``c_attn``. Both are attentions of 4 heads of 8 and, at mp2,
    local views: OPT's q/k/v split by columns, BigCode's ``c_attn`` held whole (each rank its 2
    query heads' columns and the whole K and V, as Falcon's). On 2 gloo ranks: losses and
    parameters as one device, each rank's output projection reading the 2 heads' 16 features."""
    plans = trained[0]
    rows = {
        "zoo_opt_hf": ([f"model.decoder.layers.{i}.self_attn" for i in (0, 1)], "out_proj", 4 * 8 // 2),
        "zoo_gpt_bigcode_hf": ([f"transformer.h.{i}.attn" for i in (0, 1)], "c_proj", 4 * 8 // 2),
    }
    for workload, (layers, _, _) in rows.items():
        assert [view.layer for view in plans[_name(workload, 1)].local_view] == layers
    assert [w.replicated for w in plans[_name("zoo_gpt_bigcode_hf", 1)].local_view[0].weights] == [
        [1, 2],
        [1, 2],
        [],
        [],
    ]
    _trained_at_half_width(trained, rows, reference_runs)


#: workload -> (its attentions, their row projection, its input width on one rank, whether its
#: scores are a 4-D paddle.matmul the run records), read from the models: InternLM2 4 heads of 8
#: over 2 KV groups (``num_key_value_groups`` 2 stays whole), Persimmon 4 heads of 8 with a
#: rotary width of 4 (``rotary_ndims`` stays whole), ChatGLM3 4 heads of 8 over 2 groups, its
#: scores by ``baddbmm`` in the child ``core_attention``, whose ``hidden_size_per_partition`` is
#: halved and whose ``coeff`` (2 in layer 2) stays whole; Baichuan 7B 4 heads of 8 packed in
#: ``W_pack``, its ``hidden_size`` (32, the model's width too) halved.
FOUND = {
    "zoo_internlm2_hf": ([f"model.layers.{i}.attention" for i in (0, 1)], "wo", 4 * 8 // 2, True),
    "zoo_persimmon_hf": ([f"model.layers.{i}.self_attn" for i in (0, 1)], "dense", 4 * 8 // 2, True),
    "zoo_baichuan_hf": ([f"model.layers.{i}.self_attn" for i in (0, 1)], "o_proj", 4 * 8 // 2, True),
    "zoo_chatglm3_hf": (
        [f"transformer.encoder.layers.{i}.self_attention" for i in (0, 1)],
        "dense",
        4 * 8 // 2,
        False,
    ),
}


@pytest.mark.multiprocess
def test_attentions_whose_sizes_the_proof_finds_train_like_one_device_as_local_views(trained, reference_runs):
    """InternLM2 (a KV-group count equal to the KV heads), Persimmon (a rotary width equal to the
    heads), ChatGLM3 (sizes held by a child core attention, a layer number equal to the KV
    groups) and Baichuan 7B (``W_pack`` cut by ``unflatten``) planned at mp2, their attentions
    local views with the sizes the proof found (tests/test_local_view_sizes.py): on 2 gloo ranks,
    losses and parameters as one device, each rank's output projection reading half of the
    heads' width and, where the scores are a 4-D matmul, each rank's scores holding 2 of the 4
    heads."""
    plans = trained[0]
    for workload, (layers, _, _, scored) in FOUND.items():
        assert [v.layer for v in plans[_name(workload, 1)].local_view if v.layer in layers] == layers
        if scored:
            for output in _trained(trained, _name(workload, 1)).outputs:
                heads = {shape[1] for shape in output["score_shapes"]}
                assert output["score_shapes"] and heads == {HEADS // 2}, output["score_shapes"]
    _trained_at_half_width(trained, {w: rows[:3] for w, rows in FOUND.items()}, reference_runs)


@pytest.mark.multiprocess
def test_local_views_compose_with_accumulation_zero_and_recompute(trained, reference_runs):
    """GPT-2 (a fused q|k|v held rank by rank) and Falcon (a multi-query q|k|v held whole) with
    their attentions as local views and the token lookup on local tensors, as Megatron composes
    them: 2 micro-batches of accumulation at mp2, full and selective recompute at mp2, ZeRO stages 1 and 2 at dp2 x mp2
    (AdamW's moments of the local slices split over dp), and all three at once at dp2 x mp2. On
    gloo ranks: losses and parameters as one device, each rank's attention on 2 of the 4 heads
    (GPT-2's scores; Falcon's ``dense`` reading the 2 heads' 16 features). GPT-2's attention runs
    once per micro-batch, on its rows of the batch, and again in the backward under full or
    selective recompute: counted against the plain mp2 run's products (one micro-batch of 4 rows,
    no recompute). Selective recompute runs the attention again on local tensors without its
    all-reduces (Megatron's way; full recompute runs the whole block, all-reduces too): as many
    sums over the mp line as the plain run."""
    plain_run = _trained(trained, _name("zoo_gpt2_hf", 1)).outputs[0]
    plain = plain_run["score_shapes"]
    for workload, dp, composed in COMPOSED_TRAININGS:
        run = _trained(trained, _name(workload, dp, composed))
        strategy = run.plan.strategy
        asked = COMPOSED[composed][0]
        assert {field: getattr(strategy, field) for field in asked} == asked, run.run.name
        assert [view.layer for view in run.plan.local_view] == COMPOSED_VIEWS[workload]
        assert len(run.plan.vocab_lookup) == 1
        check_against_reference(run, reference_runs)
        runs = strategy.micro_batches * (2 if strategy.recompute != "none" else 1)  # selective: the attention
        rows = plain[0][0] // (dp * strategy.micro_batches)
        for output in run.outputs:
            if workload == "zoo_gpt2_hf":
                shapes = output["score_shapes"]
                assert len(shapes) == runs * len(plain) and {(s[0], s[1]) for s in shapes} == {(rows, HEADS // 2)}
                if composed.startswith("recompute"):  # selective: the view's all-reduces run once
                    more = output["mp_sums"] - plain_run["mp_sums"]
                    assert (more > 0) == (composed == "recompute_full"), (composed, output["mp_sums"])
            else:
                widths = output["linear_input_widths"]
                assert [widths[f"{layer}.dense"] for layer in COMPOSED_VIEWS[workload]] == [[16]] * 2, widths
