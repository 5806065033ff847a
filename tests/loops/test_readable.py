"""Issue 21 item 1: a loss read on some ranks only (``if rank == 0: print(float(loss))``) has the
single-device value, and reading on no rank costs no communication (applier/ranks/readable/); ``autodist.close()`` undoes it all.

On the old code the rank-0 read under dp2 aborts both ranks in gloo
(``op.preamble.length <= op.nbytes``). One launch per plan, where the loss is Partial over dp:
dp2, ZeRO-1 (TEST-ONLY reduce-scatter stand-in) and dp2 ep2 (the Mixtral-style MoE model of
tests/models/zoo), and dp2 x mp2, whose token lookup runs on local tensors (values posted, as
under ep). Elsewhere: mp2 (the loss replicated there) by loop (a), which logs on rank 0
only; pipelines by loop (f) and test_apply_single's pipeline test."""

from __future__ import annotations

import json

import pytest
from loop_runs import run_script

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(("model", "plan"), [("gpt", "dp2"), ("gpt", "zero1"), ("mixtral", "ep2"), ("gpt", "dp2mp2")])
def test_a_loss_read_on_some_ranks_only(model, plan, loop_plans, single_device, tmp_path):
    ranks, path = loop_plans(model, plan)
    one = single_device("read_anywhere.py", "--model", model)
    run_script("read_anywhere.py", tmp_path / "many", ranks, path, "--model", model, stand_ins=plan == "zero1")
    reference = json.loads((one.out / "rank0.json").read_text())["reads"]
    seen = [json.loads((tmp_path / "many" / f"rank{r}.json").read_text()) for r in range(ranks)]

    reads = seen[0]["reads"]
    for how in ("float_before_backward", "item", "numpy", "format", "last"):
        assert reads[how] == pytest.approx(reference[how], rel=1e-5), how
    assert f"{reference['item']:.6f}"[:6] in reads["print"]
    assert seen[1]["reads"]["rank_1_alone"] == pytest.approx(reference["item"], rel=1e-5)

    # Two steps in which no rank read: nothing fetched, nothing served, on any rank.
    for rank, record in enumerate(seen):
        assert record["unread"]["fetched"] == 0 and record["unread"]["served"] == 0, (rank, record["unread"])
        # Under ep and with a local token lookup (dp2 x mp2) every value is posted as it is made
        # (the collectives the applier runs from Python hold the GIL).
        assert (record["unread"]["posted"] > 0) == (plan in ("ep2", "dp2mp2")), (rank, record["unread"])
        assert record["unread"]["noted"] > 0, "the losses were not noted: the test would prove nothing"
    # The reads: rank 0 fetched from its dp peer (once per value: repeated reads are cached).
    assert seen[0]["after"]["fetched"] == 2
    # autodist.close() on every rank after the last read: every patch undone (issue 32 item 9).
    for rank, record in enumerate(seen):
        assert record["closed"]["wrapped_before"] == 27, (rank, record["closed"])
        assert record["closed"]["still_wrapped"] == [] and record["closed"]["threads"] == [], (rank, record["closed"])
        closed = record["closed"]
        assert closed["excepthook_restored"] and closed["einsum_restored"] and closed["exit_restored"], (rank, closed)


def test_the_readable_losses_switched_off(loop_plans, single_device, tmp_path):
    """``AUTODIST_READABLE=0``: nothing is patched and no thread starts; every rank reads the
    loss, as Paddle reads it (a collective), to the single-device value."""
    ranks, path = loop_plans("gpt", "dp2")
    one = single_device("read_anywhere.py", "--model", "gpt")
    run_script("read_anywhere.py", tmp_path / "off", ranks, path, "--model", "gpt", "--readable-off")
    reference = json.loads((one.out / "rank0.json").read_text())["reads"]
    for rank in range(ranks):
        record = json.loads((tmp_path / "off" / f"rank{rank}.json").read_text())
        assert record["reads"]["item"] == pytest.approx(reference["item"], rel=1e-5), rank
        assert record["after"] == {"noted": 0, "posted": 0, "reads": 0, "fetched": 0, "served": 0}, rank
        assert record["closed"]["wrapped_before"] == 0 and record["closed"]["threads"] == [], rank
