"""The planner meets hostile or careless model files and options: one line, exit 2, no file,
and a plan on stdout is only ever the plan."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from autodist.planner.cli import cli
from autodist.schemas import load_plan

TINY = """
    import paddle
    from paddle import nn

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 16)

        def forward(self, x):
            {forward_extra}
            return self.fc2(paddle.nn.functional.relu(self.fc1(x)))

    {module_extra}

    def build_model():
        {factory_extra}
        return Net()

    def input_spec():
        return [paddle.static.InputSpec([4, 16], "float32", "x")]
"""


def model_file(tmp_path, forward_extra="pass", module_extra="", factory_extra="pass"):
    path = tmp_path / "model.py"
    path.write_text(
        textwrap.dedent(TINY).format(
            forward_extra=forward_extra, module_extra=module_extra, factory_extra=factory_extra
        )
    )
    return str(path)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line_exit_2(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["module_extra", "factory_extra"])
@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_model_that_exits_is_an_error(tmp_path, where, command):
    target = model_file(tmp_path, **{where: "import sys; sys.exit(0)"})
    out = tmp_path / "plan.json"
    if command == "plan":
        result = run(target, "-q", "-o", out)
    else:
        from test_show import layered_plan
        from autodist.schemas import save_plan

        save_plan(layered_plan(), tmp_path / "some_plan.json")
        result = run("check", tmp_path / "some_plan.json", target, "--no-trace", "-q")
    assert_one_line_exit_2(result, "sys.exit(0)")
    assert not out.exists()


def test_what_the_model_prints_does_not_reach_a_plan_on_stdout(tmp_path):
    target = model_file(
        tmp_path,
        module_extra='print("hello from import")',
        factory_extra='print("hello from the factory")',
        forward_extra='print("hello from forward")',
    )
    result = run(target, "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["format"] == "autodist.plan"  # stdout is the plan, only
    load_plan(result.stdout.encode())
    assert "hello from import" in result.stderr and "hello from the factory" in result.stderr


@pytest.mark.parametrize(
    "spec", ["x:float32:99999999999999999999x16", "x:float32:4x3000000000", "x:float32:100000000x100000000x1000"]
)
def test_a_huge_input_spec_is_refused_before_tracing(tmp_path, spec):
    result = run(model_file(tmp_path), "--input-spec", spec, "-q", "-o", tmp_path / "plan.json")
    assert_one_line_exit_2(result, "too large to trace")


# -- writers: output checked first, unique temp files, nothing left behind -------------------------


def test_graph_refuses_a_missing_output_folder_before_loading_the_model(tmp_path):
    marker = tmp_path / "imported"
    target = model_file(tmp_path, module_extra=f"open({str(marker)!r}, 'w').close()")
    result = run("graph", target, "-o", tmp_path / "missing" / "g.dot")
    assert_one_line_exit_2(result, "no folder")
    assert not marker.exists(), "the model was loaded (and traced) before the output path was checked"


@pytest.mark.parametrize("command", [["render"], ["export", "--to", "paddle-parallelize"]])
def test_review_writers_refuse_a_missing_output_folder(tmp_path, command):
    from test_show import EXAMPLE

    result = run(command[0], EXAMPLE, *command[1:], "-o", tmp_path / "missing" / "out")
    assert_one_line_exit_2(result, "no folder")


def test_a_failed_write_leaves_neither_temp_file_nor_output(tmp_path, monkeypatch):
    import os

    from test_show import EXAMPLE

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    result = run("render", EXAMPLE, "-o", tmp_path / "plan.svg")
    assert_one_line_exit_2(result, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_use_their_own_temp_files(tmp_path, monkeypatch):
    """Two renders to one file: each writes its own temp file (a shared ``.plan.svg.tmp`` let one
    writer rename the other's half-written output)."""
    import os

    from test_show import EXAMPLE

    temps = []
    real_replace = os.replace

    def record(src, dst):
        temps.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record)
    for _ in range(2):
        assert run("render", EXAMPLE, "-o", tmp_path / "plan.svg").exit_code == 0
    assert len(set(temps)) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["plan.svg"]


# -- cluster files: every bad one is one line --------------------------------------------------------

FULL_DEVICE = """
[device]
name = "box"
memory_gb = 80
peak_tflops_bf16 = 989
peak_tflops_fp16 = 989
peak_tflops_fp32 = 67
intra_node_bandwidth_gb_s = 450
inter_node_bandwidth_gb_s = 50
intra_node_latency_us = 5
inter_node_latency_us = 10
"""


@pytest.mark.parametrize(
    "content, fragment",
    [
        (
            FULL_DEVICE.replace("memory_gb = 80", "memory_gb = nan"),
            "[device].memory_gb must be a positive, finite number",
        ),
        (
            FULL_DEVICE.replace("memory_gb = 80", "memory_gb = inf"),
            "[device].memory_gb must be a positive, finite number",
        ),
        (FULL_DEVICE.replace("peak_tflops_fp32 = 67", "peak_tflops_fp32 = nan"), "peak_tflops_fp32"),
        (
            FULL_DEVICE.replace("memory_gb = 80", "memory_gb = 1e300"),
            "[device].memory_gb must be a positive, finite number",
        ),
        (
            FULL_DEVICE.replace("memory_gb = 80", "memory_gb = 1" + "0" * 400),
            "[device].memory_gb must be a positive, finite number",
        ),
        ("[device]\nbase = 5\nmemory_gb = 40\n", "[device].base must be a string"),
        (
            '[device]\nname = "a\\u001b[2Jb"\nbase = "h100-sxm"\n',
            "[device].name must be a string of printable characters",
        ),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not a text file"),
    ],
    ids=["nan", "inf", "nan_flops", "huge_float", "huge_int", "base_5", "control_chars_in_name", "binary"],
)
def test_a_bad_cluster_file_is_one_line(tmp_path, content, fragment):
    cluster = tmp_path / "cluster.toml"
    cluster.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "plan.json"
    result = run(model_file(tmp_path), "--cluster", cluster, "-q", "-o", out)
    assert_one_line_exit_2(result, fragment)
    assert "\x1b" not in result.stderr
    assert not out.exists()


# -- tracing: a forward that raises is an error, not a plan for a child ------------------------------


def test_a_forward_that_raises_is_an_error_not_a_plan_of_a_child(tmp_path):
    """Net holds most of its parameters in one child: falling back to tracing that child turned a
    bug in Net.forward into a plan for a fragment."""
    path = tmp_path / "model.py"
    path.write_text(
        textwrap.dedent("""
        import paddle
        from paddle import nn

        class Body(nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 64)
            def forward(self, x):
                return self.fc(x)

        class Net(nn.Layer):
            def __init__(self):
                super().__init__()
                self.body = Body()
                self.head = nn.Linear(64, 2)
            def forward(self, x):
                y = self.body(x)
                if y.shape[0] != 3:
                    raise ValueError("expected a batch of 3")
                return self.head(y)

        def build_model():
            return Net()

        def input_spec():
            return [paddle.static.InputSpec([4, 16], "float32", "x")]
    """)
    )
    out = tmp_path / "plan.json"
    result = run(path, "-q", "-o", out)
    assert result.exit_code == 2, result.output
    first = result.stderr.splitlines()[0]  # then the traced code, indented, as for a failing factory
    assert first.startswith("error: Net.forward raised ValueError: expected a batch of 3"), result.stderr
    assert not out.exists()


def test_a_tracing_limit_falls_back_to_a_child_and_says_so(tmp_path):
    """A RecursionError inside the tracer (PaddleFormers LlamaForCausalLM's) is a known limit:
    the largest child is traced, and the summary line says so."""
    path = tmp_path / "model.py"
    path.write_text(
        textwrap.dedent("""
        import paddle
        from paddle import nn

        class Body(nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 64)
            def forward(self, x):
                return self.fc(x)

        def deep(n):
            return deep(n + 1)

        class Net(nn.Layer):
            def __init__(self):
                super().__init__()
                self.body = Body()
                self.head = nn.Linear(64, 2)
            def forward(self, x):
                return self.head(self.body(x))

        def build_model():
            net = Net()
            real = paddle.jit.to_static
            def to_static(function, *args, **kwargs):   # the whole model's forward hits the limit
                if getattr(function, "__self__", None) is net:
                    deep(0)
                return real(function, *args, **kwargs)
            paddle.jit.to_static = to_static
            return net

        def input_spec():
            return [paddle.static.InputSpec([4, 16], "float32", "x")]
    """)
    )
    result = run(path, "-o", tmp_path / "plan.json")
    try:
        assert result.exit_code == 0, result.output
        assert "traced body only, the whole model does not trace (RecursionError" in result.stderr, result.stderr
        assert load_plan(tmp_path / "plan.json").model.traced_layer == "body"
    finally:
        import paddle

        paddle.jit.to_static = paddle.jit.api.to_static
