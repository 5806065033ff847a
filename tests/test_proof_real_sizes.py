"""A local view proven at the sizes a real model runs at, not only at the zoo's small ones.

A forward whose sequence is written into it (BEiT's relative-position bias of its own tokens) is
proven at the traced sequence. timm's BEiT at 224 px has 197 tokens, so at the proof's batch that
sequence must still be within the proof's token bound: with 256 (the bound before) its attention
stayed replicated at the real size and was a view at the zoo's 65 tokens only.
"""

from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan_target

BEIT = "tests/models/zoo/beit_timm.py:build_224"


def test_beit_at_224_px_is_a_local_view():
    request = SearchRequest(mp=2, pp=1, devices_per_node=2, dp=1)
    plan = plan_target(BEIT, ["pixels:float32:4x3x224x224"], request, {"target": BEIT}).plan
    assert [view.layer for view in plan.local_view] == ["blocks.0.attn", "blocks.1.attn"]
