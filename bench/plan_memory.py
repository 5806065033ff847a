"""Planning in a loop: the memory ``autodist.plan()`` keeps from one call to the next.

In a fresh process: the docstring Llama (``plans/llama_docstring/model.py``, 2 decoder layers at
the file's own sizes, built once under ``LazyGuard``) planned ``--calls`` times with
``autodist.plan(model, specs, devices=2, device="cpu")``, the resident set size read from
``/proc/self/statm`` after each call (after ``gc.collect()``). The first call pays for imports and
caches; growth is measured from the second call to the last.

Run: ``make bench`` or ``.venv/bin/python bench/plan_memory.py [--calls 20] [--markdown]``.
The numbers go to docs/benchmarks.md by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "plans" / "llama_docstring" / "model.py"


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def plan_in_a_loop(calls: int) -> dict:
    """Runs in the child process."""
    import gc

    import autodist
    from autodist.planner.load import load_target

    loaded = load_target(str(MODEL))
    rss = []
    for _ in range(calls):
        autodist.plan(loaded.model, loaded.input_specs, devices=2, device="cpu")
        gc.collect()
        rss.append(rss_mb())
    return {"calls": calls, "rss_mb": rss}


def in_child(calls: int) -> dict:
    env = dict(os.environ, LLAMA_DOCSTRING_NUM_LAYERS="2")
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import plan_memory; "
    code += f"print(json.dumps(plan_memory.plan_in_a_loop({calls})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"plan_memory: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(row: dict) -> dict:
    rss = row["rss_mb"]
    growth = rss[-1] - rss[1]
    return {
        "calls": row["calls"],
        "first_mb": rss[0],
        "second_mb": rss[1],
        "last_mb": rss[-1],
        "growth_mb": growth,
        "per_call_kb": growth * 1024 / max(len(rss) - 2, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--markdown", action="store_true", help="Print a table row for docs/benchmarks.md.")
    args = parser.parse_args()
    row = summary(in_child(args.calls))
    print(json.dumps(row), file=sys.stderr, flush=True)
    if args.markdown:
        sys.path.insert(0, str(ROOT / "bench"))
        from plan_time import machine

        print(f"Machine: {machine()}\n")
        print(
            "| calls | RSS after call 1 MB | after call 2 MB | after the last MB | growth 2 → last MB | per call KB |"
        )
        print("|---|---|---|---|---|---|")
        print(
            f"| {row['calls']} | {row['first_mb']:.1f} | {row['second_mb']:.1f} | {row['last_mb']:.1f} | "
            f"{row['growth_mb']:.1f} | {row['per_call_kb']:.0f} |"
        )


if __name__ == "__main__":
    main()
