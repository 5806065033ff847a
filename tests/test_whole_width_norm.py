"""A q/k RMSNorm over the whole projection width, split with its heads (issue #30, item 6).

OLMo2 (tests/models/zoo/olmo2_hf.py, HF's modeling code) norms ``q_proj``'s and ``k_proj``'s
outputs over their whole width (``q_norm = Olmo2RMSNorm(num_heads * head_dim)``) before reshaping
them into heads, so each token's statistic reads every head. Before, the planner kept the whole
attention replicated: the mean of squares over a split width is a partial sum on each rank, and
the replay refused the all-reduce Paddle adds for it. Split, each rank computes its heads' share
of the statistic and Paddle sums it over mp by itself: one all-reduce of one value per token, far
less than what replicating the attention costs. Measured on 2 gloo ranks (docs/paddle-notes.md):
the norm's output and every gradient match one device's, the norm's weight whole or split.

Here: the roles, the plan's implicit collectives (exactly the statistics' sums), the price
against the attention kept whole, and the training on two gloo ranks against one device
(tests/test_zoo.py holds the model's placements; tests/test_train_zoo.py trains the whole zoo).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.search import SearchRequest
from autodist.planner.recognise.reshards import implicit_comm
from autodist.schemas import save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_distributed

TARGET = "tests/models/zoo/olmo2_hf.py"
#: Read from the model file: hidden 40, 4 heads of 6 (q, k, v: [40, 24], o: [24, 40]), MLP 56,
#: 2 layers, traced at a batch of 2 sequences of 8 tokens in float32.
HIDDEN, WIDTH, LAYERS, TOKENS = 40, 24, 2, 2 * 8


def _planned():
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    return plan_target(TARGET, None, request, {"target": TARGET})


def test_the_attention_is_split_by_heads_through_its_whole_width_norms():
    made = _planned()
    attention = made.analysis.blocks[0].sublayers[0]
    assert (attention.kind, attention.num_heads, attention.num_kv_heads) == ("attention", 4, 4)
    assert {p.name: p.role for p in attention.projections} == {"q": "column", "k": "column", "v": "column", "o": "row"}


def test_the_only_collectives_paddle_adds_are_the_norm_statistics_sums():
    """One all-reduce of a ``[batch, seq, 1]`` statistic per norm and layer, forward and
    backward: 2 * 16 tokens * 4 bytes / 2 each."""
    comm = implicit_comm(_planned().analysis, mp=2)
    assert [(c.layer, c.collective, c.bytes_per_step) for c in comm] == [
        (f"model.layers.{i}.self_attn.{norm}", "all_reduce", 2 * TOKENS * 4 // 2)
        for i in range(LAYERS)
        for norm in ("q_norm", "k_norm")
    ]


def _whole(analysis):
    """The layout before: the attention's projections replicated, the MLP as recognised."""
    blocks = [
        replace(block, linears=[lin for lin in block.linears if ".self_attn." not in lin.layer])
        for block in analysis.blocks
    ]
    return replace(analysis, blocks=blocks)


def test_the_split_costs_two_all_reduces_and_the_statistics_and_halves_the_attention():
    """Against the attention kept whole, at mp2: each layer's attention computes half its
    projections' FLOPs on each rank, and pays Megatron's two all-reduces of the hidden state
    (o_proj's output forward, the projections' input gradient backward) plus Paddle's sums of
    the two statistics (the plan's implicit collectives, 4 of 64 bytes a step at the traced
    shape); kept whole it pays none of them."""
    made = _planned()
    split, whole = model_cost(made.analysis).blocks[0], model_cost(_whole(made.analysis)).blocks[0]
    mp = 2

    def per_rank_flops(block) -> float:
        return sum(2 * g.n * g.k / (mp if g.split != "none" else 1) for g in block.gemms)

    attention = 2 * (3 * HIDDEN * WIDTH + WIDTH * HIDDEN)
    assert per_rank_flops(whole) - per_rank_flops(split) == attention / mp
    assert split.allreduce_fwd_per_token - whole.allreduce_fwd_per_token == HIDDEN
    assert split.allreduce_bwd_per_token - whole.allreduce_bwd_per_token == HIDDEN
    assert implicit_comm(_whole(made.analysis), mp=2) == []
    # the statistics' sums, priced in the estimate (planned at the traced batch and sequence)
    assert made.plan.estimate.comm_bytes.implicit == sum(c.bytes_per_step for c in made.plan.implicit_comm) == 4 * 64


@pytest.mark.multiprocess
def test_it_trains_on_two_ranks_like_one_device(tmp_path, reference_runs):
    made = plan_target(TARGET, None, gloo_mp2_request(1), {"target": TARGET})
    assert made.plan.params["model.layers.0.self_attn.q_proj.weight"].placements == ["S(1)"]
    path = tmp_path / "olmo2.json"
    save_plan(made.plan, path)
    run = TrainRun("olmo2_dp1_mp2", "zoo_olmo2_hf", plan=str(path))
    outputs = train_distributed([run], 2, tmp_path / "job", timeout_s=600.0)
    reference_runs.prepare([run])
    check_against_reference(Trained(run, made.plan, outputs[run.name]), reference_runs)
