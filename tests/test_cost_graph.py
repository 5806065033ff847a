"""The cost model's numbers as derived from real traced graphs, against the papers' formulas.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022):
activation bytes of one GPT layer (16-bit activations, 1-byte dropout masks) are
sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism t, and
sbh(34/t + 5as/(ht)) with sequence parallelism too; its forward FLOPs are 24Bsh^2 + 4Bs^2h.
Their layer has three dropouts, so :class:`KorthikantiGPTLayer` below is the GPT-2 block of
``tests/models/gpt.py`` with those dropouts added; the model of ``tests/models/gpt.py`` itself
(no dropout) is checked against the same accounting minus the dropout terms.
"""

from __future__ import annotations

import math
from pathlib import Path

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from models.traced import traced

from autodist.planner.recognise.analysis import analyze
from autodist.planner.cost.blocks import ModelCost
from autodist.planner.cost.graph_cost import GraphFacts, Roles, block_cost, model_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.cost.step_time import Setup, StageTable, estimate
from autodist.planner.errors import PlannerError
from autodist.planner.graph import build_graph
from autodist.planner.trace import trace_model
from autodist.schemas import Strategy

ROOT = Path(__file__).resolve().parents[1]
B, S, H, A = 2, 16, 64, 4  # traced batch, sequence, hidden, heads
BYTES = 2  # bf16: the paper's 16-bit activations


class KorthikantiAttention(nn.Layer):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv_proj(x).reshape([b, s, 3, self.heads, self.head_dim]).unbind(axis=2)
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
        scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim)
        probs = self.attn_dropout(F.softmax(scores, axis=-1))
        return self.out_proj(paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, s, h]))


class KorthikantiGPTLayer(nn.Layer):
    """Figure 4 of the paper: LN, attention with dropout on the probabilities, dropout, residual,
    LN, GELU MLP, dropout, residual."""

    def __init__(self, hidden: int = H, heads: int = A):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = KorthikantiAttention(hidden, heads)
        self.attn_out_dropout = nn.Dropout(0.1)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)
        self.mlp_out_dropout = nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.attn_out_dropout(self.attn(self.ln_1(x)))
        return x + self.mlp_out_dropout(self.fc_out(F.gelu(self.fc_in(self.ln_2(x)))))


@pytest.fixture(scope="module")
def korthikanti_layer_cost() -> ModelCost:
    """The traced layer as the cost model sees it, roles named as the matcher would give them."""
    layer = KorthikantiGPTLayer()
    graph = build_graph(trace_model(layer, [paddle.static.InputSpec([B, S, H], "float32", "x")]))
    roles = Roles(
        column=frozenset({"attn.qkv_proj.weight", "fc_in.weight"}),
        row=frozenset({"attn.out_proj.weight", "fc_out.weight"}),
        split=frozenset(),
    )
    block = block_cost(GraphFacts(graph), graph.nodes, "layer", roles, {}, tokens=B * S, seq=S)
    return ModelCost(blocks=(block,), hidden_size=H, traced_batch=B, traced_seq=S)


def activation_bytes(cost: ModelCost, mp: int = 1, sp: bool = False, batch: int = B, seq: int = S) -> float:
    setup = Setup(device=PROFILES["h100-sxm"], devices_per_node=mp, nodes=1, seq_len=seq, global_batch=batch)
    strategy = Strategy(mp=mp, sequence_parallel=sp)
    return estimate(StageTable(cost), strategy, setup).estimate.memory.activations


def sbh(s, b, h):
    return s * b * h


# -- Korthikanti's activation table -----------------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(B, S), (1, 2048), (8, 512)])
def test_layer_activations_without_parallelism_match_34_plus_5as_over_h(korthikanti_layer_cost, batch, seq):
    paper = sbh(seq, batch, H) * (34 + 5 * A * seq / H)
    assert activation_bytes(korthikanti_layer_cost, batch=batch, seq=seq) == pytest.approx(paper, rel=0.02)


@pytest.mark.parametrize("t", [2, 4])
def test_layer_activations_with_tensor_parallelism(korthikanti_layer_cost, t):
    paper = sbh(S, B, H) * (10 + 24 / t + 5 * A * S / (H * t))
    assert activation_bytes(korthikanti_layer_cost, mp=t) == pytest.approx(paper, rel=0.02)


@pytest.mark.parametrize("t", [2, 4])
def test_layer_activations_with_sequence_parallelism(korthikanti_layer_cost, t):
    paper = sbh(S, B, H) * (34 / t + 5 * A * S / (H * t))
    assert activation_bytes(korthikanti_layer_cost, mp=t, sp=True) == pytest.approx(paper, rel=0.02)


def test_layer_flops_match_24bsh2_plus_4bs2h(korthikanti_layer_cost):
    for batch, seq in ((B, S), (4, 2048)):
        paper = 24 * batch * seq * H**2 + 4 * batch * seq**2 * H
        assert korthikanti_layer_cost.forward_flops(batch * seq, seq) == pytest.approx(paper, rel=1e-6)


def test_layer_has_two_mp_all_reduces_each_way_of_bsh(korthikanti_layer_cost):
    block = korthikanti_layer_cost.blocks[0]
    assert (block.allreduce_fwd_count, block.allreduce_bwd_count) == (2, 2)
    assert block.allreduce_fwd_per_token == block.allreduce_bwd_per_token == 2 * H
    assert block.output_per_token == 0  # the traced layer is the whole graph: nothing downstream


# -- through the matcher's analysis of whole models --------------------------------------------------


@pytest.fixture(scope="module")
def gpt_cost():
    model, program, graph = traced("gpt")
    analysis = analyze(program, graph, model)
    return analysis, model_cost(analysis)


def test_traced_gpt_blocks_match_the_paper_without_dropout(gpt_cost):
    analysis, cost = gpt_cost
    h, a, b, s = 32, 4, 2, 8  # tests/models/gpt.py defaults
    assert len(cost.blocks) == 2
    for block in cost.blocks:
        assert (
            block.flops_per_token * b * s + block.flops_per_token_seq * b * s * s
            == 24 * b * s * h * h + 4 * b * s * s * h
        )
        # No dropout: the masks (2sbh), the probabilities' dropout mask and output (3as^2b) go.
        paper = sbh(s, b, h) * (34 - 2 + (5 - 3) * a * s / h)
        graph_bytes = (
            (
                block.saved_outside.bytes(BYTES)
                + block.saved_inside.bytes(BYTES)
                + block.saved_inside_seq.bytes(BYTES) * s
            )
            * b
            * s
        )
        assert graph_bytes == pytest.approx(paper, rel=0.03)
        assert block.saved_outside.masks == block.saved_inside_seq.masks == 0
        assert (block.num_heads, block.num_kv_heads, block.intermediate_size) == (4, 4, 128)
        assert block.output_per_token == h


def test_every_parameter_is_counted_once_and_split_where_the_roles_say(gpt_cost):
    analysis, cost = gpt_cost
    numel = {fqn: math.prod(shape) for fqn, (shape, _) in analysis.params.items()}
    assert cost.num_params == sum(numel.values())
    block = cost.blocks[0]
    split = [
        "attn.qkv_proj.weight",
        "attn.qkv_proj.bias",
        "attn.out_proj.weight",
        "mlp.fc_in.weight",
        "mlp.fc_in.bias",
        "mlp.fc_out.weight",
    ]
    assert block.params_split == sum(numel[f"blocks.0.{name}"] for name in split)
    assert cost.first.params_vocab == numel["wte.weight"]  # vocabulary-parallel embedding
    assert cost.last.params_vocab == numel["lm_head.weight"]
    assert cost.last.flops_vocab_per_token == 2 * numel["lm_head.weight"]  # traced head matmul


def test_docstring_llama_costs_generalise_to_swiglu_and_rope():
    model, program, graph = traced("docstring")
    cost = model_cost(analyze(program, graph, model))
    h, inter = 32, 64  # tests/models/traced.py TINY_DOCSTRING
    for block in cost.blocks:
        assert block.flops_per_token == pytest.approx(2 * (4 * h * h + 3 * h * inter))
        assert block.flops_per_token_seq == pytest.approx(4 * h)
        # q/k/v share one input and gate/up another: one backward all-reduce each.
        assert (block.allreduce_fwd_count, block.allreduce_bwd_count) == (2, 2)
        assert block.allreduce_bwd_per_token == 2 * h
    assert cost.notes == ()  # its LM head is traced


class HeadOutsideTheTrace(nn.Layer):
    """A causal LM whose own forward does not trace (what PaddleFormers' did until
    planner/trace.py worked around dy2static's ``super()`` rewrite): its decoder is traced."""

    def __init__(self):
        super().__init__()
        from models import paddleformers_models

        causal_lm = paddleformers_models.build_llama(tie_word_embeddings=False)
        self.model, self.lm_head = causal_lm.model, causal_lm.lm_head

    def forward(self, input_ids):
        if not paddle.in_dynamic_mode():
            raise RecursionError("maximum recursion depth exceeded")
        return self.lm_head(self.model(input_ids)[0])


def test_untraced_lm_head_is_priced_from_its_weight_shape():
    from models import paddleformers_models

    with paddle.LazyGuard():
        model = HeadOutsideTheTrace()
    program = trace_model(model, paddleformers_models.input_spec())
    analysis = analyze(program, build_graph(program), model)
    cost = model_cost(analysis)
    hidden, vocab = 32, 64
    assert analysis.traced_layer == "model"
    assert cost.last.flops_vocab_per_token == 2 * hidden * vocab
    assert cost.last.params_vocab == hidden * vocab
    assert any("lm_head was not traced" in note for note in cost.notes)


# -- recompute (Korthikanti sec. 4.3; selective recompute: tests/test_cost_recompute.py) --------------


def test_full_recompute_of_a_traced_model_keeps_2sbh_per_layer():
    model, program, graph = traced("gpt@4")
    cost = model_cost(analyze(program, graph, model))
    h, b, s = 32, 2, 8
    plain = Setup(device=PROFILES["h100-sxm"], devices_per_node=1, nodes=1, seq_len=s, global_batch=b)
    full = Setup(device=PROFILES["h100-sxm"], devices_per_node=1, nodes=1, seq_len=s, global_batch=b, recompute="full")
    table = StageTable(cost)
    saved_plain = estimate(table, Strategy(), plain).estimate.memory.activations
    saved_full = estimate(table, Strategy(), full).estimate.memory.activations
    one_layer = (
        saved_plain
        - (cost.first.saved_whole + cost.last.saved_whole).bytes(BYTES) * b * s
        - cost.last.saved_vocab.bytes(BYTES) * b * s
    ) / 4
    edges = saved_plain - 4 * one_layer
    assert saved_full == pytest.approx(edges + 4 * 2 * sbh(s, b, h) + one_layer, rel=1e-6)


def test_a_tied_head_is_held_by_the_first_and_the_last_stage():
    model, program, graph = traced("llama")
    analysis = analyze(program, graph, model)
    cost = model_cost(analysis)
    vocab_hidden = 64 * 32
    assert cost.first.params_vocab == cost.last.params_vocab == cost.tied_vocab_params == vocab_hidden
    assert cost.num_params == sum(math.prod(shape) for shape, _ in analysis.params.values())
    setup = Setup(device=PROFILES["h100-sxm"], devices_per_node=2, nodes=1, seq_len=8, global_batch=4)
    one_stage = estimate(StageTable(cost), Strategy(), setup).estimate.memory.params
    assert one_stage == cost.num_params * BYTES  # counted once when one stage holds both uses
    two = estimate(StageTable(cost), Strategy(pp=2, micro_batches=2, schedule="1F1B"), setup)
    assert two.estimate.memory.params >= (vocab_hidden + cost.blocks[0].params_split) * BYTES


def test_a_gathered_fused_projection_pays_its_gathers_and_a_whole_core():
    """tests/models/gpt.py traced at batch 2 x seq 8 (16 tokens): hidden h = 32, 4 heads, one fused
    qkv_proj [32, 96]. Gathered (the plan's hook, no local view): forward, qkv_proj's output
    is all-gathered, 3h = 96 elements a token; backward, out_proj's input is whole and its weight
    Shard(0), so Paddle's matmul_grad returns the input gradient split and all-gathers it, h = 32 a
    token. The core reads whole q, k, v: all of it whole on every rank, and q, k, v and out_proj's
    input (4 x 32 a token) are saved whole. As a local view none of that: no gather, the core and
    those 128 a token split over mp. The MLP (fc_in column, fc_out row) is split either way."""
    from autodist.planner.recognise.reshards import local_view_layers

    model, program, graph = traced("gpt")
    analysis = analyze(program, graph, model)
    local = local_view_layers(analysis)
    assert local == {"blocks.0.attn", "blocks.1.attn"}
    gathered, viewed = model_cost(analysis).blocks[0], model_cost(analysis, None, local).blocks[0]
    assert (gathered.gather_fwd_per_token, gathered.gather_fwd_count) == (3 * 32, 1)
    assert (gathered.gather_bwd_per_token, gathered.gather_bwd_count) == (32, 1)
    assert (viewed.gather_fwd_per_token, viewed.gather_bwd_per_token, viewed.gather_fwd_count) == (0, 0, 0)
    assert (gathered.core_whole, viewed.core_whole) == (1.0, 0.0)
    assert gathered.saved_outside.floats - viewed.saved_outside.floats == 4 * 32
    assert viewed.saved_inside.floats - gathered.saved_inside.floats == 4 * 32
    # the same FLOPs and the same Megatron all-reduces either way: qkv_proj's and fc_in's input
    # gradients, out_proj's and fc_out's outputs (h = 32 a token each)
    assert gathered.flops_per_token_seq == viewed.flops_per_token_seq == 2 * 2 * 32  # q k^T and p v
    assert (gathered.allreduce_fwd_per_token, gathered.allreduce_bwd_per_token) == (64, 64)
    assert (viewed.allreduce_fwd_per_token, viewed.allreduce_bwd_per_token) == (64, 64)


def test_fused_projections_leave_nothing_for_paddle_to_insert():
    """Phi3's fused qkv_proj and gate_up_proj: gathered (one hook each per layer, priced in the
    blocks); nothing left for Paddle to insert. Both sub-layers may run as local views, which
    gather nothing. Separate q/k/v projections need neither."""
    from autodist.planner.cost.graph_cost import implicit_collectives
    from autodist.planner.recognise.reshards import local_view_layers

    model, program, graph = traced("phi3")
    analysis = analyze(program, graph, model)
    fused = implicit_collectives(analysis, mp=2, dtype_bytes=2)
    assert fused.count == 0 and fused.sent_per_token == 0
    assert [b.gather_fwd_count for b in model_cost(analysis).blocks] == [2, 2]
    assert [b.gather_fwd_count for b in model_cost(analysis, None, local_view_layers(analysis)).blocks] == [0, 0]
    model, program, graph = traced("docstring")
    unfused = analyze(program, graph, model)
    assert (implicit_collectives(unfused, mp=2, dtype_bytes=2).count, local_view_layers(unfused)) == (0, frozenset())
    assert {(b.gather_fwd_count, b.gather_bwd_count, b.core_whole) for b in model_cost(unfused).blocks} == {(0, 0, 0.0)}


def test_a_tied_head_pipelines_with_1f1b_but_not_sequentially():
    """A table shared by the embedding (stage 0) and the LM head (last stage) runs as two copies
    kept equal by the 1F1B schedule; the sequential schedule would let them drift, so it is
    refused with the reason."""
    from autodist.planner.cost.search import SearchRequest, search

    model, program, graph = traced("llama")
    analysis = analyze(program, graph, model)
    piped = search(analysis, SearchRequest(devices_per_node=2, pp=2, device=PROFILES["h100-sxm"]))
    assert (piped.best.strategy.pp, piped.best.strategy.schedule) == (2, "1F1B")
    with pytest.raises(PlannerError) as err:
        search(analysis, SearchRequest(devices_per_node=2, pp=2, schedule="sequential", device=PROFILES["h100-sxm"]))
    assert "a weight tied across stages needs the 1F1B or VPP schedule" in err.value.detail


def test_a_head_after_the_blocks_is_priced_on_the_stage_it_is_planned_on():
    """timm's ViT: a classification head on the class token after the final norm (neither a
    norm nor an LM head). With pp=2 the plan puts it on the last stage; the cost model must price
    its parameters there too, not on the first stage with the patch embedding."""
    from autodist.planner import driver

    made = driver.plan_target(
        str(ROOT / "tests" / "models" / "zoo" / "vit.py"),
        None,
        SearchRequest(devices_per_node=2, dp=1, mp=1, pp=2),
        {"target": "vit"},
    )
    plan, cost = made.plan, model_cost(made.analysis)
    outside = {fqn: p for fqn, p in plan.params.items() if not fqn.startswith("blocks.")}
    assert outside["head.weight"].stage == 1 and outside["patch_embed.proj.weight"].stage == 0
    planned = {stage: sum(math.prod(p.shape) for p in outside.values() if p.stage == stage) for stage in (0, 1)}
    assert planned[0] == cost.first.params_whole + cost.first.params_vocab
    assert planned[1] == cost.last.params_whole + cost.last.params_vocab
