"""The cost model prices recompute as apply_plan runs it, from the traced shapes.

Selective recompute (applier/modes/recompute.py) wraps each block's attention sub-layer: the
backward runs that sub-layer's whole forward again, its q|k|v and output projections too, and
keeps only its inputs; inside a local view (applier/modes/local_calls.py) on the rank's local
tensors, the view's all-reduces once, outside. Under ZeRO 3 a local view gathers its parameters
over dp for its call (``param_local``) and its backward uses the gathered values, held from the
forward: no gather in the backward, unless full recompute runs the forward again there. Of a
multi-query weight held whole over mp only the rank's columns are held; a local lookup's rows are
gathered for its forward alone and not held; everything else (Paddle's global view) is gathered
by each op that reads it, in the forward and again in its backward (measured on 4 gloo ranks,
docs/paddle-notes.md).

Shapes are picked so that no two sizes coincide: hidden h = 48, 4 heads of 12 (3 in the
Korthikanti layer, of 16), sequence 10, batch 2, MLP 4h = 192, vocabulary 64, 3 layers.
"""

from __future__ import annotations

import pytest
import paddle
from models import gpt
from test_cost_graph import KorthikantiGPTLayer

from autodist.planner import driver
from autodist.planner.cost.blocks import ModelCost, Saved
from autodist.planner.cost.comm import all_gather_bytes, all_reduce_bytes
from autodist.planner.cost.graph_cost import GraphFacts, Roles, block_cost, model_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.step_time import Setup, StageTable, estimate
from autodist.planner.graph import build_graph
from autodist.planner.recognise.analysis import analyze
from autodist.planner.recognise.reshards import local_view_layers
from autodist.planner.trace import trace_model
from autodist.schemas import Strategy

H, HEADS, S, B, LAYERS = 48, 4, 10, 2, 3
WIDTH = 2  # bf16, the Setup's default


def gathered_at_once(mp: int) -> float:
    """Bytes ZeRO 3 holds at once beyond what it keeps: the largest parameter's backward holds it
    gathered over dp and its gradient whole over dp (measured, docs/paddle-notes.md). Of every
    model here, the MLP's h x 4h (4h x h) weight, split over mp."""
    return 2 * H * 4 * H / mp * WIDTH


def setup(recompute: str, devices: int = 2, batch: int = 2 * B) -> Setup:
    return Setup(
        device=PROFILES["h100-sxm"],
        devices_per_node=devices,
        nodes=1,
        seq_len=S,
        global_batch=batch,
        recompute=recompute,
    )


# -- what the recomputed sub-layer is: Korthikanti's layer (LN, attention, dropouts, MLP) -----------


@pytest.fixture(scope="module")
def korthikanti_block():
    heads = 3
    layer = KorthikantiGPTLayer(H, heads)
    graph = build_graph(trace_model(layer, [paddle.static.InputSpec([B, S, H], "float32", "x")]))
    roles = Roles(
        column=frozenset({"attn.qkv_proj.weight", "fc_in.weight"}),
        row=frozenset({"attn.out_proj.weight", "fc_out.weight"}),
        split=frozenset(),
    )
    return heads, block_cost(GraphFacts(graph), graph.nodes, "layer", roles, {}, B * S, S, recomputed="attn")


def test_selective_recompute_reruns_the_whole_attention_sublayer(korthikanti_block):
    """The recomputed sub-layer is ``attn`` whole: its projections' FLOPs 2 (3h h + h h) = 8h^2 a
    token, its core 2 x 2h a token x seq, its output's all-reduce (h a token). The block stops
    keeping what attn's ops saved besides attn's input: q, k, v and out_proj's input (4h a token,
    inside the mp region), the probabilities and the dropped-out probabilities (2a floats a token
    x seq) and their dropout mask (a bytes); the input (the LN output) and the dropout after attn
    (outside it) stay."""
    heads, block = korthikanti_block
    rerun = block.selective
    assert rerun is not None and rerun.layer == "attn"
    assert (rerun.flops_per_token, rerun.flops_per_token_seq) == (8 * H * H, 4 * H)
    assert [(g.n, g.k, g.split) for g in rerun.gemms] == [(3 * H, H, "column"), (H, H, "row")]
    assert (rerun.allreduce_fwd_per_token, rerun.allreduce_fwd_count, rerun.gather_fwd_per_token) == (H, 1, 0)
    assert rerun.saved_outside == Saved()
    assert rerun.saved_inside == Saved(floats=4 * H)
    assert rerun.saved_inside_seq == Saved(floats=2 * heads, masks=heads)


@pytest.mark.parametrize("t", [2, 4])
def test_selective_recompute_memory_with_sequence_parallelism(korthikanti_block, t):
    """Three such layers at mp t with sequence parallelism (every activation 1/t): Korthikanti's
    34 sbh a layer with 16-bit activations, less attn's 8 sbh (q, k, v, out_proj's input) and its
    5 as^2b of scores, kept by none of the layers; one layer's of those alive while its backward
    rebuilds them."""
    heads, block = korthikanti_block
    blocks = tuple(block.__class__(**{**block.__dict__, "layer": f"h.{i}"}) for i in range(LAYERS))
    cost = ModelCost(blocks=blocks, hidden_size=H, traced_batch=B, traced_seq=S)
    got = estimate(StageTable(cost), Strategy(mp=t, sequence_parallel=True), setup("selective", t, B))
    sbh = S * B * H
    rebuilt = 8 * sbh / t + 5 * heads * S * S * B / t
    assert got.estimate.memory.activations == pytest.approx(LAYERS * 26 * sbh / t + rebuilt, rel=0.02)


# -- a GPT-2 model: its attention as a local view or gathered, ZeRO 3 ----------------------------------


@pytest.fixture(scope="module")
def gpt_costs():
    cfg = gpt.GPTConfig(hidden_size=H, num_heads=HEADS, num_layers=LAYERS, seq_len=S, batch_size=B)
    model = gpt.build_model(cfg)
    made = driver.trace(model, gpt.input_spec(cfg))
    analysis = analyze(made.program, made.graph, model)
    local = local_view_layers(analysis)
    assert local == {f"blocks.{i}.attn" for i in range(LAYERS)}
    return {"gathered": model_cost(analysis), "local": model_cost(analysis, None, local)}


def priced(cost: ModelCost, strategy: Strategy, recompute: str):
    return estimate(StageTable(cost), strategy, setup(recompute, strategy.dp * strategy.mp)).estimate


@pytest.mark.parametrize("how", ["local", "gathered"])
def test_selective_recompute_reruns_the_projections_of_a_local_view(gpt_costs, how):
    """Each block's ``attn`` runs again in the backward, its fused q|k|v (h x 3h) and output
    (h x h) projections included: 8h^2 FLOPs a token, split over mp like the first run
    (column, row), and its core (q k^T and p v: 4h a token x seq)."""
    rerun = gpt_costs[how].blocks[0].selective
    assert rerun is not None and rerun.layer == "attn"
    assert (rerun.flops_per_token, rerun.flops_per_token_seq) == (8 * H * H, 4 * H)
    assert [(g.n, g.k, g.split) for g in rerun.gemms] == [(3 * H, H, "column"), (H, H, "row")]
    assert rerun.core_whole == (0.0 if how == "local" else 1.0)  # a gathered q|k|v: the core whole on every rank


@pytest.mark.parametrize("how", ["local", "gathered"])
def test_selective_recompute_collectives_and_memory_at_mp2(gpt_costs, how):
    """mp 2, 4 sequences of 10 tokens on the one dp rank (40 tokens). A local view runs again on
    local tensors, its all-reduces once: the mp bytes are those without recompute. Gathered, the
    q|k|v output's all-gather (3h a token) and the output's all-reduce (h) run again in every
    layer. Memory: each layer no longer keeps q, k, v and out_proj's input (4h a token: 1/2 on a
    rank as a local view, whole gathered) nor the probabilities (4 heads x 10 a token, 1/2 on a
    rank as a local view); one layer's are alive again while its backward rebuilds them."""
    cost, mp, tokens = gpt_costs[how], 2, 4 * S
    none, selective = (priced(cost, Strategy(mp=mp), recompute) for recompute in ("none", "selective"))
    rerun = (
        0
        if how == "local"
        else LAYERS * (all_gather_bytes(3 * H * tokens * WIDTH, mp) + all_reduce_bytes(H * tokens * WIDTH, mp))
    )
    assert selective.comm_bytes.mp == none.comm_bytes.mp + rerun
    share = 1 / mp if how == "local" else 1  # gathered: all after the gather whole on every rank
    dropped = (4 * H + HEADS * S) * share * tokens * WIDTH
    assert selective.memory.activations == pytest.approx(none.memory.activations - (LAYERS - 1) * dropped)


def test_zero3_local_views_gather_their_weights_once_and_hold_them(gpt_costs):
    """dp 2 x mp 2, ZeRO 3, 2 micro-batches. Each view computes with its rank's slice of c_attn's
    weight and bias ((h 3h + 3h) / 2) and out_proj's weight (h h / 2), and out_proj's bias whole
    (h): gathered over dp in each micro-batch's forward and held until its backward, not gathered
    again there (the rest of the parameters are, block by block). Full recompute runs the forward
    again in the backward: the views gather again, and hold one block's while it is rebuilt. Each
    also holds, once, the largest weight gathered with its whole gradient (:func:`gathered_at_once`)."""
    local, mp, dp, m = gpt_costs["local"], 2, 2, 2
    view = (H * 3 * H + 3 * H + H * H) / mp + H
    zero3, zero1 = (Strategy(dp=dp, mp=mp, sharding_stage=stage, micro_batches=m) for stage in (3, 1))
    held = priced(local, zero3, "none")
    gathered_again = priced(local, zero3, "full")
    assert gathered_again.comm_bytes.dp - held.comm_bytes.dp == m * all_gather_bytes(LAYERS * view * WIDTH, dp)
    zero1_none, zero1_full = (priced(local, zero1, recompute).memory.activations for recompute in ("none", "full"))
    assert held.memory.activations - zero1_none == LAYERS * view * WIDTH + gathered_at_once(mp)
    assert gathered_again.memory.activations - zero1_full == view * WIDTH + gathered_at_once(mp)
    # selective recompute keeps them as its recomputed views' inputs, as without recompute
    assert priced(local, zero3, "selective").comm_bytes.dp == held.comm_bytes.dp


def test_without_tensor_parallelism_no_view_runs_and_zero3_gathers_everything_twice(gpt_costs):
    """At mp 1 no local view runs (``runs_local_views``): a cost that lists views (as
    bench/published.py prices every row) prices ZeRO 3 as the model without them."""
    dp4 = Strategy(dp=4, sharding_stage=3, micro_batches=2)
    local, gathered = (priced(gpt_costs[how], dp4, "none") for how in ("local", "gathered"))
    assert local.comm_bytes.dp == gathered.comm_bytes.dp
    assert local.memory.activations == gathered.memory.activations


def test_a_row_output_summed_after_the_sublayer_is_not_summed_again():
    """The docstring Llama's ``o_proj`` has no bias: its Partial output leaves ``self_attn`` and
    the residual add after it sums it, outside what selective recompute runs again (a biased
    ``out_proj``, as above, is summed by its own bias add, inside: run again)."""
    from models.traced import traced

    model, program, graph = traced("docstring")
    block = model_cost(analyze(program, graph, model)).blocks[0]
    hidden = model.layers[0].self_attn.o_proj.weight.shape[1]
    assert block.selective is not None and block.selective.layer == "self_attn"
    assert (block.selective.allreduce_fwd_per_token, block.selective.allreduce_fwd_count) == (0, 0)
    assert (block.allreduce_fwd_per_token, block.allreduce_fwd_count) == (2 * hidden, 2)  # o_proj's, down_proj's


def test_selective_recompute_time_is_a_forward_of_the_attention_traced_alone(korthikanti_block):
    """Three Korthikanti layers at mp 2: selective recompute adds to each step the forward of
    each layer's ``attn``; that sub-layer traced as a model of its own prices its forward as a
    third of its step's compute (forward, backward twice the forward, no recompute)."""
    from test_cost_graph import KorthikantiAttention

    heads, block = korthikanti_block
    blocks = tuple(block.__class__(**{**block.__dict__, "layer": f"h.{i}"}) for i in range(LAYERS))
    layers = ModelCost(blocks=blocks, hidden_size=H, traced_batch=B, traced_seq=S)
    attention = KorthikantiAttention(H, heads)
    graph = build_graph(trace_model(attention, [paddle.static.InputSpec([B, S, H], "float32", "x")]))
    roles = Roles(column=frozenset({"qkv_proj.weight"}), row=frozenset({"out_proj.weight"}), split=frozenset())
    alone = ModelCost(
        blocks=(block_cost(GraphFacts(graph), graph.nodes, "attn", roles, {}, B * S, S),),
        hidden_size=H,
        traced_batch=B,
        traced_seq=S,
    )
    strategy = Strategy(mp=2)

    def compute(cost: ModelCost, recompute: str) -> float:
        return estimate(StageTable(cost), strategy, setup(recompute, 2, B)).compute_s

    forward = compute(alone, "none") / 3
    assert compute(layers, "selective") - compute(layers, "none") == pytest.approx(LAYERS * forward, rel=1e-9)


# -- ZeRO 3 as it runs: what each op gathers over dp, and what stays alive (measured, paddle-notes) -----


def zero3_priced(cost: ModelCost, strategy: Strategy, local_lookup: bool | None = None):
    """``cost`` priced under ``strategy`` with no recompute; ``local_lookup`` False: the token
    lookup in Paddle's global view, as a plan without ``vocab_lookup`` runs it."""
    table = StageTable(cost)
    return estimate(table, strategy, setup("none", strategy.dp * strategy.mp), local_views=local_lookup).estimate


class TiedGPT(paddle.nn.Layer):
    """tests/models/gpt.py with its LM head tied to the token table as nanoGPT ties it in Paddle:
    ``matmul(x, wte.weight, transpose_y=True)``."""

    def __init__(self, cfg: gpt.GPTConfig):
        super().__init__()
        self.wte = paddle.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = paddle.nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = paddle.nn.LayerList([gpt.GPTBlock(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = paddle.nn.LayerNorm(cfg.hidden_size)

    def forward(self, input_ids):
        positions = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return paddle.matmul(self.ln_f(x), self.wte.weight, transpose_y=True)


VOCAB = 64  # tests/models/gpt.py's; its table is [VOCAB, H], VOCAB / 2 rows a rank at mp 2


@pytest.fixture(scope="module")
def tied_costs():
    cfg = gpt.GPTConfig(hidden_size=H, num_heads=HEADS, num_layers=LAYERS, seq_len=S, batch_size=B)
    model = TiedGPT(cfg)
    made = driver.trace(model, gpt.input_spec(cfg))
    analysis = analyze(made.program, made.graph, model)
    return {"gathered": model_cost(analysis), "local": model_cost(analysis, None, local_view_layers(analysis))}


#: (tied, looked up locally) -> gathers of the table's rows a micro-batch beyond one forward and
#: one backward gather of every parameter: a tied head's op gathers them too (+1 forward, +1
#: backward), the local lookup gathers none in its backward (-1).
EXTRA_GATHERS = {(False, True): -1, (False, False): 0, (True, True): 1, (True, False): 2}


@pytest.mark.parametrize("tied, local", list(EXTRA_GATHERS))
def test_zero3_gathers_the_tables_rows_once_for_each_op_and_pass_that_needs_them(gpt_costs, tied_costs, tied, local):
    """dp 2 x mp 2, ZeRO 3, 2 micro-batches, attention gathered (no local view). Each op that
    reads a parameter gathers it over dp, in the forward and again in its backward, holding
    nothing gathered; the local lookup gathers its rows (VOCAB / 2 x H a rank) for its forward
    alone, its backward needing no table values (measured, docs/paddle-notes.md). With P a rank's
    parameter bytes, ZeRO 2 sends 2 all-gathers of P a step (its gradient reduce-scatter, bf16,
    as many bytes), ZeRO 3 2 a micro-batch and the reduce-scatter, plus the rows' extra gathers."""
    cost = (tied_costs if tied else gpt_costs)["gathered"]
    assert (cost.first.lookup_table, cost.first.lookup_output, cost.tied_vocab_params) == (
        VOCAB * H,
        H,
        VOCAB * H if tied else 0,
    )
    dp, mp, m = 2, 2, 2
    zero2, zero3 = (
        zero3_priced(cost, Strategy(dp=dp, mp=mp, sharding_stage=stage, micro_batches=m), None if local else False)
        for stage in (2, 3)
    )
    gather = zero2.comm_bytes.dp / 2
    rows = all_gather_bytes(VOCAB // mp * H * WIDTH, dp)
    assert zero3.comm_bytes.dp == pytest.approx((2 * m + 1) * gather + m * EXTRA_GATHERS[tied, local] * rows)


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_holds_none_of_a_local_lookups_rows(gpt_costs, tied_costs, tied):
    """The same with the attention as a local view: ZeRO 3 holds, from each micro-batch's
    forward to its backward, the views' weights (as above) and none of the lookup's rows."""
    cost, dp, mp, m = (tied_costs if tied else gpt_costs)["local"], 2, 2, 2
    zero1, zero3 = (
        zero3_priced(cost, Strategy(dp=dp, mp=mp, sharding_stage=stage, micro_batches=m)) for stage in (1, 3)
    )
    view = (H * 3 * H + 3 * H + H * H) / mp + H
    assert zero3.memory.activations - zero1.memory.activations == LAYERS * view * WIDTH + gathered_at_once(mp)


def test_zero3_keeps_of_a_multi_query_weight_only_the_columns_a_rank_computes_with(monkeypatch):
    """HF Falcon (tests/models/zoo/falcon_hf.py) with 6 query heads of 8 and its one KV head:
    ``query_key_value`` is [48, 48 + 8 + 8]. As a local view at mp 2 each rank holds it whole,
    ZeRO 3 gathers it whole over dp, and the view takes the rank's columns q_r|k|v (24 + 8 + 8 =
    40): its matmul keeps those, the gathered weight is freed (measured: docs/paddle-notes.md).
    So under ZeRO 3 a rank holds, per layer, 48 x 40 of it and 24 x 48 of ``dense`` (its rows),
    from each micro-batch's forward to its backward; it gathers 48 x 64 of it."""
    import models.zoo.falcon_hf as falcon

    for name, size in (("HIDDEN", 48), ("HEADS", 6), ("HEAD_DIM", 8)):  # its sizes, the model as written
        monkeypatch.setattr(falcon, name, size)
    model = falcon.build_model()
    made = driver.trace(model, falcon.input_spec())
    analysis = analyze(made.program, made.graph, model)
    assert analysis.params["transformer.h.0.self_attention.query_key_value.weight"][0] == [48, 64]
    cost = model_cost(analysis, None, local_view_layers(analysis))
    dp, mp, m, layers = 2, 2, 2, len(cost.blocks)
    zero3, zero1 = (Strategy(dp=dp, mp=mp, sharding_stage=stage, micro_batches=m) for stage in (3, 1))
    held = zero3_priced(cost, zero3).memory.activations - zero3_priced(cost, zero1).memory.activations
    assert held == layers * (48 * 40 + 24 * 48) * WIDTH + gathered_at_once(mp)  # dense_h_to_4h: 48 x 192


def test_global_view_zero3_gathers_every_parameter_in_each_forward_and_backward(gpt_costs):
    """At mp 1 nothing runs on local tensors: Paddle's ZeRO 3 gathers each parameter over dp at
    the op that reads it, in the forward and again in the backward, and holds nothing gathered
    (measured, docs/paddle-notes.md). So with P the bytes of a rank's parameters, ZeRO 2 sends
    one all-gather of P (after the step) and one reduce-scatter of the gradients (as many bytes,
    bf16); ZeRO 3 two all-gathers of P a micro-batch and the reduce-scatter, and keeps the
    activations ZeRO 1 keeps, and once the largest weight gathered with its whole gradient (the
    price before held nothing gathered at all)."""
    cost, dp = gpt_costs["gathered"], 4
    zero = {
        (stage, m): zero3_priced(cost, Strategy(dp=dp, sharding_stage=stage, micro_batches=m))
        for stage, m in ((1, 1), (2, 1), (3, 1), (3, 2))
    }
    gather = zero[2, 1].comm_bytes.dp / 2
    assert zero[3, 1].comm_bytes.dp == pytest.approx(3 * gather)
    assert zero[3, 2].comm_bytes.dp == pytest.approx(5 * gather)
    assert zero[3, 1].memory.activations - zero[1, 1].memory.activations == gathered_at_once(1)
