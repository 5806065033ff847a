"""Unseen community code never crashes the planner: a model whose sizes the trace knows only at
run time (read with ``paddle.shape``, or a None in the input spec) gets a plan or one ``error:``
line, never a signal or a traceback (issue #30, item 4)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness.cli import ROOT

SAM = ROOT / "tests" / "models" / "zoo" / "sam_encoder.py"


def plan_command(tmp_path, target, *options):
    """``autodist-plan TARGET`` in a process of its own (a segfault would show as a signal)."""
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "autodist.planner.cli", str(target), "--devices", "2", "--mp", "2", "-o", str(out)]
    done = subprocess.run([*command, *options], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done, out


def assert_plan_or_one_error(done, out):
    assert done.returncode in (0, 2), (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    if done.returncode == 2:
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
        assert not out.exists()
    else:
        assert out.exists()


def test_a_flatten_of_run_time_sizes_is_not_handed_to_paddles_rule():
    """Paddle 3.3.1's ``flatten`` SPMD rule segfaults on a range holding one size unknown to the
    trace (docs/paddle-notes.md, "SPMD rules"): the replay takes such an op as needing whole inputs
    instead of asking the rule. In a process of its own, since the rule kills the process."""
    script = textwrap.dedent(
        """
        import networkx as nx
        import paddle.distributed as dist
        from autodist.planner.recognise.spmd import Replay

        g = nx.DiGraph()
        common = dict(layer="", dtypes=["float32"], param=None, consts={})
        g.add_node(0, op="pd_op.data", shapes=[[2, -1, 48]], attrs={}, **common)
        g.add_node(1, op="pd_op.flatten", shapes=[[-1, 48]], attrs={"start_axis": 0, "stop_axis": 1}, **common)
        g.add_edge(0, 1, operand=0, result=0)
        replay = Replay(g, frozenset({1}), {}, dist.ProcessMesh([0, 1], dim_names=["mp"]), frozenset())
        replay.run()
        print(replay.values[1, 0].dims)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip().splitlines()[-1] == "(-1, -1)"


def test_sam_encoder_reading_its_sizes_with_paddle_shape_gets_a_plan(tmp_path):
    """Segment Anything's encoder (tests/models/zoo/sam_encoder.py) reads ``B, H, W`` with
    ``paddle.shape`` and folds its heads back with ``flatten``: a plan, whose MLPs are split."""
    done, out = plan_command(tmp_path, SAM)
    assert_plan_or_one_error(done, out)
    assert done.returncode == 0


def test_a_none_batch_in_the_input_spec_refuses_the_proof_with_a_reason(tmp_path):
    """timm's ViT with ``InputSpec([None, ...])``, as Paddle's export examples write it: the local
    view's proof cannot run at a size of -1 (numpy raised ``negative dimensions are not allowed``
    through the planner); the view is refused with the reason, and the plan is written."""
    model = tmp_path / "vit_any_batch.py"
    model.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(ROOT / "tests" / "models" / "zoo")!r})
            import paddle
            from vit import CHANS, IMG, build_model

            def input_spec():
                return [paddle.static.InputSpec([None, CHANS, IMG, IMG], "float32", "pixels")]
            """
        )
    )
    done, out = plan_command(tmp_path, model, "--explain")
    assert_plan_or_one_error(done, out)
    assert done.returncode == 0
    assert "has a size known only at run time ([-1, 17, 32] in the trace" in out.read_text()


def test_a_zero_width_slice_on_distributed_tensors_is_refused_in_one_line_naming_the_forward(tmp_path):
    """PaddleFormers' Phi-3 (partial_rotary_factor 1) concatenates back ``q[..., rotary_dim:]``,
    empty; its backward segfaults on every rank on distributed tensors (docs/paddle-notes.md). Its
    attention takes a cache object, so no local view of it is proven: refused before any plan,
    naming the attention's forward (file:line) and the rewrite. The plan used to be written and
    the training died with SIGSEGV (tests/test_train_zoo.py skipped it)."""
    done, out = plan_command(tmp_path, "tests/models/paddleformers_models.py:build_phi3", "-q")
    assert_plan_or_one_error(done, out)
    assert done.returncode == 2
    assert "model.layers.0.self_attn (Phi3Attention.forward at " in done.stderr
    assert "paddleformers/transformers/phi3/modeling.py:" in done.stderr
    assert "zero-width slice ([2, 4, 8, 0])" in done.stderr and "rotate q and k whole" in done.stderr
