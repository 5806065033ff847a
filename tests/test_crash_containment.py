"""A Paddle crash inside the planner's SPMD replay is contained (issue #30, item 4): the rule runs
in the rule worker's process (planner/recognise/rule_worker.py), its crash is that op's refusal
with a warning naming the op, and the plan is still written, the same plan every time.

The crash is real: Paddle 3.3.1's ``flatten`` rule segfaults on a range holding one size the trace
knows only at run time (docs/paddle-notes.md, "SPMD rules"). The planner avoids that call
(``ops.SIZE_RULE_OPS``); these tests switch the avoidance off so the rule is reached."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

from harness.cli import ROOT

from autodist.planner.recognise.rule_worker import RULES, RuleCrashed, RuleWorker

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
    RULES.close()  # as the driver does after each plan: no child outlives planning
    assert not multiprocessing.active_children()


def test_the_rule_worker_ends_by_itself_when_a_plan_closes_it():
    """The driver closes the worker after each plan: its child, reading until the pipe closes,
    exits on its own at once (exit 0). While it held a copy of the planner's end of the pipe (the
    fork copies it) it never saw the pipe close, and was killed (SIGKILL) after ``end`` had waited
    5 s for it: 5 s added to every plan."""
    worker = RuleWorker()  # not RULES: its answers are kept, so a call it made before forks no child
    assert worker.infer(*MATMUL).outputs == [((-1, 0), False)]
    child = worker._child
    worker.close()
    assert child.exitcode == 0


#: Switches the planner's avoidance of that call off, in the planning process.
AVOIDANCE_OFF = """
import autodist.planner.recognise.spmd as spmd
spmd.SIZE_RULE_OPS = frozenset()
"""
#: Makes every local-view proof meet that crash, in the process that runs the proof.
PROOF_CRASHES = f"""
import paddle.distributed as dist
import autodist.planner.local_view_proof as proof
from autodist.planner.recognise.rule_worker import _ask

def discover(*args):  # Paddle's flatten rule, called in the proof's own process
    _ask("flatten", dist.ProcessMesh([0, 1], dim_names=["mp"]), *{CRASHING[2:]!r})

proof.discover = discover
"""


#: Makes tracing meet that crash, in the planning process itself (where nothing contains it).
TRACE_CRASHES = PROOF_CRASHES.replace("autodist.planner.local_view_proof", "autodist.planner.trace").replace(
    "proof.discover = discover", "proof.trace_model = discover"
)
GPT2 = ROOT / "tests" / "models" / "zoo" / "gpt2_hf.py"


def run_planner(out, target, patch: str) -> subprocess.CompletedProcess:
    """``autodist-plan TARGET -o OUT`` at mp 2 as the console script runs it, in a process of its
    own (a crash shows as a signal), after the lines ``patch``."""
    argv = ["autodist-plan", str(target), "--devices", "2", "--mp", "2", "-o", str(out)]
    script = f"{patch}\nimport sys\nfrom autodist.planner.cli.main import main\nsys.argv = {argv!r}\nmain()\n"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)


def plan_in_a_process(tmp_path, name: str, target, patch: str = "") -> tuple[subprocess.CompletedProcess, bytes]:
    """:func:`run_planner`: a plan and no traceback."""
    out = tmp_path / f"{name}.json"
    done = run_planner(out, target, patch)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done, out.read_bytes()


def test_a_crash_in_the_replay_is_that_ops_refusal_and_the_plan_is_written_the_same_every_time(tmp_path):
    done, plan = plan_in_a_process(tmp_path, "first", MODEL, AVOIDANCE_OFF)
    crash = "Paddle's SPMD rule flatten crashed (SIGSEGV) on pd_op.flatten [2, -1, 48] in blocks.0"
    assert f"warning: {crash}" in done.stderr
    assert crash in plan.decode()
    _, again = plan_in_a_process(tmp_path, "again", MODEL, AVOIDANCE_OFF)
    assert again == plan  # byte for byte
    # the crash refused the op as the avoidance does: the same plan, but for the note
    _, avoided = plan_in_a_process(tmp_path, "avoided", MODEL)
    crashed = json.loads(plan)
    crashed["notes"] = [note for note in crashed["notes"] if not note.startswith(crash)]
    assert crashed == json.loads(avoided)


def test_a_crash_in_a_local_view_proof_leaves_the_attention_gathered_and_the_plan_is_written(tmp_path):
    """GPT-2's attentions are proven as local views (a fused ``c_attn``); a Paddle crash in the
    proof's process leaves them gathered, with a note and a warning naming the crash."""
    done, plan = plan_in_a_process(tmp_path, "crashed", GPT2, PROOF_CRASHES)
    crash = "the local-view proof crashed (SIGSEGV) in Paddle"
    assert done.stderr.count(crash) == 1  # one warning for the kind
    notes = " ".join(json.loads(plan)["notes"])
    assert (
        f"local view: transformer.h.0.attn and 1 more like it stay global (fused projection gathered): {crash}" in notes
    )
    assert json.loads(plan)["local_view"] == []
    _, again = plan_in_a_process(tmp_path, "again", GPT2, PROOF_CRASHES)
    assert again == plan  # byte for byte


def test_a_crash_the_planner_does_not_contain_ends_in_one_error_line_naming_the_step(tmp_path):
    """Tracing runs the user's forward in the planner's process: a Paddle crash there (the
    flatten rule called where the trace runs) ends the command's child; ``autodist-plan`` says so
    in one ``error:`` line naming the step, exits 2, prints no C++ dump and writes nothing."""
    out = tmp_path / "plan.json"
    done = run_planner(out, GPT2, TRACE_CRASHES)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.splitlines()[-1] == (
        "error: autodist-plan crashed (SIGSEGV) in Paddle while tracing GPT2LMHeadModel; nothing was written; "
        "please report it with the model"
    )
    assert "Traceback" not in done.stderr and "C++" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()


#: Makes the local-view proof of Phi-3's fused ``gate_up_proj`` MLP meet that crash, and of no other kind.
MLP_PROOF_CRASHES = PROOF_CRASHES.replace(
    "def discover(*args):  # Paddle's flatten rule, called in the proof's own process\n",
    "own = proof.discover\n\ndef discover(layer, *args):  # the MLP's: Paddle's flatten rule, in the proof's process\n"
    "    if type(layer).__name__ != 'Phi3MLP':\n        return own(layer, *args)\n",
)
PHI3 = ROOT / "tests" / "models" / "zoo" / "phi3_hf.py"


def test_a_crash_in_one_kinds_proof_leaves_that_kind_gathered_and_proves_the_others(tmp_path):
    """Phi-3's fused ``qkv_proj`` attentions and fused ``gate_up_proj`` MLPs are both local views
    at mp 2. Each kind is proven in a child of its own: a Paddle crash in the MLPs' proof leaves
    the MLPs gathered, with a note naming the crash, and the attentions still run as views."""
    _, plain = plan_in_a_process(tmp_path, "plain", PHI3)
    assert [v["layer"] for v in json.loads(plain)["local_view"]] == [
        "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.self_attn", "model.layers.1.mlp"
    ]  # fmt: skip
    _, plan = plan_in_a_process(tmp_path, "crashed", PHI3, MLP_PROOF_CRASHES)
    assert [v["layer"] for v in json.loads(plan)["local_view"]] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    notes = " ".join(json.loads(plan)["notes"])
    assert "local view: model.layers.0.mlp and 1 more like it stay global" in notes
    assert "the local-view proof crashed (SIGSEGV) in Paddle, so no local view was proven" in notes


def test_a_forked_child_never_collects_the_garbage_it_inherited(tmp_path):
    """A child forked by the planner (the local-view proof, the rule worker) collects only its own
    garbage. The parent's uncollected garbage held Paddle objects whose destructors wait on a
    condition variable a parent's thread waited on: collected in the child, it hung for ever in
    pthread_cond_destroy (an xdist worker waited on it at 97 % of a whole make test)."""
    import gc
    import os

    from autodist.planner.contained import run_forked

    finalised = tmp_path / "finalised"

    class Garbage:
        def __del__(self):
            with open(finalised, "a") as f:
                f.write(f"{os.getpid()}\n")

    def collect_in_the_child() -> int:
        gc.collect()
        return os.getpid()

    gc.disable()
    try:
        garbage = Garbage()
        garbage.cycle = garbage  # unreachable after the del, until a collection finds it
        del garbage
        child = run_forked("collecting", collect_in_the_child)
    finally:
        gc.enable()
        gc.collect()
    assert finalised.read_text().split() == [str(os.getpid())], f"the child {child} finalised it too"
