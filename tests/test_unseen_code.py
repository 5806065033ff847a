"""Unseen community code never crashes the planner: a model whose sizes the trace knows only at
run time (read with ``paddle.shape``, or a None in the input spec) gets a plan or one ``error:``
line, never a signal or a traceback (issue #30, item 4)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
    assert "no local view of it was proven (its argument past_key_values is a DynamicCache" in done.stderr


def _forward_line(path, cls: str) -> int:
    """The line of ``def forward`` in class ``cls`` of the file at ``path``."""
    lines = path.read_text().splitlines()
    start = lines.index(f"class {cls}(nn.Layer):")
    return next(i for i, line in enumerate(lines[start:], start + 1) if line.strip().startswith("def forward("))


def test_what_stays_replicated_is_warned_and_explained_with_the_line_and_the_rewrite(tmp_path):
    """SAM's attention stays replicated (its sizes come from paddle.shape): one warning, and one
    line under --explain, each naming the attention's forward (file:line) and the rewrite."""
    done, out = plan_command(tmp_path, SAM, "--explain")
    assert done.returncode == 0, done.stderr[-2000:]
    # the file as the plan's notes name it: relative to the working directory (the repository here)
    where = f"model code: Attention.forward at {SAM.relative_to(ROOT)}:{_forward_line(SAM, 'Attention')}"
    rewrite = "to split it: read the sizes with x.shape (Python ints under a fixed input spec) instead of paddle.shape"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: blocks.*.attn")]
    assert len(warnings) == 1 and where in warnings[0] and rewrite in warnings[0], done.stderr
    explained = done.stderr.split("why these stay gathered or replicated, and what to change:\n", 1)[1]
    assert explained.startswith("  blocks.*.attn.proj: ") and where in explained.splitlines()[0], explained
    assert rewrite in explained.splitlines()[0]


def test_a_fused_projection_read_by_f_linear_is_warned_with_the_line_and_the_rewrite(tmp_path):
    """timm's BEiT (qkv_bias=False) computes q|k|v as ``F.linear(x, weight=self.qkv.weight, ...)``:
    the qkv layer's forward never runs, so no hook on it can gather its output. Without local views
    (which split it: tests/test_zoo.py), one warning names the attention's forward and the rewrite,
    calling the layer itself."""
    beit = ROOT / "tests" / "models" / "zoo" / "beit_timm.py"
    done, out = plan_command(tmp_path, f"{beit}:build_without_qkv_bias", "--no-local-view")
    assert done.returncode == 0, done.stderr[-2000:]
    where = f"model code: Attention.forward at {beit.relative_to(ROOT)}:{_forward_line(beit, 'Attention')}"
    rewrite = "to split it: call the projection's own layer (self.qkv(x), adding any bias of your own after it)"
    warnings = [line for line in done.stderr.splitlines() if "fused projection inside a larger layer" in line]
    assert len(warnings) == 1 and where in warnings[0] and rewrite in warnings[0], done.stderr


def test_projections_by_a_parameters_slices_are_warned_with_the_line_and_the_rewrite(tmp_path):
    """PaddleDetection's DETR projects q, k and v by ``F.linear`` of column slices of one
    ``in_proj_weight`` (ppdet's ``MultiHeadAttention.compute_qkv``), which the planner splits as no
    projection: each attention's warning names the line slicing it and the rewrite, a Linear per
    slice (with those, tests/models/zoo/detr_ppdet.py's attention splits), and, where the
    decoder's sizes come from ``paddle.shape``, that rewrite too."""
    detr = ROOT / "tests" / "models" / "zoo" / "detr_ppdet.py"
    done, out = plan_command(tmp_path, detr)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(n for n, text in enumerate(detr.read_text().splitlines(), 1) if "self.in_proj_weight[" in text)
    where = f"model code: MultiHeadAttention.compute_qkv at {detr.relative_to(ROOT)}:{line}"
    rewrite = "to split it: give each slice of in_proj_weight a Linear layer of its own and call it (self.q_proj(x)"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ") and "out_proj: op" in line]
    assert [w.split(":")[1].strip() for w in warnings] == [
        f"transformer.{kind}.out_proj"
        for kind in ("encoder.layers.*.self_attn", "decoder.layers.*.cross_attn", "decoder.layers.*.self_attn")
    ], done.stderr
    assert all(where in w and rewrite in w for w in warnings), warnings
    assert ["instead of paddle.shape" in w for w in warnings] == [False, True, True], warnings


def test_batched_experts_read_between_traced_layers_are_warned_with_the_line_and_the_rewrite(tmp_path):
    """HF DBRX's ``DbrxExperts.forward`` views its batched weights ``w1``, ``v1``, ``w2`` per expert
    in a loop that does not trace (the model is traced block by block) and hands the slices to
    ``DbrxExpertGLU``, whose traced forward never reads its own parameters: one warning per kind
    of layer names the layer holding it (file:line) and the rewrite, where before it said only
    that no pattern matched."""
    dbrx = ROOT / "tests" / "models" / "zoo" / "dbrx_hf.py"
    done, out = plan_command(tmp_path, dbrx)
    assert done.returncode == 0, done.stderr[-2000:]
    where = f"model code: DbrxExperts.forward at {dbrx.relative_to(ROOT)}:{_forward_line(dbrx, 'DbrxExperts')}"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ") and "experts.mlp" in line]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith(
        "warning: layer transformer.blocks.0-1.ffn.experts.mlp: no traced op reads its parameters (w1, v1, w2)"
    )
    assert where in warnings[0] and "to split it: read each in the forward of a layer of its own" in warnings[0]


def test_an_unproven_local_view_stopped_by_masked_fill_names_the_where_rewrite():
    """An attention scored by masked_fill (no SPMD rule in Paddle), whose local view cannot be
    proven (its head count is a module constant): the warning gives the proof's reason, the
    forward and the rewrite that keeps the heads split in Paddle's global view."""
    from test_mask_spellings import B, D, S, Encoder, ModuleConstantHeads

    import paddle

    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_model

    model = Encoder("expand_as+masked_fill", True)
    for i, layer in enumerate(model.layers):
        model.layers[i] = ModuleConstantHeads(layer.spelling)
    spec = [paddle.static.InputSpec([B, S, D], "float32", "x"), paddle.static.InputSpec([B, S], "int64", "mask")]
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    kept = plan_model(model, spec, request, {"target": "Encoder"}).kept_whole
    assert len(kept) == 1, kept
    assert kept[0].startswith("local view: layers.0 and 1 more like it stay global (replicated")
    assert "; model code: ModuleConstantHeads.forward at " in kept[0]
    assert kept[0].endswith(
        "; to split it: "
        + "write paddle.where(mask, paddle.full_like(scores, value), scores), which keeps the heads split"
    )


def test_a_failure_inside_the_planner_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """Whatever breaks inside the planner on a model it has not seen (here the recognition stage,
    made to fail), the command says so in one ``error:`` line naming the exception and where it was
    raised, exit 2, no plan written."""
    from click.testing import CliRunner

    from autodist.planner import driver
    from autodist.planner.cli import cli

    def broken(*args, **kwargs):
        raise IndexError("list index out of range\nsecond line")

    monkeypatch.setattr(driver, "analyse", broken)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, [str(SAM), "--devices", "2", "-q", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        f"error: planning {SAM} failed inside the planner: IndexError: list index out of range (raised at "
    ), result.stderr
    assert "test_unseen_code.py:" in result.stderr and not out.exists()


def test_a_zero_width_slice_a_local_view_could_hold_names_the_strategies_that_run_it():
    """HF Phi-3 (tests/models/zoo/phi3_hf.py) has the same empty slice; its attention is proven as
    a local view at mp2 and trains (tests/test_train_zoo.py). On one device no local view runs:
    refused, saying which strategies run one."""
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.errors import PlannerError
    from harness.planning import plan_target

    target = "tests/models/zoo/phi3_hf.py"
    assert plan_target(target, None, SearchRequest(devices_per_node=2, mp=2), {}, local_view=True).plan.local_view
    with pytest.raises(PlannerError, match=r"zero-width slice \(\[2, 4, 16, 0\]\)") as refused:
        plan_target(target, None, SearchRequest(devices_per_node=1), {}, local_view=True)
    assert "only as a local view, which runs under tensor and data parallelism alone (give --mp" in str(refused.value)
