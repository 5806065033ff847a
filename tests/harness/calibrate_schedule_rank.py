"""TEST-ONLY: one gloo rank of ``calibrate --model``'s training-step timing for a 1F1B plan, with
the blocking P2P stand-in (cpu_substitutes.py) in place of the batched P2P gloo lacks.

``autodist-plan calibrate`` refuses to time a schedule the backend cannot run (it never fits a
stand-in's seconds), so on CPU its own command never reaches the code that times the plan's
schedule; a GPU runs it (tests/test_calibrate.py's ``gpu`` test). This script drives that code,
``planner/cost/calibrate.measure_training_step``, on gloo with the stand-in, to prove what it
runs: apply_plan's ``PipelineModel.step`` once per optimizer step, each call the plan's
micro-batches. The seconds it returns are the stand-in's, written only to be checked positive.

    python calibrate_schedule_rank.py MODEL_FILE PLAN 'out/rank{rank}.json'     # on every rank
"""

from __future__ import annotations

import json
import sys

import paddle.distributed as dist
from harness.cpu_substitutes import blocking_p2p

import autodist.applier
from autodist.applier.modes.pipeline import PipelineModel
from autodist.planner import driver
from autodist.planner.cost import calibrate
from autodist.schemas import load_plan


def main(model_file: str, plan_file: str, out: str) -> None:
    dist.init_parallel_env()
    plan = load_plan(plan_file)
    loaded = driver.load(model_file)
    apply_plan, step = autodist.applier.apply_plan, PipelineModel.step
    calls: list[int] = []

    def with_stand_in(*args, **kwargs):
        return apply_plan(*args, stand_ins=["batched_p2p"], **kwargs)

    def counted_step(self, *inputs, target=None):
        losses = step(self, *inputs, target=target)
        calls.append(self.schedule._n_microbatches)
        return losses

    autodist.applier.apply_plan, PipelineModel.step = with_stand_in, counted_step
    with blocking_p2p():
        seconds = calibrate.measure_training_step(loaded.model, plan, loaded.input_specs)
    with open(out.format(rank=dist.get_rank()), "w") as f:
        json.dump({"seconds": seconds, "micro_batches_per_call": calls}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
