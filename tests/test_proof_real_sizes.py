"""Local views proven at the sizes real models run at, not only at the zoo's small ones.

A forward whose sequence is written into it is proven at the traced sequence:
- timm's BEiT at 224 px has 197 tokens. With the former bound of 256 tokens its attention stayed
  replicated at the real size and was a view at the zoo's 65 tokens only.
- timm's Swin-T at 224 px has windows of 49 tokens, 64 windows a sample in its first stage, and its
  shifted windows' mask holds one row per window of a sample: a proof's batch of windows must be a
  multiple of 64 (a divisor of the traced batch), and their gradients, summed over thousands of
  tokens, round at the scale of their largest entries. Both kept the shifted windows gathered.
"""

import pytest

from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan_target

ZOO = "tests/models/zoo"


SWIN_VIEWS = [f"layers.{i}.blocks.{j}.attn" for i in range(2) for j in range(2)]


@pytest.mark.parametrize(
    "target, batch, views",
    [
        (f"{ZOO}/beit_timm.py:build_224", 4, ["blocks.0.attn", "blocks.1.attn"]),
        # at batch 24 the traced 1536 windows are beyond the proof's bound: proven at 64 of them
        *[(f"{ZOO}/swin_timm.py:build_224", batch, SWIN_VIEWS) for batch in (4, 24)],
    ],
)
def test_views_at_224_px(target, batch, views):
    request = SearchRequest(mp=2, pp=1, devices_per_node=2, dp=1)
    plan = plan_target(target, [f"pixels:float32:{batch}x3x224x224"], request, {"target": target}).plan
    assert [view.layer for view in plan.local_view] == views
