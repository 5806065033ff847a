"""Issue 32 item 2: randomness under a plan means what it means on one device.

nanoGPT with dropout (0.1 on the embeddings, the attention probabilities and both residuals),
each rank seeded ``2024 + rank`` before the build (and, for contrast, seeded alike), trained 10
steps under mp2 and dp2 x mp2 (scripts/dropout_seeded.py). apply_plan gives every rank the
first rank's random state (applier/placement/replicas.py, ``equalise_random``), so:

- every parameter the plan replicates over all ranks is bit for bit the same on all of them
  after 10 steps. Before, a dropout on a replicated activation drew another mask on each rank,
  and the replicas drifted apart while their placement said Replicate;
- a dropout on a split activation draws the same numbers on every rank of the split, for its
  local shape: mp peers' heads are dropped alike (the attention-probability masks of rank 0's
  and rank 1's heads are equal), as docs/internals.md ("Randomness") says and why.
"""

from __future__ import annotations

import json

import pytest
from loop_runs import run_script

from autodist.schemas import load_plan

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(("plan_name", "seed"), [("mp2", "per-rank"), ("dp2mp2", "per-rank"), ("mp2", "alike")])
def test_replicas_stay_equal_under_dropout(plan_name, seed, loop_plans, tmp_path):
    ranks, path = loop_plans("nanogpt", plan_name)
    run_script("dropout_seeded.py", tmp_path, ranks, path, "--seed", seed)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    replicated = [name for name, param in load_plan(path).params.items() if set(param.placements) == {"R"}]
    for name in replicated:
        digests = [seen[r]["digests"][name] for r in range(ranks)]
        assert len(set(digests)) == 1, f"{name} differs over the ranks after 10 steps"
    assert len(replicated) >= 5, replicated  # the plan replicates something: the test proves something
    # mp peers (ranks 0 and 1 in both meshes) drew the same attention-probability mask for their heads.
    assert seen[0]["mask"] == seen[1]["mask"] and 0 < sum(seen[0]["mask"]) < len(seen[0]["mask"])
