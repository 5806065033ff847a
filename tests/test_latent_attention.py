"""Multi-head latent attention split as Megatron splits it (issue #30, item 6).

DeepSeek-V3's attention (tests/models/zoo/deepseek_v3_hf.py, HF's modeling code) projects the
hidden state down to a small latent (``kv_a_proj_with_mqa``, whose output is cut into the latent
and one rotary key shared by every head), normalises the latent (``kv_a_layernorm``) and projects
it up to the heads' keys and values (``kv_b_proj``). Megatron keeps the down-projection whole on
every rank (the norm then runs whole on the small latent), splits the up-projection and
``q_proj`` by heads (columns) and ``o_proj`` by rows. Before, the planner split the
down-projection by columns and gathered its output after it (a fused column), and gathered
``kv_b_proj``'s too.

Here: the roles found by dataflow (a column whose output another column of the group contracts),
what Paddle's SPMD rules make of the attention under them, what the cost model charges against
the gathered layout, and the training on two gloo ranks against one device (tests/test_zoo.py
holds the model's placements; tests/test_train_zoo.py trains it with the whole zoo).
"""

from __future__ import annotations

from dataclasses import replace

import paddle
import pytest

from autodist.planner.cost.comm import all_gather_bytes
from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.cost.step_time import Setup, StageTable, estimate
from autodist.planner.recognise.match import constant_nodes
from autodist.planner.recognise.reshards import implicit_comm, weight_dists
from autodist.planner.recognise.spmd import Replay
from autodist.schemas import Strategy, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_distributed

TARGET = "tests/models/zoo/deepseek_v3_hf.py"
ATTENTION = "model.layers.{}.self_attn"
#: Read from the model file: 4 heads; q_proj [32, 4 * 12]; kv_a_proj_with_mqa [32, 16 + 4] (the
#: latent of kv_lora_rank 16 and the shared rotary key of 4); kv_b_proj [16, 4 * (8 + 8)]
#: (each head's key without rotary and its value); o_proj [4 * 8, 32].
HEADS, LATENT, ROPE = 4, 16, 4


def _planned(mp: int = 2):
    request = SearchRequest(devices_per_node=mp, dp=1, mp=mp, pp=1, sequence_parallel=False)
    return plan_target(TARGET, None, request, {"target": TARGET})


def test_the_down_projection_is_whole_the_up_projection_and_q_by_heads_o_by_rows():
    made = _planned()
    attention = made.analysis.blocks[0].sublayers[0]
    assert (attention.kind, attention.num_heads, attention.num_kv_heads) == ("attention", HEADS, HEADS)
    roles = {p.layer.rpartition(".")[2]: p.role for p in attention.projections}
    assert roles == {"q_proj": "column", "kv_a_proj_with_mqa": "replicate", "kv_b_proj": "column", "o_proj": "row"}
    assert attention.description == "attention(q|latent|kv)"
    assert [h for h in made.plan.hooks if h.action == "reshard"] == []  # nothing gathered
    assert implicit_comm(made.analysis, mp=2) == []


def test_the_attention_core_keeps_the_heads_split_against_the_whole_rotary_key():
    """Replayed through Paddle's SPMD rules with the plan's roles: the scores and the context are
    split on the head dim, the up-projection's keys and values reach them by heads, the rotary
    key (whole, from the down-projection) is sliced locally where it joins them, and nothing is
    communicated besides the row projection's all-reduce."""
    made = _planned()
    analysis, block = made.analysis, made.analysis.blocks[0]
    graph = analysis.graph
    mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["mp"])
    replay = Replay(graph, block.nodes, weight_dists(block, analysis.params), mesh, constant_nodes(graph))
    reshards = [r for r in replay.run() if r.collective is not None]
    core = [
        n
        for n in sorted(block.nodes)
        if graph.nodes[n]["op"] == "pd_op.matmul"
        and graph.nodes[n]["layer"] == ATTENTION.format(0)
        and len(graph.nodes[n]["shapes"][0]) == 4
    ]
    assert len(core) == 2  # scores = q @ k^T, context = probs @ v
    for node in core:
        assert replay.values[node, 0].dims[1] == 0, graph.nodes[node]["shapes"][0]  # [b, heads, ...] by heads
    # the only collectives Paddle adds: the sums of the row projections' partial outputs (o_proj,
    # the MLP's down_proj) where the residual adds them
    sums = [graph.nodes[r.before.partial_source]["layer"] for r in reshards if r.collective == "all_reduce"]
    assert len(sums) == len(reshards) and sums == [f"{ATTENTION.format(0)}.o_proj", "model.layers.0.mlp.down_proj"]


def _gathered(analysis):
    """The layout before: ``kv_a_proj_with_mqa`` split by columns and its output gathered (a fused
    column), everything else as recognised."""
    blocks = []
    for block in analysis.blocks:
        linears = [
            replace(lin, role="column", split_dim=1, fused=2) if lin.layer.endswith("kv_a_proj_with_mqa") else lin
            for lin in block.linears
        ]
        blocks.append(replace(block, linears=linears))
    return replace(analysis, blocks=blocks)


def test_the_cost_model_prices_the_latent_whole_and_no_gather():
    """Megatron's layout against the gathered one, at mp2: the down-projection's [32, 20] weight
    whole on every rank and its 2 * 32 * 20 FLOPs a token too, instead of half of each; no
    all-gather of its 20 outputs a token in the forward, so fewer mp bytes (the backward's sums
    are the same: q_proj's and kv_b_proj's inputs in both)."""
    made = _planned()
    megatron, gathered = model_cost(made.analysis), model_cost(_gathered(made.analysis))
    hidden, mp = 32, 2
    down = hidden * (LATENT + ROPE)
    first, before = megatron.blocks[0], gathered.blocks[0]
    assert first.params_whole - before.params_whole == down == before.params_split - first.params_split
    assert (first.gather_fwd_per_token, before.gather_fwd_per_token) == (0, LATENT + ROPE)
    assert first.allreduce_bwd_per_token == before.allreduce_bwd_per_token
    assert first.kv_split  # kv_b_proj's keys and values reach the core by heads: mp divides them

    def per_rank_flops(block) -> float:
        return sum(2 * g.n * g.k / (mp if g.split != "none" else 1) for g in block.gemms)

    assert per_rank_flops(first) - per_rank_flops(before) == 2 * down / mp
    setup = Setup(device=PROFILES["cpu"], devices_per_node=mp, seq_len=8, global_batch=2, dtype="fp32")
    bytes_ = [estimate(StageTable(c), Strategy(mp=mp), setup).estimate.comm_bytes.mp for c in (megatron, gathered)]
    tokens, layers, dtype_bytes = 2 * 8, 2, 4  # a batch of 2 sequences of 8, in fp32
    gather = all_gather_bytes((LATENT + ROPE) * tokens * dtype_bytes, mp)
    assert bytes_[1] - bytes_[0] == pytest.approx(layers * gather)


QUERY_LATENT = f"{TARGET}:build_with_query_latent"


def test_a_query_through_its_own_latent_keeps_its_down_projection_whole():
    """DeepSeek-V3's own shape: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``. The attention's
    columns are the projections feeding ``o_proj`` without another between (``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``): ``q_b_proj`` is split by heads, and ``q_a_proj``,
    which feeds only it, takes no tensor-parallel role (whole on every rank, priced so)."""
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    made = plan_target(QUERY_LATENT, None, request, {"target": QUERY_LATENT})
    attention = made.analysis.blocks[0].sublayers[0]
    roles = {p.layer.rpartition(".")[2]: p.role for p in attention.projections}
    assert roles == {"q_b_proj": "column", "kv_a_proj_with_mqa": "replicate", "kv_b_proj": "column", "o_proj": "row"}
    assert all(not lin.layer.endswith("q_a_proj") for lin in made.analysis.blocks[0].linears)
    assert implicit_comm(made.analysis, mp=2) == []


@pytest.mark.multiprocess
def test_both_train_on_two_ranks_like_one_device(tmp_path, reference_runs):
    """Moonlight's shape and DeepSeek-V3's (the query through a latent), in one 2-rank job."""
    runs, plans = [], {}
    for workload, target in (("zoo_deepseek_v3_hf", TARGET), ("zoo_deepseek_v3_hf_with_query_latent", QUERY_LATENT)):
        plan = plan_target(target, None, gloo_mp2_request(1), {"target": target}).plan
        assert plan.params[f"{ATTENTION.format(1)}.kv_a_proj_with_mqa.weight"].placements == ["R"]
        path = tmp_path / f"{workload}.json"
        save_plan(plan, path)
        runs.append(TrainRun(f"{workload}_dp1_mp2", workload, plan=str(path)))
        plans[runs[-1].name] = plan
    outputs = train_distributed(runs, 2, tmp_path / "job", timeout_s=600.0)
    reference_runs.prepare(runs)
    for run in runs:
        check_against_reference(Trained(run, plans[run.name], outputs[run.name]), reference_runs)
