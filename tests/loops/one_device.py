"""TEST-ONLY: the single-device runs of several loop scripts, one after another in one process,
so that the suite starts Python and imports Paddle (and PaddleFormers) once for all of them
instead of once a script. Each script runs unchanged, as ``python script.py ARGS`` runs it: its
own ``sys.argv``, as ``__main__``; it seeds Paddle and builds its model itself. A run that an
earlier one disturbed could only differ from the distributed runs (each a fresh process) it is
compared with: it would fail the comparison, not pass it.

    python -m loops.one_device runs.json    # [["scripts/amp.py", "--out", "run", "--level", "O1"], ...]

A script that raises leaves its traceback in ``<its --out>/failed.txt`` and the next one runs.
"""

import json
import runpy
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        sys.argv = list(argv)
        print(f"=== {' '.join(argv)}", flush=True)
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except BaseException:  # SystemExit too: the next script still runs
            (out / "failed.txt").write_text(traceback.format_exc())
