"""Back-to-back 2-rank agreements on this machine: does rank 0 ever fail to find a port?

Each launch is a real 2-process job on loopback with the job's ``PADDLE_*`` environment
(tests/harness/launcher.py), running the agreement step exactly as ``apply_plan`` does
(tests/harness/agree_rank.py: without Paddle, so a launch takes about a second), with the
master's port + 1 -- the agreement's old default port -- held by a silent listener whenever it
is free. Every launch should agree; a failure is printed with both ranks' output.

Run: ``.venv/bin/python bench/agree_launches.py [--launches 200]``; one JSON line. The numbers go
to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.agree_rank import launch_agreement  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200)
    args = parser.parse_args()
    start, agreed, held, failures = time.monotonic(), 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for launch in range(args.launches):
            ok, was_held, report = launch_agreement(Path(tmp) / str(launch))
            agreed, held = agreed + ok, held + was_held
            if not ok:
                failures.append(report)
    summary = {"launches": args.launches, "agreed": agreed, "master_port_plus_1_held": held}
    print(json.dumps({**summary, "seconds": round(time.monotonic() - start, 1), "failures": failures[:3]}))


if __name__ == "__main__":
    main()
