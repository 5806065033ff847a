"""An attention whose forward reads its width from the input's shape (issue 30, item 4).

nanoGPT writes ``B, T, C = x.shape`` then ``k.reshape([B, T, self.n_head, C // self.n_head])``
and ``y.reshape([B, T, C])``; timm's ViT ``B, N, C = x.shape`` then ``reshape([B, N, C])``, and
DiT (timm's ``Attention``) also ``qkv.reshape([B, N, 3, self.num_heads, C // self.num_heads])``. A
rank of a local view takes the input whole, so ``C`` stays the whole width while the rank
computes with half of it: no attribute the proof could localise changes that, and the attention
keeps its gather. The warning and ``--explain`` name the line that reads the width, the lines
that size with it, and the smallest rewrite (``-1`` for each of them); rewritten so, the same
model's attention is proven head-parallel at mp2.
"""

from __future__ import annotations

import re

import pytest

from harness.cli import ROOT
from harness.planning import gloo_mp2_request, plan_target
from test_unseen_code import plan_command

ZOO = ROOT / "tests" / "models" / "zoo"
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
def test_a_width_read_from_the_input_names_its_lines_and_the_rewrite(tmp_path, name):
    """One warning and one ``--explain`` line for the attention, naming the read, every line that
    sizes with it, and the rewrite."""
    path = ZOO / name
    layer, read, sizing, said, _ = WIDTHS[name]
    done, _ = plan_command(tmp_path, path, "--explain")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = ", ".join(str(_line(path, s)) for s in sizing)
    shown = path.relative_to(ROOT)  # as the plan's notes name a file under the working directory
    expected = (
        f"its forward reads its input's width from the input's shape (`{read}`, {shown}:{_line(path, read)}) and "
        f"sizes tensors with it ({shown}: line{'s' * (len(sizing) > 1)} {lines}: {said}), which stays the whole "
        "width on a rank computing with 1/mp of it; to split it: write -1 for each of those (a reshape infers it)"
    )
    prefix = "local view: " + layer.replace("*", "0")
    warnings = [line for line in done.stderr.splitlines() if line.startswith(f"warning: {prefix}")]
    assert len(warnings) == 1 and expected in warnings[0], done.stderr
    explained = done.stderr.split("why these stay gathered or replicated, and what to change:\n", 1)[1]
    assert sum(expected in line for line in explained.splitlines() if line.startswith("  ")) == 1, explained


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_the_rewrite_named_makes_the_attention_head_parallel(tmp_path, name):
    """The model rewritten as the warning says (and nothing else) plans its attention as a local
    view at mp2: each rank's reshape infers its 1/mp width."""
    layer, _, _, _, rewrites = WIDTHS[name]
    text = (ZOO / name).read_text()
    for what, into in rewrites:
        assert what in text
        text = text.replace(what, into)
    rewritten = tmp_path / name
    rewritten.write_text(text)
    before = plan_target(str(ZOO / name), None, gloo_mp2_request(), {"target": name}, local_view=True).plan
    after = plan_target(str(rewritten), None, gloo_mp2_request(), {"target": name}, local_view=True).plan
    pattern = re.compile(re.escape(layer).replace(r"\*", r"\d+") + "$")
    assert not [v.layer for v in before.local_view if pattern.match(v.layer)]
    found = [v.layer for v in after.local_view if pattern.match(v.layer)]
    assert len(found) == 2 and all("equal the global run" in v.verified for v in after.local_view), after.notes
