"""An attention whose forward reads its width from the input's shape (issue 30, item 4).

nanoGPT writes ``B, T, C = x.shape`` then ``k.reshape([B, T, self.n_head, C // self.n_head])``
and ``y.reshape([B, T, C])``; timm's ViT ``B, N, C = x.shape`` then ``reshape([B, N, C])``, DiT
(timm's ``Attention``) also ``qkv.reshape([B, N, 3, self.num_heads, C // self.num_heads])``, and
HF CLIP ``bsz, tgt_len, embed_dim = hidden_states.shape`` then ``reshape([bsz, tgt_len,
embed_dim])``. A rank of a local view takes the input whole, so ``C`` is the whole width while
the rank computes with half of it: the planner proves the view with that one read made 1/mp
(``LocalView.input_width`` ``local``), and the unchanged model's attention is head-parallel at
mp2; rewritten with ``-1`` for each such size, it is proven reading its width whole. Where
neither holds (the width sizes both the rank's half and a whole tensor), the warning and
``--explain`` name the line that reads the width, the lines that size with it, and the rewrite.
"""

from __future__ import annotations

import re

import paddle
import paddle.nn.functional as F
import pytest

from harness.cli import ROOT
from harness.planning import gloo_mp2_request, plan_target

ZOO = ROOT / "tests" / "models" / "zoo"
HERE = ROOT / "tests" / "test_local_view_widths.py"
#: file -> (its attention, the line reading the width, the lines sizing with it and their spelling,
#: the rewrite: (what, into)), read from the model files.
WIDTHS = {
    "nanogpt.py": (
        "transformer.h.*.attn",
        "B, T, C = x.shape",
        ["k = k.reshape(", "q = q.reshape(", "v = v.reshape(", "y = (att @ v)"],
        "`C // self.n_head`, `C`",
        [("C // self.n_head", "-1"), ("[B, T, C]", "[B, T, -1]")],
    ),
    "clip_hf.py": (
        "text_model.encoder.layers.*.self_attn",
        "bsz, tgt_len, embed_dim = hidden_states.shape",
        ["attn_output = attn_output.reshape([bsz, tgt_len, embed_dim])"],
        "`embed_dim`",
        [("[bsz, tgt_len, embed_dim]", "[bsz, tgt_len, -1]")],
    ),
    "vit.py": ("blocks.*.attn", "B, N, C = x.shape", ["x = (attn @ v)"], "`C`", [("[B, N, C]", "[B, N, -1]")]),
    "dit.py": (
        "blocks.*.attn",
        "B, N, C = x.shape",
        ["qkv = self.qkv(x)", "x = paddle.matmul(attn, v)"],
        "`C // self.num_heads`, `C`",
        [("C // self.num_heads", "-1"), ("[B, N, C]", "[B, N, -1]")],
    ),
}


def _line(path, starts: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(starts))


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_the_model_as_written_and_rewritten_is_head_parallel(tmp_path, name):
    """As written, the attention is proven as a local view reading its input's width as 1/mp;
    rewritten with -1 for each size (and nothing else), it is proven reading the width whole (a
    reshape infers the rank's). Without the 1/mp read the unchanged model keeps its gather."""
    layer, _, _, _, rewrites = WIDTHS[name]
    text = (ZOO / name).read_text()
    for what, into in rewrites:
        assert what in text
        text = text.replace(what, into)
    rewritten = tmp_path / name
    rewritten.write_text(text)
    pattern = re.compile(re.escape(layer).replace(r"\*", r"\d+") + "$")
    for target, width in ((str(ZOO / name), "local"), (str(rewritten), "whole")):
        plan = plan_target(target, None, gloo_mp2_request(), {"target": name}, local_view=True).plan
        found = [v for v in plan.local_view if pattern.match(v.layer)]
        assert len(found) == 2, plan.notes
        assert all(v.input_width == width and "equal the global run" in v.verified for v in found), found


class ReadsItsWidthTwice(paddle.nn.Layer):
    """An attention sizing with its input's width both its heads' output (1/mp on a rank) and its
    projected output (whole on every rank): no proof holds, read whole or as 1/mp."""

    def __init__(self, width=24, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = paddle.nn.Linear(width, 3 * width)
        self.proj = paddle.nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape([B, T, 3, self.heads, -1]).transpose([2, 0, 3, 1, 4]).unbind(0)
        y = F.softmax(q @ k.transpose([0, 1, 3, 2]), axis=-1) @ v
        y = y.transpose([0, 2, 1, 3]).reshape([B, T, C])
        return self.proj(y).reshape([B, T, C])


class Stack(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([ReadsItsWidthTwice() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_width_no_proof_holds_with_names_its_lines_and_the_rewrite():
    """One note for the attention, naming the read, every line that sizes with it, and the
    rewrite."""
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_model

    model = Stack()
    spec = [paddle.static.InputSpec([3, 10, 24], "float32", "x")]
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    kept = plan_model(model, spec, request, {"target": "ReadsItsWidthTwice"}).kept_whole
    read = _line(HERE, "B, T, C = x.shape")
    sized = f"{_line(HERE, 'y = y.transpose(')}, {_line(HERE, 'return self.proj(y).reshape(')}"
    expected = (
        f"its forward reads its input's width from the input's shape (`B, T, C = x.shape`, "
        f"{HERE.relative_to(ROOT)}:{read}) and sizes tensors with it ({HERE.relative_to(ROOT)}: lines {sized}: `C`), "
        "which no proof held with, read whole or as the 1/mp a rank computes with; to split it: write -1 for each "
        "of those (a reshape infers it)"
    )
    assert len(kept) == 1 and expected in kept[0], kept
