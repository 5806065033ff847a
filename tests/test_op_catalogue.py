"""The op catalogue (planner/ops.py) is the one owner of what the planner knows about an op:
every product recognition takes is priced, no stage keeps an op table of its own, and one
attention spelled with ``matmul``, ``einsum``, ``bmm`` or ``baddbmm`` costs the same."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from autodist.planner import ops
from autodist.planner.cost.graph_cost import _HANDLERS, model_cost
from autodist.planner.graph import build_graph
from autodist.planner.recognise.analysis import analyze
from autodist.planner.recognise.spmd import _RULE_ARGS
from autodist.planner.trace import trace_model

PLANNER = Path(__file__).resolve().parents[1] / "planner"
#: Fused attention kernels recognition takes as attention whose FLOPs no rule gives yet: their
#: q, k, v are not ``[batch, seq, heads, head_dim]`` (packed, or ragged over the batch).
UNPRICED_ATTENTION = {
    "flash_attn_unpadded",
    "variable_length_memory_efficient_attention",
    "flash_attn_qkvpacked",
    "flash_attn_varlen_qkvpacked",
}


@pytest.mark.parametrize("name", sorted(ops.PRODUCT_OPS | ops.FUSED_ATTENTION_OPS))
def test_every_op_recognition_computes_with_has_a_price(name):
    """Recognition takes these as projections and attention cores (roles.py reads
    PRODUCT_OPS, LINEAR_OPS and FUSED_ATTENTION_OPS); the cost model prices each by its role's
    handler and its entry's FLOPs rule."""
    entry = ops.CATALOGUE[name]
    assert entry.role in _HANDLERS
    assert entry.priced != (name in UNPRICED_ATTENTION)
    if name in ops.PRODUCT_OPS:
        attrs = {"equation": "bij,bjk->bik"} if name == "einsum" else {}
        assert entry.flops(attrs, [[3, 6, 5], [3, 5, 7]], [3, 6, 7]) == 2 * 3 * 6 * 7 * 5


def test_ops_the_spmd_replay_knows_are_in_the_catalogue():
    assert set(_RULE_ARGS) <= set(ops.CATALOGUE)


def _op_tables(path: Path) -> list[str]:
    """Literal sets, tuples, lists and dicts of two or more op names in one source file."""
    names = set(ops.CATALOGUE) | {"builtin.parameter"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Set, ast.Tuple, ast.List, ast.Dict)) or not items or len(items) < 2:
            continue
        words = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        if len(words) == len(items) and all(w in names or w.startswith("pd_op.") for w in words):
            found.append(f"{path.name}:{node.lineno} {words}")
    return found


def test_no_stage_keeps_an_op_table_of_its_own():
    """A new op spelling is added once, in the catalogue: a table of op names anywhere else in
    the planner is a second owner that nothing keeps in step. The SPMD replay's rule arguments
    (recognise/spmd.py ``_RULE_ARGS``, keyed by catalogue names, checked above) are built by
    calls, not literal tables. The layer patterns (recognise/patterns/) are graphs of ops, named
    node by node, not tables."""
    paths = [p for p in sorted(PLANNER.rglob("*.py")) if p.name != "ops.py" and p.parent.name != "patterns"]
    tables = [t for path in paths for t in _op_tables(path)]
    assert tables == []


def test_the_table_check_sees_a_table(tmp_path):
    source = tmp_path / "stage.py"
    source.write_text('PRICED = {"pd_op.matmul": (0, 1), "pd_op.bmm": (0, 1)}\nif op in ("transpose", "cast"): pass\n')
    assert len(_op_tables(source)) == 2


# -- one attention, four spellings -------------------------------------------------------------------

B, S, H, A = 2, 6, 20, 4  # batch, sequence, hidden, heads: head dim 5, no two sizes alike


class Attention(nn.Layer):
    """Multi-head attention as the community writes it in each spelling: ``matmul`` (GPT-2,
    Llama), ``einsum`` (x-transformers), ``bmm`` over merged ``[batch * heads, seq, head_dim]``
    (OPT, fairscale), ``baddbmm`` with the scale as ``alpha`` (GPT-NeoX, BLOOM)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.heads, self.head_dim = spelling, A, H // A
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (
            p(x).reshape([b, s, self.heads, self.head_dim]).transpose([0, 2, 1, 3])
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scale = 1 / math.sqrt(self.head_dim)
        if self.spelling == "matmul":
            context = paddle.matmul(F.softmax(paddle.matmul(q, k, transpose_y=True) * scale, axis=-1), v)
        elif self.spelling == "einsum":
            probs = F.softmax(paddle.einsum("bhid,bhjd->bhij", q, k) * scale, axis=-1)
            context = paddle.einsum("bhij,bhjd->bhid", probs, v)
        else:
            q, k, v = (t.reshape([b * self.heads, s, self.head_dim]) for t in (q, k, v))
            if self.spelling == "bmm":
                scores = paddle.bmm(q, k.transpose([0, 2, 1])) * scale
            else:
                empty = paddle.zeros([b * self.heads, s, s], dtype=q.dtype)
                scores = paddle.baddbmm(empty, q, k.transpose([0, 2, 1]), beta=0.0, alpha=scale)
            context = paddle.bmm(F.softmax(scores, axis=-1), v).reshape([b, self.heads, s, self.head_dim])
        return self.out_proj(context.transpose([0, 2, 1, 3]).reshape([b, s, h]))


class Block(nn.Layer):
    def __init__(self, spelling: str):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.attn = Attention(spelling)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Model(nn.Layer):
    def __init__(self, spelling: str):
        super().__init__()
        self.layers = nn.LayerList([Block(spelling) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def costs():
    found = {}
    for spelling in ("matmul", "einsum", "bmm", "baddbmm"):
        model = Model(spelling)
        program = trace_model(model, [paddle.static.InputSpec([B, S, H], "float32", "x")])
        analysis = analyze(program, build_graph(program), model)
        found[spelling] = (analysis, model_cost(analysis))
    return found


def test_one_attention_in_four_spellings_is_one_attention_at_one_price(costs):
    """Scores and context each 2 x b x heads x s x s x head_dim: 4 b s^2 h, whatever op computes
    them; q, k, v and the output projection 2 b s h^2 each. (Paddle's SPMD rules know no einsum, so
    that attention is recognised as a local-view candidate, ``stopped``, and priced replicated.)"""
    for spelling, (analysis, cost) in costs.items():
        (attention,) = analysis.blocks[0].sublayers or analysis.blocks[0].stopped  # einsum: no SPMD rule
        assert (attention.kind, attention.num_heads, attention.head_dim) == ("attention", A, H // A), spelling
        block = cost.blocks[0]
        assert block.flops_per_token_seq * (B * S) * S == 4 * B * S * S * H, spelling
        assert block.flops_per_token * B * S == 4 * 2 * B * S * H * H, spelling
        assert block.attention_matmuls == 2, spelling


def test_one_attention_in_four_spellings_keeps_the_same_tensors_for_its_backward(costs):
    """Each product keeps its two factors (q, k; the probabilities, v), whether they are its
    operands or the items of an einsum's list: the same floats per token, wherever the roles put
    them (inside or outside the mp region)."""

    def floats(block) -> float:
        return block.saved_outside.floats + block.saved_inside.floats + block.saved_inside_seq.floats * S

    saved = {spelling: floats(cost.blocks[0]) for spelling, (_, cost) in costs.items()}
    assert len(set(saved.values())) == 1, saved
