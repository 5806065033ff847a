"""The target's kernels: what a model selects, what the plan records, and their hand-computed prices.

One attention layer (hidden H = 16, A = 2 heads of 8, batch 1 x sequence S = 8, q/k/v/o
projections without bias) written twice, the way models write it: with an explicit softmax
(eager), and through ``F.scaled_dot_product_attention`` (which traces to matmul / softmax /
matmul on CPU, docs/paddle-notes.md). Per token, by hand:

- FLOPs: projections 2 H (3 H) + 2 H H = 8 H^2; attention core 2 (2 S d A) = 4 H S;
- eager: the core's seq x seq tensors (A S elements per token each) go through memory in the scale
  (read + write) and the softmax (read + write): 4 A per token x S; the probabilities (A per
  token x S) are saved; q, k, v and the output projection's input (4 H, in the mp region) and the
  layer's input x (H, outside it) too;
- flash: no seq x seq memory pass or saved tensor; the kernel reads q, k, v and writes its
  output (4 H per token) and saves one log-sum-exp per row of scores (A per token).
"""

from __future__ import annotations

import math
from dataclasses import replace

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from msgspec.structs import replace as struct_replace

from autodist.planner.cost.blocks import BlockCost, ModelCost, Moved, Saved
from autodist.planner.cost.graph_cost import Fusion, GraphFacts, Roles, block_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.step_time import Setup, StageTable, _Context, estimate
from autodist.planner.graph import build_graph
from autodist.planner.kernels import choose_kernels, eager_path
from autodist.planner.trace import trace_model
from autodist.schemas import Kernels, Strategy

B, S, H, A = 1, 8, 16, 2
D = H // A
ROLES = Roles(
    column=frozenset({"q_proj.weight", "k_proj.weight", "v_proj.weight"}),
    row=frozenset({"o_proj.weight"}),
    split=frozenset(),
)


class Attention(nn.Layer):
    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(H, H, bias_attr=False) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).reshape([b, s, A, D]) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.sdpa:
            return self.o_proj(F.scaled_dot_product_attention(q, k, v).reshape([b, s, h]))
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
        probs = F.softmax(paddle.matmul(q, k, transpose_y=True) / math.sqrt(D), axis=-1)
        return self.o_proj(paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, s, h]))


def traced_attention(sdpa: bool):
    layer = Attention(sdpa)
    return trace_model(layer, [paddle.static.InputSpec([B, S, H], "float32", "x")])


def attention_cost(sdpa: bool, flash: bool) -> BlockCost:
    graph = build_graph(traced_attention(sdpa))
    return block_cost(GraphFacts(graph), graph.nodes, "attn", ROLES, {}, B * S, S, Fusion(flash=flash), num_heads=A)


# -- what the model selects -----------------------------------------------------------------------


def test_a_call_to_sdpa_is_recorded_though_it_traces_to_matmul_softmax_matmul():
    traced = traced_attention(sdpa=True)
    graph = build_graph(traced)
    assert set(traced.selected_kernels) == {"attention"}
    assert "scaled_dot_product_attention" in traced.selected_kernels["attention"]
    ops = {graph.nodes[n]["op"] for n in graph if graph.nodes[n]["kernel"] == "attention"}
    assert {"pd_op.matmul", "pd_op.softmax"} <= ops
    assert graph.graph["selected_kernels"] == traced.selected_kernels
    assert traced_attention(sdpa=False).selected_kernels == {}


def test_choice_follows_the_model_the_device_and_the_option():
    selected = {"attention": "calls F.scaled_dot_product_attention (attn)"}
    h100, cpu = PROFILES["h100-sxm"], PROFILES["cpu"]
    assert choose_kernels(selected, h100).attention == "flash"
    assert choose_kernels(selected, cpu).attention == "eager"  # a CPU runs what was traced
    assert choose_kernels({}, h100).attention == "eager"
    assert choose_kernels({}, h100, "flash") == Kernels(attention="flash", reason="--attention flash")
    assert choose_kernels(selected, h100, "eager").attention == "eager"
    assert choose_kernels({"rms_norm": "config"}, h100).fused == ["rms_norm"]
    assert choose_kernels({"rms_norm": "config"}, cpu).fused == []


def test_config_flags_are_read_and_an_untraceable_fused_path_is_off_while_tracing():
    class Config:
        def __init__(self, **flags):
            self.__dict__.update(flags)

    class Net(nn.Layer):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.linear = nn.Linear(2, 2)

    config = Config(use_flash_attention=True, fuse_rms_norm=True)
    with eager_path(Net(config)) as selected:
        assert config.fuse_rms_norm is False  # traced through the eager norm
        assert config.use_flash_attention is True  # traces either way: left alone
    assert config.fuse_rms_norm is True  # put back
    assert set(selected) == {"attention", "rms_norm"}
    assert "use_flash_attention=True" in selected["attention"]
    with eager_path(Net(Config(use_flash_attention=False))) as selected:
        pass
    assert selected == {}


# -- hand-computed coefficients ---------------------------------------------------------------------


def test_eager_attention_coefficients_by_hand():
    block = attention_cost(sdpa=False, flash=False)
    assert block.flops_per_token == 8 * H * H
    assert block.flops_per_token_seq == 4 * H
    assert block.moved.inside_seq == 4 * A  # scale and softmax: read and write A S per token each
    assert block.saved_inside_seq == Saved(floats=A)  # the probabilities
    assert block.saved_inside == Saved(floats=4 * H)  # q, k, v, the output projection's input
    assert block.saved_outside == Saved(floats=H)  # x
    assert (block.fused_attention, block.attention_io_per_token) == (False, 0.0)


@pytest.mark.parametrize("sdpa", [True, False])
def test_flash_attention_coefficients_by_hand(sdpa):
    """The same numbers whether the model called SDPA or wrote the softmax and a config flag (or
    ``--attention flash``) says the target runs flash attention."""
    block = attention_cost(sdpa=sdpa, flash=True)
    assert block.flops_per_token == 8 * H * H
    assert block.flops_per_token_seq == 4 * H  # the same FLOPs, at the matmul roof
    assert block.moved.inside_seq == 0
    assert block.saved_inside_seq == Saved()
    assert block.saved_inside == Saved(floats=4 * H + A)  # q, k, v, o_proj's input, log-sum-exp
    assert block.saved_outside == Saved(floats=H)
    assert block.fused_attention and block.attention_io_per_token == 4 * H


# -- hand-computed prices -------------------------------------------------------------------------

#: 1 TFLOP/s at full efficiency, 1 GB/s of memory, 1 us per op: every term readable.
DEVICE = struct_replace(
    PROFILES["cpu"],
    peak_flops={"bf16": 1e12, "fp16": 1e12, "fp32": 1e12},
    matmul_efficiency=1.0,
    memory_bandwidth=1e9,
    op_overhead_s=1e-6,
    dispatch_overhead_s=0.0,
)
TOKENS = B * S
WIDTH = 2  # bf16


def core(fused: bool) -> BlockCost:
    """Only the attention core of the layer above (the projections priced elsewhere)."""
    return BlockCost(
        layer="attn",
        num_heads=A,
        flops_per_token_seq=4 * H,
        attention_matmuls=2,
        moved=Moved(inside_seq=0 if fused else 4 * A),
        saved_inside_seq=Saved() if fused else Saved(floats=A),
        saved_inside=Saved(floats=4 * H + A) if fused else Saved(floats=4 * H),
        saved_outside=Saved(floats=H),
        fused_attention=fused,
        attention_io_per_token=4 * H if fused else 0.0,
    )


def priced(block: BlockCost, recompute: str = "none"):
    setup = Setup(device=DEVICE, devices_per_node=1, nodes=1, seq_len=S, global_batch=B, recompute=recompute)
    cost = ModelCost(blocks=(block,), hidden_size=H, traced_batch=B, traced_seq=S)
    return _Context(StageTable(cost), Strategy(), setup, None), cost, setup


def recomputed(block: BlockCost) -> BlockCost:
    """``block`` as one whose whole forward selective recompute runs again."""
    return replace(block, selective=block)


def test_eager_core_price_by_hand():
    ctx, _, _ = priced(recomputed(core(fused=False)))
    # Each of the two matmuls: (S x D) @ (D x S) for A heads: 2 S S D A = 2048 FLOPs -> 2.048 ns;
    # bytes 2 A (S D + D S + S S) = 768 -> 768 ns; plus 1 us: 1.768 us. The scale and the
    # softmax move 4 A S x 8 tokens x 2 bytes = 1024 bytes: 1.024 us.
    matmul = max(2 * S * S * D * A / 1e12, WIDTH * A * (S * D + D * S + S * S) / 1e9) + 1e-6
    forward, selective, rescore = ctx.block_forward(0)  # the first block
    assert forward == pytest.approx(2 * matmul + 4 * A * S * TOKENS * WIDTH / 1e9)
    assert forward == pytest.approx(4.560e-6)
    assert selective == forward and rescore == 0.0  # selective recompute runs all of it again


def test_flash_core_price_by_hand():
    ctx, _, _ = priced(recomputed(core(fused=True)))
    # One kernel: 4 H S x 8 tokens = 4096 FLOPs (4.096 ns) against q, k, v and the output read
    # and written once: 4 H x 8 tokens x 2 bytes = 1024 bytes (1.024 us): memory-bound; plus 1 us.
    forward, selective, rescore = ctx.block_forward(0)  # the first block
    assert forward == pytest.approx(max(4 * H * S * TOKENS / 1e12, 4 * H * TOKENS * WIDTH / 1e9) + 1e-6)
    assert forward == pytest.approx(2.024e-6)
    assert selective == forward  # the sub-layer's forward runs again, the kernel included
    assert rescore == pytest.approx(4 * H * S * TOKENS / 1e12 / 2)  # the scores again in its backward


@pytest.mark.parametrize(("fused", "per_token"), [(False, 5 * H + A * S), (True, 5 * H + A)])
def test_activation_bytes_by_hand(fused, per_token):
    """Eager: x, q, k, v, o_proj's input and the probabilities (A S per token); flash: the
    log-sum-exp (A per token) instead of the probabilities."""
    _, cost, setup = priced(core(fused))
    activations = estimate(StageTable(cost), Strategy(), setup).estimate.memory.activations
    assert activations == per_token * TOKENS * WIDTH


@pytest.mark.parametrize(("fused", "rebuilt"), [(False, 4 * H + A * S), (True, 4 * H + A)])
def test_selective_recompute_keeps_the_sublayer_input_and_rebuilds_one(fused, rebuilt):
    """Two blocks, each the attention sub-layer selective recompute runs again: each keeps its
    input x (H per token); the backward rebuilds one at a time what it saved besides (q, k, v,
    o_proj's input and the probabilities, or the flash kernel's log-sum-exp)."""
    block = core(fused)
    dropped = replace(block, saved_outside=Saved())  # all but the input x
    two = (replace(block, layer="b.0", selective=dropped), replace(block, layer="b.1", selective=dropped))
    setup = Setup(device=DEVICE, devices_per_node=1, nodes=1, seq_len=S, global_batch=B, recompute="selective")
    cost = ModelCost(blocks=two, hidden_size=H, traced_batch=B, traced_seq=S)
    activations = estimate(StageTable(cost), Strategy(), setup).estimate.memory.activations
    assert activations == (2 * H + rebuilt) * TOKENS * WIDTH


# -- a fused norm ---------------------------------------------------------------------------------


class RMSNorm(nn.Layer):
    """Written as PaddleFormers' ``GeneralNorm`` does without ``fuse_rms_norm``."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([H], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        variance = x.astype("float32").pow(2).mean(-1, keepdim=True)
        return paddle.rsqrt(variance + 1e-6) * x * self.weight


class NormBetweenLinears(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, H, bias_attr=False)
        self.norm = RMSNorm()
        self.proj = nn.Linear(H, H, bias_attr=False)

    def forward(self, x):
        return self.proj(self.norm(self.up(x)))


def test_fused_norm_by_hand():
    graph = build_graph(trace_model(NormBetweenLinears(), [paddle.static.InputSpec([B, S, H], "float32", "x")]))
    facts, roles = GraphFacts(graph), Roles(frozenset(), frozenset(), frozenset())
    unfused = block_cost(facts, graph.nodes, "b", roles, {}, B * S, S)
    fused = block_cost(facts, graph.nodes, "b", roles, {}, B * S, S, Fusion(layers=frozenset({"norm"})))
    # One kernel: its input read (H per token), the weight read once (H over the 8 tokens), its
    # output written (H); one op's fixed cost (the matmuls pay theirs as matmuls).
    assert fused.moved.outside == 2 * H + H / TOKENS
    assert fused.moved.ops == 1
    # Saved: x (for up's weight), the norm's input (its backward reads it), its output (proj's).
    assert fused.saved_outside == Saved(floats=3 * H)
    # Unfused: pow, mean, add, rsqrt and two multiplies each a pass and an op, and the
    # intermediate products saved too.
    assert unfused.moved.ops >= 6 and unfused.moved.outside > 2 * fused.moved.outside
    assert unfused.saved_outside.floats > fused.saved_outside.floats + H
    assert fused.flops_per_token == unfused.flops_per_token == 4 * H * H


# -- a library model, planned whole ---------------------------------------------------------------


@pytest.mark.slow
def test_paddleformers_llama_with_flash_attention_plans_whole_and_records_the_choice():
    """PaddleFormers' Llama with ``use_flash_attention=True`` (PaddleNLP's switch) and with
    ``_attn_implementation="sdpa"`` (PaddleFormers 1.2's, which calls SDPA): traced whole (no
    sub-layer fallback), priced with flash attention on an H100, and the plan says so."""
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_model
    from models import paddleformers_models as pf

    def planned(attention="auto", **config):
        with paddle.LazyGuard():
            model = pf.build_llama(**config)
        request = SearchRequest(devices_per_node=2, dp=2, device=PROFILES["h100-sxm"], attention=attention)
        return plan_model(model, pf.input_spec(2, 64), request, {"target": "llama"})

    flag = planned(use_flash_attention=True)
    assert flag.plan.model.traced_layer == "" and flag.traced.fallback_reason == ""
    assert flag.plan.kernels.attention == "flash" and "use_flash_attention=True" in flag.plan.kernels.reason
    sdpa = planned(_attn_implementation="sdpa")
    assert sdpa.plan.kernels.attention == "flash" and "scaled_dot_product_attention" in sdpa.plan.kernels.reason
    eager = planned(attention="eager", use_flash_attention=True)
    assert eager.plan.kernels == Kernels(attention="eager", reason="--attention eager")
    # The scores ([heads, seq, seq] per sequence) are neither kept nor passed through memory.
    assert flag.plan.estimate.memory.activations < eager.plan.estimate.memory.activations
    assert flag.plan.estimate.step_time_s < eager.plan.estimate.step_time_s


def test_the_option_is_recorded_in_the_plan_and_explained(tmp_path):
    """``--attention flash`` on a model that writes its softmax itself: the plan's ``kernels`` and
    ``--explain`` say what was priced and why."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from autodist.planner.cli import cli

    model = str(Path(__file__).parent / "models" / "gpt.py")
    out = tmp_path / "plan.json"
    common = [model, "--devices", "2", "--device", "h100-sxm", "--dp", "2", "-o", str(out)]
    result = CliRunner().invoke(cli, [*common, "--attention", "flash", "--explain", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "kernels: attention flash (--attention flash)" in result.output
    plan = json.loads(out.read_text())
    assert plan["kernels"] == {"attention": "flash", "reason": "--attention flash", "fused": []}
    assert plan["provenance"]["arguments"]["attention"] == "flash"
    bad = CliRunner().invoke(cli, [*common, "--attention", "fast"])
    assert bad.exit_code == 2 and "fast" in bad.output


def test_a_cluster_file_inherits_or_sets_fused_kernels_and_a_bad_value_is_named(tmp_path):
    from autodist.planner.cost.hardware import load_cluster_file
    from autodist.planner.errors import PlannerError

    path = tmp_path / "c.toml"
    for body, expected in (
        ('base = "cpu"', False),
        ('base = "h100-sxm"', True),
        ('base = "cpu"\nfused_kernels = true', True),
    ):
        path.write_text(f"[device]\n{body}\n")
        assert load_cluster_file(str(path)).fused_kernels is expected
    path.write_text('[device]\nbase = "cpu"\nfused_kernels = "yes"\n')
    with pytest.raises(PlannerError, match="fused_kernels must be true or false"):
        load_cluster_file(str(path))


def test_a_library_models_norm_layers_are_fused_when_rms_norm_is():
    """PaddleFormers' Llama (its RMSNorm written out: pow, mean, add, rsqrt, casts, multiplies)
    priced with ``rms_norm`` fused: each of a block's two norms is one op that saves its input."""
    from models.traced import traced

    from autodist.planner.cost.graph_cost import model_cost
    from autodist.planner.recognise.analysis import analyze

    model, program, graph = traced("llama")
    analysis = analyze(program, graph, model)
    unfused = model_cost(analysis, Kernels()).blocks[0]
    fused = model_cost(analysis, Kernels(fused=["rms_norm"])).blocks[0]
    norm_ops = [n for n in analysis.blocks[0].nodes if graph.nodes[n]["layer"].endswith("layernorm")]
    assert len(norm_ops) > 4  # written out, as traced
    assert unfused.moved.ops - fused.moved.ops == len(norm_ops) - 2  # two norms, one op each
    assert fused.moved.outside < unfused.moved.outside
    assert fused.saved_outside.floats < unfused.saved_outside.floats
    assert fused.flops_per_token == unfused.flops_per_token


def test_fuse_swiglu_is_recorded_from_the_call_paddleformers_makes():
    """PaddleFormers' MLP with ``fuse_swiglu=True`` calls ``paddle.incubate.nn.functional.swiglu``,
    one op on CPU too: the trace records the call, the plan lists it (priced as that one op)."""
    from models import paddleformers_models as pf

    with paddle.LazyGuard():
        model = pf.build_llama(fuse_swiglu=True)
    traced = trace_model(model, pf.input_spec())
    assert "swiglu" in traced.selected_kernels and traced.selected_kernels["swiglu"].startswith("calls swiglu")
    assert {traced.ops[i].name() for i, k in traced.kernel_ops.items() if k == "swiglu"} >= {"pd_op.swiglu"}
    assert choose_kernels(traced.selected_kernels, PROFILES["h100-sxm"]).fused == ["swiglu"]
