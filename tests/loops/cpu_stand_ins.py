"""TEST-ONLY: run a loop script with the CPU stand-ins for what gloo lacks.

Paddle 3.3.1's gloo has no reduce-scatter (ZeRO) and times out in ``batch_isend_irecv`` (1F1B)
(docs/paddle-notes.md), so ``apply_plan`` refuses such plans on gloo unless the caller supplies
the operations itself. This wrapper does what the harness does for its own runs
(harness/cpu_substitutes.py: reshards through Replicate, blocking send/recv in place of
``batch_isend_irecv``) and then runs the script, unchanged, as ``__main__``::

    python -m loops.cpu_stand_ins tests/loops/scripts/tied_pipeline.py --plan pp2.json --out run
"""

import runpy
import sys

import autodist
from harness.cpu_substitutes import blocking_p2p, everywhere

apply_plan = autodist.apply_plan

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    with everywhere() as reshard_fn, blocking_p2p():

        def apply_plan_with_stand_ins(*args, **kwargs):
            stand_ins = ["reduce_scatter", "all_to_all", "batched_p2p"]
            return apply_plan(*args, reshard_fn=reshard_fn, stand_ins=stand_ins, **kwargs)

        autodist.apply_plan = apply_plan_with_stand_ins
        runpy.run_path(script, run_name="__main__")
