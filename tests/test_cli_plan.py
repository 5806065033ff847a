"""The plan command: options, output, determinism, and one clear line + exit 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autodist.planner.cli import cli
from autodist.schemas import load_plan
from harness.cli import DOCSTRING, ROOT, run, tiny_docstring  # noqa: F401 (autouse fixture)


def test_plan_is_the_default_command_and_writes_a_valid_plan(tmp_path):
    out = tmp_path / "plan.json"
    result = run(DOCSTRING, "--devices", 4, "--dp", 2, "--mp", 2, "--device", "a100-80g", "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert (plan.strategy.dp, plan.strategy.mp, plan.strategy.pp) == (2, 2, 1)
    assert plan.cluster.device.name == "a100-80g" and plan.cluster.devices_per_node == 4
    assert plan.provenance.arguments["dp"] == "2" and plan.provenance.arguments["target"] == DOCSTRING
    assert "output" not in plan.provenance.arguments
    assert "plan for 4 devices: dp2 · mp2 · pp1" in result.stderr and str(out) in result.stderr
    assert plan.estimate.step_time_s > 0


def test_planning_twice_gives_identical_bytes(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for out in (first, second):
        assert run("plan", DOCSTRING, "--devices", 8, "--quiet", "-o", out).exit_code == 0
    assert first.read_bytes() == second.read_bytes()


def test_stdout_when_no_output_and_quiet_is_silent():
    result = run(DOCSTRING, "--devices", 2, "--quiet")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["format"] == "autodist.plan"
    assert result.stderr == ""


def test_input_spec_option_replaces_the_files(tmp_path):
    out = tmp_path / "plan.json"
    assert run(DOCSTRING, "--input-spec", "input_ids:int64:2x8", "-q", "-o", out).exit_code == 0
    assert load_plan(out).model.input_specs[0].shape == [2, 8]


def test_explain_prints_the_ranking_on_stderr(tmp_path):
    result = run(DOCSTRING, "--devices", 4, "--explain", "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert "dp" in result.stderr and "mp" in result.stderr
    assert len(result.stderr.splitlines()) > 3


def test_explain_says_how_each_block_kinds_sub_layers_run(tmp_path):
    """GPT-2 as HF writes it (tests/models/zoo/gpt2_hf.py: a fused c_attn, c_fc and c_proj MLP) at
    mp2: its attention runs as a local view (proven), or gathered with --no-local-view; its MLP is
    split either way. At mp1 nothing splits, and nothing is said."""
    gpt2 = ROOT / "tests" / "models" / "zoo" / "gpt2_hf.py"
    lines = {}
    for flag in ("--local-view", "--no-local-view"):
        result = run(gpt2, "--devices", 2, "--mp", 2, "--explain", "-q", flag, "-o", tmp_path / "p.json")
        assert result.exit_code == 0, result.output
        lines[flag] = result.stderr.splitlines()
    heading = "sub-layers over mp=2, by block kind (as the estimate prices them):"
    for flag, attention in (("--local-view", "local view"), ("--no-local-view", "gathered")):
        at = lines[flag].index(heading)
        assert lines[flag][at + 1] == f"  gpt_block x2: attention(qkv) {attention}; mlp(fc_in) split"
    one = run(gpt2, "--devices", 1, "--explain", "-q", "-o", tmp_path / "p.json")
    assert one.exit_code == 0, one.output
    assert not any(line.startswith("sub-layers over") for line in one.stderr.splitlines())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", 4, "--dp", 3, "--mp", 2], "devices"),
        (["--devices", 3, "--mp", 3], "--mp 3 does not divide the 4 heads of layers.0-1"),
        (["--devices", 4, "--pp", 4], "--pp 4 is more than the 2 blocks"),
        (
            ["--input-spec", "input_ids:int64:64"],
            # a 1-D input where the forward unpacks [batch, seq]: the forward raised, no fallback to a child
            "Model.forward raised ValueError: not enough values to unpack",
        ),
        (["--input-spec", "ids-int64"], "--input-spec 'ids-int64'"),
    ],
)
def test_bad_degrees_and_specs_exit_2_without_a_file(tmp_path, args, message):
    out = tmp_path / "plan.json"
    result = run(DOCSTRING, *args, "-o", out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ")
    if message:
        assert message in lines[0]
    assert not out.exists()


def test_bad_target_exits_2(tmp_path):
    result = run(tmp_path / "nope.py", "-o", tmp_path / "p.json")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "not found" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_failing_factory_shows_its_traceback_tail(tmp_path):
    target = tmp_path / "boom.py"
    target.write_text("def build_model():\n    raise ValueError('hidden size must be even')\n")
    result = run(target, "-o", tmp_path / "p.json")
    assert result.exit_code == 2
    first, *rest = result.stderr.splitlines()
    assert first.startswith("error: build_model() raised ValueError: hidden size must be even (at boom.py:2")
    assert any("raise ValueError" in line for line in rest)


def test_unmatched_layers_are_warned_about_and_noted(tmp_path):
    out = tmp_path / "plan.json"
    target = f"{ROOT / 'tests' / 'models' / 'paddleformers_models.py'}:build_cnn"
    result = run(target, "--input-spec", "images:float32:8x3x8x8", "--devices", 2, "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.strategy.dp == 2
    for layer in ("conv", "fc"):
        assert f"warning: layer {layer}" in result.stderr
        assert any(note.startswith(f"layer {layer}:") for note in plan.notes)


def test_a_model_built_eagerly_is_warned_about_and_noted(tmp_path):
    """A factory that reads a parameter's values while building (``nn.utils.weight_norm``) does
    not build under ``paddle.LazyGuard()``: planned from an eager build, said in a warning and in
    the plan's notes, naming the line the lazy build stopped at."""
    out, target = tmp_path / "plan.json", tmp_path / "normed.py"
    target.write_text(
        "import paddle\n"
        "def build_model():\n"
        "    fc = paddle.nn.Linear(8, 4)\n"
        "    return paddle.nn.utils.weight_norm(fc, name='weight', dim=1)\n"
        "INPUT_SPEC = [paddle.static.InputSpec([2, 8], 'float32', 'x')]\n"
    )
    result = run(target, "--devices", 2, "-o", out)
    assert result.exit_code == 0, result.output
    said = "build_model() does not build under paddle.LazyGuard() (NotImplementedError at normed.py:4 in build_model"
    assert f"warning: {said}" in result.stderr
    assert load_plan(out).notes[0].startswith(said)


# -- the first hour -----------------------------------------------------------------------------------


def test_an_output_folder_that_does_not_exist_is_refused_before_planning(tmp_path, monkeypatch):
    import autodist.planner.driver as driver

    monkeypatch.setattr(driver, "plan_target", lambda *a, **k: pytest.fail("planned before checking the output path"))
    result = run(DOCSTRING, "--devices", 2, "-o", tmp_path / "newdir" / "plan.json")
    assert result.exit_code != 0
    assert "newdir/plan.json: the folder" in result.output and "does not exist; create it first" in result.output
    assert "Traceback" not in result.output


def test_tp_and_zero_are_aliases_users_know(tmp_path):
    out = tmp_path / "plan.json"
    result = run(DOCSTRING, "--devices", 4, "--dp", 2, "--tp", 2, "--zero", 1, "--device", "h100-sxm", "-o", out)
    assert result.exit_code == 0, result.output
    strategy = load_plan(out).strategy
    assert (strategy.mp, strategy.sharding_stage) == (2, 1)


def test_more_fixed_degrees_than_devices_says_how_many_are_needed():
    result = run(DOCSTRING, "--dp", 4, "--mp", 2, "--devices", 4)
    assert result.exit_code != 0
    assert "dp=4 x mp=2 needs 8 devices, but there are 4" in result.output


def _plan_in_a_process(*args):
    """``autodist-plan`` as a user runs it: a fresh process, so Paddle and PaddleFormers print
    on import to the real descriptor 2 as they do in a terminal."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "autodist.planner.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


PF_LLAMA = f"{ROOT / 'tests' / 'models' / 'paddleformers_models.py'}:build_llama"


def test_importing_the_command_line_imports_no_paddle():
    """autodist-plan silences Paddle's import warnings (``No ccache found``) and glog before Paddle
    is imported (planner/quiet.py): a module the command line imports at the top that imports
    Paddle would print them on every run (export's import of recognise once did)."""
    code = "import sys, autodist.planner.cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'paddle'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[:2000] + done.stderr[-2000:]


def test_quiet_holds_back_what_paddle_and_paddleformers_print(tmp_path):
    # without --quiet the same run prints PaddleFormers' log lines (checked, so this test can fail)
    loud = _plan_in_a_process(PF_LLAMA, "--devices", 2, "--device", "h100-sxm", "-o", tmp_path / "loud.json")
    assert loud.returncode == 0, loud.stderr
    assert any(not line.startswith(("plan for", "warning:")) for line in loud.stderr.splitlines()), loud.stderr
    assert "Setuptools is replacing distutils" not in loud.stderr  # says nothing about the model, even without -q

    quiet = _plan_in_a_process(
        PF_LLAMA, "--devices", 2, "--device", "h100-sxm", "--quiet", "-o", tmp_path / "plan.json"
    )
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and quiet.stdout == ""
    assert load_plan(tmp_path / "plan.json").strategy.dp * load_plan(tmp_path / "plan.json").strategy.mp == 2


def test_quiet_still_prints_our_error_and_nothing_else(tmp_path):
    result = _plan_in_a_process(
        PF_LLAMA, "--devices", 2, "--dp", 3, "--device", "h100-sxm", "--quiet", "-o", tmp_path / "plan.json"
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: --dp 3 does not divide the 2 devices"]
    assert not (tmp_path / "plan.json").exists()


def test_held_stderr_drops_library_lines_but_replays_them_when_something_crashes(capfd):
    import os

    from autodist.planner.quiet import held_stderr
    from autodist.planner.errors import PlannerError

    with pytest.raises(PlannerError):
        with held_stderr(expected=(PlannerError,)):
            os.write(2, b"W1201 glog line\n")
            raise PlannerError("the user's mistake")
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError):
        with held_stderr(expected=(PlannerError,)):
            os.write(2, b"context of a crash\n")
            raise RuntimeError("a bug")
    assert capfd.readouterr().err == "context of a crash\n"


@pytest.mark.parametrize(
    "args, message",
    [
        ([DOCSTRING, "--bogus"], "error: no such option '--bogus' (see autodist-plan plan --help)"),
        (
            [DOCSTRING, "--devices", "x"],
            "error: invalid value for '--nproc-per-node' / '--nproc_per_node' / '--devices': 'x' is not a valid "
            "integer (see autodist-plan plan --help)",
        ),
        ([DOCSTRING, "--schedule", "zigzag"], "error: invalid value for '--schedule': 'zigzag' is not one of"),
        (
            [DOCSTRING, "--cluster", "/no/such/cluster.toml"],
            "error: invalid value for '--cluster': File '/no/such/cluster.toml' does not exist",
        ),
        (["diff", "only-one.json"], "error: missing argument 'NEW' (see autodist-plan diff --help)"),
        (["ckpt", "info"], "error: missing argument 'PATH' (see autodist-plan ckpt info --help)"),
        (["ckpt", "bogus"], "error: no such command 'bogus'"),
        (["show", "/no/such/plan.json"], "error: /no/such/plan.json: invalid plan: cannot read the plan file"),
        ([DOCSTRING, "--dp", 3, "--devices", 2], "error: --dp 3 does not divide the 2 devices"),
    ],
)
def test_every_error_has_one_style(args, message):
    result = CliRunner().invoke(cli, [str(a) for a in args], prog_name="autodist-plan")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0].startswith(message), result.stderr
    assert "Error:" not in result.stderr and "Usage:" not in result.stderr


def test_no_arguments_still_shows_the_help():
    result = CliRunner().invoke(cli, [], prog_name="autodist-plan")
    assert "Usage: autodist-plan" in result.output and "error:" not in result.output


def _cluster_file(tmp_path, cluster_table: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_table + '\n[device]\nbase = "h100-sxm"\ninter_node_bandwidth_gb_s = 25\n')
    return path


def test_the_cluster_files_shape_is_used_when_the_flags_leave_it_out(tmp_path):
    cluster = _cluster_file(tmp_path, "[cluster]\nnodes = 2\ndevices_per_node = 2\n")
    result = run(DOCSTRING, "--cluster", cluster, "-q", "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan.json")
    assert (plan.cluster.nodes, plan.cluster.devices_per_node) == (2, 2)
    assert plan.cluster.device.inter_node_bandwidth == 25e9
    assert (plan.provenance.arguments["nodes"], plan.provenance.arguments["devices"]) == ("2", "2")


def test_flags_win_over_the_cluster_files_shape(tmp_path):
    cluster = _cluster_file(tmp_path, "[cluster]\nnodes = 2\ndevices_per_node = 2\n")
    result = run(DOCSTRING, "--cluster", cluster, "--nodes", 1, "--devices", 4, "-q", "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan.json")
    assert (plan.cluster.nodes, plan.cluster.devices_per_node) == (1, 4)
    # one flag given: it wins, the other comes from the file
    result = run(DOCSTRING, "--cluster", cluster, "--devices", 1, "-q", "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan.json")
    assert (plan.cluster.nodes, plan.cluster.devices_per_node) == (2, 1)


@pytest.mark.parametrize(
    "table, message",
    [
        ("[cluster]\nnodes = 0\n", "[cluster].nodes must be a whole number from 1"),
        ("[cluster]\ndevices_per_node = 2.5\n", "[cluster].devices_per_node must be a whole number from 1"),
        ("[cluster]\ngpus = 8\n", "unknown key(s) in [cluster]: gpus"),
        ("cluster = 8\n", "cluster must be a table"),
    ],
)
def test_a_bad_cluster_table_is_one_error_line(tmp_path, table, message):
    cluster = _cluster_file(tmp_path, table)
    result = run(DOCSTRING, "--cluster", cluster, "-o", tmp_path / "plan.json")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert not (tmp_path / "plan.json").exists()


def test_the_documented_cluster_file_example_reads_as_documented(tmp_path):
    import re

    from autodist.planner.cost.hardware import _CLUSTER_KEYS, cluster_shape, load_cluster_file

    doc = (ROOT / "docs" / "cluster.md").read_text()
    (example,) = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    path = tmp_path / "cluster.toml"
    path.write_text(example)
    device = load_cluster_file(str(path))
    assert device.name == "lab-h100" and device.inter_node_bandwidth == 25e9 and device.inter_node_latency_s == 8e-6
    assert cluster_shape(str(path)) == (8, 2)
    assert cluster_shape(str(path), nodes=4) == (8, 4)
    for key in [*_CLUSTER_KEYS, "name", "base", "unsupported", "comm_overlap", "nodes", "devices_per_node"]:
        assert f"| `{key}` |" in doc, f"docs/cluster.md does not describe {key}"


def test_explain_speaks_shows_units_in_aligned_columns(tmp_path):
    import re

    out = tmp_path / "plan.json"
    explained = run(DOCSTRING, "--devices", 4, "--device", "h100-sxm", "--explain", "-q", "-o", out)
    assert explained.exit_code == 0, explained.output
    lines = explained.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "strategy"])
    end = next(i for i, line in enumerate(lines) if line.startswith("where the time of #1 goes"))
    table = lines[start:end]
    assert len(table) > 3

    def cells(line):  # a cell is words joined by single spaces; columns are two or more apart
        return list(re.finditer(r"\S+(?: \S+)*", line))

    header = cells(table[0])
    assert [c.group() for c in header][:5] == ["#", "strategy", "step", "tokens/s", "MFU"]
    for row in table[1:]:
        row_cells = cells(row)
        assert len(row_cells) == len(header), row
        # numbers end where their heading ends; the strategy starts where its heading starts
        assert [c.end() for c in row_cells[2:]] == [c.end() for c in header[2:]], (table[0], row)
        assert row_cells[1].start() == header[1].start()

    shown = run("show", out).stdout
    step, tokens, mfu = re.search(r"estimate  (.+) per step, (\S+) tokens/s, MFU (\S+)", shown).groups()
    memory = re.search(r"memory per rank  (.+?) of ", shown).group(1)
    first = [c.group() for c in cells(table[1])]
    assert first[2:6] == [step, tokens, mfu, memory], (first, shown)
    assert all(cell.endswith(("B", "KiB", "MiB", "GiB", "TiB")) for cell in first[5:]), first


def test_review_commands_report_errors_the_way_plan_does(tmp_path):
    """One exit-2 path (planner/cli/errors.py): `check` on a model whose factory fails prints the
    same error line and traceback tail as `plan`, not the message alone."""
    target = tmp_path / "boom.py"
    target.write_text("def build_model():\n    raise ValueError('hidden size must be even')\n")
    plan = tmp_path / "plan.json"
    assert run(DOCSTRING, "--devices", 2, "-o", plan).exit_code == 0
    planned, checked = run(target, "-o", tmp_path / "p.json"), run("check", plan, target)
    assert checked.exit_code == planned.exit_code == 2
    assert checked.stderr.splitlines() == planned.stderr.splitlines()
    assert any("raise ValueError" in line for line in checked.stderr.splitlines()[1:])
