"""TEST-ONLY: run a loop script with the CPU stand-in for what gloo lacks under a 1F1B plan.

Paddle 3.3.1's gloo times out in ``batch_isend_irecv`` (docs/paddle-notes.md), so ``apply_plan``
refuses a 1F1B plan on gloo unless the caller supplies batched P2P itself. This wrapper does what
the harness does for its own pipeline runs (harness/cpu_substitutes.py: blocking send/recv in
place of ``batch_isend_irecv``) and then runs the script, unchanged, as ``__main__``::

    python -m loops.cpu_stand_ins tests/loops/scripts/tied_pipeline.py --plan pp2.json --out run
"""

import runpy
import sys

import autodist
from harness.cpu_substitutes import blocking_p2p

apply_plan = autodist.apply_plan


def apply_plan_with_stand_ins(*args, **kwargs):
    return apply_plan(*args, stand_ins=["batched_p2p"], **kwargs)


if __name__ == "__main__":
    autodist.apply_plan = apply_plan_with_stand_ins
    script, sys.argv = sys.argv[1], sys.argv[1:]
    with blocking_p2p():
        runpy.run_path(script, run_name="__main__")
