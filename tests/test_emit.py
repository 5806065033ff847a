"""build_plan on real traced models: placements, stages, hooks, data plan, notes, CNN fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.planning import plan_target
from autodist.planner.emit import build_mesh
from autodist.schemas.schedules import block_stages
from autodist.planner.cost.search import SearchRequest
from autodist.schemas import Strategy, check_plan

ROOT = Path(__file__).resolve().parents[1]
DOCSTRING = str(ROOT / "plans" / "llama_docstring" / "model.py")
MODELS = ROOT / "tests" / "models"
TINY = dict(VOCAB_SIZE=64, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_HEADS=4, NUM_LAYERS=2, SEQ_LENGTH=16)
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


@pytest.fixture
def tiny(monkeypatch):
    """The docstring model at test size; ``tiny(NUM_LAYERS=3)`` changes a size."""

    def configure(**sizes):
        for field, value in {**TINY, **sizes}.items():
            monkeypatch.setenv(f"LLAMA_DOCSTRING_{field}", str(value))

    configure()
    return configure


def plan_docstring(**degrees):
    devices = degrees.pop("devices")
    request = SearchRequest(devices_per_node=devices, **degrees)
    return plan_target(DOCSTRING, None, request, {"target": "model.py"})


def test_dp2_mp2_placements(tiny):
    made = plan_docstring(devices=4, dp=2, mp=2, pp=1, sequence_parallel=False)
    plan = made.plan
    assert (plan.mesh.axes, plan.mesh.shape, plan.mesh.process_ids) == (["dp", "mp"], [2, 2], [0, 1, 2, 3])
    assert check_plan(plan) == []
    for i in range(2):
        for name in COLUMN:
            param = plan.params[f"layers.{i}.{name}.weight"]
            assert (param.placements, param.style) == (["R", "S(1)"], "ColWiseParallel")
        for name in ROW:
            param = plan.params[f"layers.{i}.{name}.weight"]
            assert (param.placements, param.style) == (["R", "S(0)"], "RowWiseParallel")
        for norm in ("input_layernorm", "post_attn_layernorm"):
            assert plan.params[f"layers.{i}.{norm}.weight"].placements == ["R", "R"]
    # The embedding is split over the vocabulary, the [hidden, vocab] head over its columns.
    assert (plan.params["embed_tokens.weight"].placements, plan.params["embed_tokens.weight"].style) == (
        ["R", "S(0)"],
        "VocabParallelEmbedding",
    )
    assert (plan.params["weight"].placements, plan.params["weight"].style) == (["R", "S(1)"], "ColWiseParallelHead")
    assert plan.params["norm.weight"].placements == ["R", "R"]
    assert set(plan.params) == set(made.analysis.params)
    assert plan.data.shard_axes == ["dp"] and (plan.data.input_stage, plan.data.label_stage) == (0, 0)
    assert [b.layer for b in plan.blocks] == ["layers.0", "layers.1"]
    assert not any(h.action == "stage_handoff" for h in plan.hooks)
    assert plan.provenance.arguments == {"target": "model.py", "dtype": "fp32"}  # the priced dtype: the model's
    assert plan.model.class_name == "Model" and plan.model.input_specs[0].shape == [4, 16]


def test_pipeline_stages_and_handoffs(tiny):
    tiny(NUM_LAYERS=3)
    plan = plan_docstring(devices=2, dp=1, mp=1, pp=2).plan
    assert plan.mesh.axes == ["pp"] and plan.strategy.schedule != "none"
    assert [b.stage for b in plan.blocks] == [0, 0, 1]
    assert plan.params["embed_tokens.weight"].stage == 0
    assert plan.params["layers.1.mlp.up_proj.weight"].stage == 0
    assert plan.params["layers.2.self_attn.q_proj.weight"].stage == 1
    assert plan.params["norm.weight"].stage == 1 and plan.params["weight"].stage == 1
    handoffs = [h for h in plan.hooks if h.action == "stage_handoff"]
    assert [(h.layer, h.when, h.to_stage) for h in handoffs] == [("layers.1", "post", 1)]
    assert (plan.data.input_stage, plan.data.label_stage) == (0, 1)
    assert plan.data.shard_axes == []
    assert all(p.placements == ["R"] for p in plan.params.values())


def test_sequence_parallel_hooks_wrap_every_block(tiny):
    plan = plan_docstring(devices=2, dp=1, mp=2, pp=1, sequence_parallel=True).plan
    assert plan.strategy.sequence_parallel
    sp = [
        (h.layer, h.when, h.action, getattr(h, "placements", []))
        for h in plan.hooks
        if h.action != "reshard" or h.reason.startswith(("position", "back"))
    ]
    assert sp[0] == ("embed_tokens", "post", "sequence_parallel_begin", [])
    assert sp[-1] == ("norm", "post", "sequence_parallel_end", [])
    for i in range(2):
        assert (f"layers.{i}.self_attn", "pre", "sequence_parallel_end", []) in sp
        assert (f"layers.{i}.self_attn", "post", "sequence_parallel_begin", []) in sp
        assert (f"layers.{i}.mlp", "pre", "reshard", ["R"]) in sp
        assert (f"layers.{i}.mlp", "post", "reshard", ["S(0)"]) in sp
    assert check_plan(plan) == []


def test_vocabulary_that_does_not_divide_stays_replicated(tiny):
    tiny(VOCAB_SIZE=65)
    plan = plan_docstring(devices=2, dp=1, mp=2, pp=1).plan
    assert plan.params["embed_tokens.weight"].placements == ["R"]
    assert plan.params["weight"].placements == ["R"]
    assert plan.params["layers.0.self_attn.q_proj.weight"].placements == ["S(1)"]
    assert any("65" in note and "embed_tokens.weight" in note for note in plan.notes)


def test_cnn_gets_a_data_parallel_plan():
    made = plan_target(
        f"{MODELS / 'paddleformers_models.py'}:build_cnn",
        ["images:float32:8x3x8x8"],
        SearchRequest(devices_per_node=4),
        {"target": "cnn"},
    )
    plan = made.plan
    assert (plan.strategy.dp, plan.strategy.mp, plan.strategy.pp) == (4, 1, 1)
    assert plan.blocks == [] and plan.data.shard_axes == ["dp"]
    assert plan.data.global_batch_size == 8  # the input spec's batch, what the loader yields per step
    assert all(p.placements == ["R"] and p.style == "Replicate" for p in plan.params.values())
    assert check_plan(plan) == []


def test_one_device_mesh_keeps_a_dp_axis():
    mesh = build_mesh(Strategy())
    assert (mesh.axes, mesh.shape, mesh.process_ids) == (["dp"], [1], [0])
    mesh = build_mesh(Strategy(dp=2, mp=2, pp=2))
    assert (mesh.axes, mesh.shape, mesh.process_ids) == (["pp", "dp", "mp"], [2, 2, 2], list(range(8)))


@given(st.integers(1, 100), st.integers(1, 16))
def test_block_stages_are_contiguous_and_even(blocks, pp):
    if pp > blocks:
        return
    stages = block_stages(blocks, pp)
    counts = [stages.count(s) for s in range(pp)]
    assert len(stages) == blocks and stages == sorted(stages)
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    assert counts == sorted(counts, reverse=True)  # earlier stages take the extra blocks


@pytest.mark.slow
def test_paddleformers_llama_from_its_causal_lm_class():
    made = plan_target(
        f"{MODELS / 'paddleformers_models.py'}:build_untied_llama",
        ["input_ids:int64:2x8"],
        SearchRequest(devices_per_node=4, dp=1, mp=2, pp=2, micro_batches=2),
        {"target": "llama"},
    )
    plan = made.plan
    assert plan.model.traced_layer == "" and plan.mesh.axes == ["pp", "mp"]
    assert plan.params["model.layers.0.self_attn.k_proj.weight"].placements == ["R", "S(1)"]
    assert plan.params["model.layers.1.mlp.down_proj.weight"].stage == 1
    assert plan.strategy.schedule == "1F1B"  # cut at its blocks, though not a paddle.nn.Sequential
    embedding, head = plan.params["model.embed_tokens.weight"], plan.params["lm_head.weight"]
    assert (embedding.placements, embedding.stage) == (["R", "S(0)"], 0)
    assert head.stage == 1 and head.style == "ColWiseParallelHead"
    assert check_plan(plan) == []


def test_tied_paddleformers_llama_keeps_one_weight_and_copies_it_to_the_last_stage():
    target = f"{MODELS / 'paddleformers_models.py'}:build_llama"
    plan = plan_target(
        target, ["input_ids:int64:2x8"], SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1), {"target": "llama"}
    ).plan
    embedding = plan.params["model.embed_tokens.weight"]
    assert (embedding.placements, embedding.tied_to, embedding.tied_stages) == (["S(0)"], ["lm_head.weight"], {})
    assert "lm_head.weight" not in plan.params  # one Parameter, planned once
    piped = plan_target(
        target, ["input_ids:int64:2x8"], SearchRequest(devices_per_node=2, dp=1, mp=1, pp=2), {"target": "llama"}
    ).plan
    embedding = piped.params["model.embed_tokens.weight"]
    assert (embedding.stage, embedding.tied_stages) == (0, {"lm_head.weight": 1})
    assert piped.strategy.schedule == "1F1B" and check_plan(piped) == []
    assert any("holds a copy" in note for note in piped.notes)


def test_fused_qkv_gets_a_gather_hook_with_one_placement_per_mesh_axis():
    made = plan_target(
        str(MODELS / "gpt.py"),
        None,
        SearchRequest(devices_per_node=4, dp=2, mp=2, pp=1, sequence_parallel=False),
        {"target": "gpt"},
    )
    plan = made.plan
    gathers = [h for h in plan.hooks if h.action == "reshard"]
    assert {h.layer for h in gathers} == {f"blocks.{i}.attn.qkv_proj" for i in range(2)}
    for hook in gathers:
        assert hook.when == "post" and len(hook.placements) == len(plan.mesh.axes)
    qkv = next(p for fqn, p in plan.params.items() if fqn.endswith("qkv_proj.weight"))
    qkv_bias = next(p for fqn, p in plan.params.items() if fqn.endswith("qkv_proj.bias"))
    assert (qkv.placements, qkv_bias.placements) == (["R", "S(1)"], ["R", "S(0)"])
    row_bias = next(p for fqn, p in plan.params.items() if fqn.endswith("out_proj.bias"))
    assert row_bias.placements == ["R", "R"]
    assert check_plan(plan) == []


@pytest.mark.slow
def test_sequence_parallel_fused_gathers_follow_the_layout_they_see():
    made = plan_target(
        f"{MODELS / 'paddleformers_models.py'}:build_gemma3",
        ["input_ids:int64:2x8"],
        SearchRequest(devices_per_node=4, dp=2, mp=2, pp=1, sequence_parallel=True),
        {"target": "gemma3"},
    )
    gathers = {h.layer: h.placements for h in made.plan.hooks if h.action == "reshard" and h.layer.endswith("_proj")}
    # Attention runs on [b, s, h] (batch dim 0 over dp), the MLP on [s, b, h] (batch dim 1).
    assert gathers == {
        "model.layers.0.self_attn.qkv_proj": ["S(0)", "R"],
        "model.layers.1.self_attn.qkv_proj": ["S(0)", "R"],
        "model.layers.0.mlp.up_gate_proj": ["S(1)", "R"],
        "model.layers.1.mlp.up_gate_proj": ["S(1)", "R"],
    }
    assert check_plan(made.plan) == []


def test_implicit_communication_is_one_figure_the_plans_list_and_its_price_agree():
    """The fused q|k|v gathers are the plan's own reshard hooks, priced as mp communication;
    what Paddle would add on its own is listed in implicit_comm and priced as comm_bytes.implicit,
    both from one SPMD replay with the plan's hooks (before: an empty list beside 2.7 GB)."""
    from autodist.planner.cost.graph_cost import implicit_collectives, model_cost

    made = plan_target(
        str(MODELS / "gpt.py"),
        None,
        SearchRequest(devices_per_node=4, dp=2, mp=2, pp=1, sequence_parallel=False),
        {"target": "gpt"},
    )
    plan = made.plan
    gathers = [h for h in plan.hooks if h.action == "reshard"]
    assert gathers and plan.implicit_comm == []
    assert plan.estimate.comm_bytes.implicit == 0
    priced = implicit_collectives(made.analysis, mp=2, dtype_bytes=2)
    assert priced.count == 0 and list(priced.entries) == plan.implicit_comm
    # the hooks' gathers are the blocks' own, one per hook
    assert sum(b.gather_fwd_count for b in model_cost(made.analysis).blocks) == len(gathers)


def test_a_view_that_fails_its_proof_is_priced_gathered_in_the_written_plan(monkeypatch):
    """tests/models/gpt.py's attention reads its width from the input (``b, s, h = x.shape``); with
    that read kept whole (the proof's 1/mp read of it turned off here), its local view fails the
    proof and its qkv_proj stays gathered. The search priced it as a local
    view (dp2 x mp2 runs local views; nothing is proven while searching); once the proof fails the
    search runs again with it gathered: the plan's strategy, estimate and alternatives are those
    of the plan made without local views, but for the token lookup, which --no-local-view keeps
    global too: the [64, 32] bf16 table (4096 bytes) all-gathered twice, each rank sending half
    (4096 bytes), instead of one all-reduce of the output of a dp rank's 8 tokens (8 x 32 x 2 =
    512 bytes, each rank sending 2 x (2 - 1) / 2 of it), and the gathered table and its whole
    gradient held (2 x 4096 bytes)."""
    from autodist.planner.cost.search import kernels_for, price, search

    from autodist.planner import local_view_proof

    monkeypatch.setattr(local_view_proof, "input_width_reads", lambda layer: "")
    request = SearchRequest(devices_per_node=4, mp=2, pp=1, sequence_parallel=False, sharding_stage=0, dtype="bf16")
    made = plan_target(str(MODELS / "gpt.py"), None, request, {"target": "gpt"}, local_view=True)
    assert made.plan.local_view == [] and any("stay global" in note for note in made.plan.notes)
    without = plan_target(str(MODELS / "gpt.py"), None, request, {"target": "gpt"}, local_view=False).plan
    assert made.plan.strategy == without.strategy and made.plan.vocab_lookup and not without.vocab_lookup
    mine, theirs = made.plan.estimate, without.estimate
    assert theirs.comm_bytes.mp - mine.comm_bytes.mp == 4096 - 512
    assert theirs.memory.activations - mine.memory.activations == 2 * 4096
    assert (mine.memory.params, mine.comm_bytes.dp) == (theirs.memory.params, theirs.comm_bytes.dp)
    assert [a.strategy for a in made.plan.alternatives.accepted] == [a.strategy for a in without.alternatives.accepted]
    assumed = search(price(made.analysis, kernels_for(made.analysis, request), local_view=True), request)
    assert assumed.best.strategy == made.plan.strategy
    assert assumed.best.estimate.comm_bytes.mp < made.plan.estimate.comm_bytes.mp  # no gathers assumed
