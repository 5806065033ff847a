"""A Paddle crash inside the planner's SPMD replay is contained (issue #30, item 4): the rule runs
in the rule worker's process (planner/recognise/rule_worker.py), its crash is that op's refusal
with a warning naming the op, and the plan is still written, the same plan every time.

The crash is real: Paddle 3.3.1's ``flatten`` rule segfaults on a range holding one size the trace
knows only at run time (docs/paddle-notes.md, "SPMD rules"). The planner avoids that call
(``ops.SIZE_RULE_OPS``); these tests switch the avoidance off so the rule is reached."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from harness.cli import ROOT

from autodist.planner.recognise.rule_worker import RULES, RuleCrashed

#: Blocks whose MLP runs on ``x.flatten(0, 1)`` of a ``[2, None, 48]`` input: ``[2, -1, 48]``.
MODEL = ROOT / "tests" / "models" / "tokens_flattened.py"
#: Paddle's flatten rule on the range (2, -1): a SIGSEGV in the process that asks it.
CRASHING = ("flatten", (0, 1), [((2, -1, 48), (-1, -1, -1), False)], [0, 1])
MATMUL = ("matmul", (0, 1), [((8, 6), (-1, -1), False), ((6, 4), (-1, 0), False)], [False, False])


def test_a_rule_that_crashes_raises_in_the_planner_and_the_next_rule_still_answers():
    """In this very process: without the worker the flatten call would kill pytest."""
    try:
        RULES.infer(*CRASHING)
    except RuleCrashed as crash:
        assert str(crash) == "Paddle's SPMD rule flatten crashed (SIGSEGV)"
    else:
        raise AssertionError("Paddle's flatten rule no longer crashes on a -1 size: find another crash")
    assert RULES.infer(*MATMUL).outputs == [((-1, 0), False)]  # a new child answers


def plan_with_the_avoidance(tmp_path, name: str, avoided: bool) -> tuple[subprocess.CompletedProcess, bytes]:
    """``autodist-plan`` on :data:`MODEL` at mp 2 in a process of its own (a crash shows as a
    signal), with ``SIZE_RULE_OPS`` as the planner has it, or empty."""
    out = tmp_path / f"{name}.json"
    script = textwrap.dedent(
        f"""
        import sys
        import autodist.planner.recognise.spmd as spmd
        if not {avoided}:
            spmd.SIZE_RULE_OPS = frozenset()  # Paddle's flatten rule meets the -1 size
        from autodist.planner.cli.main import main
        sys.argv = ["autodist-plan", {str(MODEL)!r}, "--devices", "2", "--mp", "2", "-o", {str(out)!r}]
        main()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done, out.read_bytes()


def test_a_crash_in_the_replay_is_that_ops_refusal_and_the_plan_is_written_the_same_every_time(tmp_path):
    done, plan = plan_with_the_avoidance(tmp_path, "first", avoided=False)
    crash = "Paddle's SPMD rule flatten crashed (SIGSEGV) on pd_op.flatten [2, -1, 48] in blocks.0"
    assert f"warning: {crash}" in done.stderr
    assert crash in plan.decode()
    _, again = plan_with_the_avoidance(tmp_path, "again", avoided=False)
    assert again == plan  # byte for byte
    # the crash refused the op as the avoidance does: the same plan, but for the note
    _, avoided = plan_with_the_avoidance(tmp_path, "avoided", avoided=True)
    crashed = json.loads(plan)
    crashed["notes"] = [note for note in crashed["notes"] if not note.startswith(crash)]
    assert crashed == json.loads(avoided)
