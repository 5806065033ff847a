"""Token embeddings reached through a reshape or flatten of the ids are token embeddings (issue
#22, item 3): HF GPT-2 writes ``input_ids.view(-1, input_shape[-1])`` (``reshape`` in Paddle, whose
``view`` does not trace), others embed a flat token list. Before, the embedding was taken for
one "other than the token embedding": it and the head tied to it stayed replicated, and only
the plan's notes said so.
"""

from __future__ import annotations

import pytest

from autodist.planner.cost.search import SearchRequest
from harness.planning import plan_target

TARGETS = ["tests/models/embedding_views.py:build_reshape", "tests/models/embedding_views.py:build_flatten"]


@pytest.mark.parametrize("target", TARGETS)
def test_an_embedding_of_reshaped_ids_is_split_over_the_vocabulary(target):
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1)
    made = plan_target(target, None, request, {"target": target})
    assert made.analysis.embedding == "transformer.wte.weight"
    wte = made.plan.params["transformer.wte.weight"]
    assert (wte.placements, wte.style) == (["S(0)"], "VocabParallelEmbedding")
    assert made.plan.params["transformer.wpe.weight"].placements == ["R"]  # positions: arange, not ids
    assert not any(note.startswith("transformer.wte.weight") for note in made.plan.notes)
