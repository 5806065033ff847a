"""load_target: every accepted target form, input specs, and one clear error for each bad input."""

from __future__ import annotations

import sys
import textwrap

import paddle
import pytest

from autodist.planner.errors import PlannerError
from autodist.planner.load import load_target, parse_input_spec, split_target

DOCSTRING_MODEL = "plans/llama_docstring/model.py"
TINY_LINEAR = """
    import paddle
    from paddle import nn

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
        def forward(self, x):
            return self.fc(x)
"""


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(TINY_LINEAR) + textwrap.dedent(body))
    return str(path)


@pytest.fixture
def tiny_docstring_env(monkeypatch):
    for field, value in dict(
        VOCAB_SIZE=64, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_HEADS=4, NUM_LAYERS=2, SEQ_LENGTH=16
    ).items():
        monkeypatch.setenv(f"LLAMA_DOCSTRING_{field}", str(value))


def test_docstring_model_loads_lazily_with_its_input_spec(tiny_docstring_env):
    loaded = load_target(DOCSTRING_MODEL)
    assert type(loaded.model).__name__ == "Model"
    assert len(loaded.model.layers) == 2
    # Built under LazyGuard: no parameter holds memory.
    assert not any(p._is_initialized() for p in loaded.model.parameters())
    assert [(s.name, tuple(s.shape), s.dtype) for s in loaded.input_specs] == [("input_ids", (4, 16), paddle.int64)]
    assert loaded.source == DOCSTRING_MODEL


def test_explicit_factory_in_file_and_input_spec_constant(tmp_path):
    path = write(
        tmp_path,
        "m.py",
        """
        def make():
            return Net()
        INPUT_SPEC = [paddle.static.InputSpec([2, 8], "float32", "x")]
    """,
    )
    loaded = load_target(f"{path}:make")
    assert isinstance(loaded.model.fc, paddle.nn.Linear)
    assert tuple(loaded.input_specs[0].shape) == (2, 8)


def test_package_module_factory(tmp_path, monkeypatch):
    package = tmp_path / "tinypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(
        package,
        "nets.py",
        """
        def build():
            return Net()
        def input_spec():
            return [paddle.static.InputSpec([3, 8], "float32", "x")]
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_target("tinypkg.nets:build")
    assert tuple(loaded.input_specs[0].shape) == (3, 8)


def test_module_level_model_is_accepted_and_cli_specs_win(tmp_path):
    path = write(
        tmp_path,
        "m.py",
        """
        model = Net()
        INPUT_SPEC = [paddle.static.InputSpec([2, 8], "float32", "x")]
    """,
    )
    loaded = load_target(path, input_specs=["x:float32:5x8"])
    assert isinstance(loaded.model, paddle.nn.Layer)
    assert tuple(loaded.input_specs[0].shape) == (5, 8)


def test_split_target():
    assert split_target("a/b/model.py:make") == ("a/b/model.py", "make")
    assert split_target("a/b/model.py") == ("a/b/model.py", None)
    assert split_target("pkg.mod:build_model") == ("pkg.mod", "build_model")


def test_parse_input_spec_dynamic_dim():
    spec = parse_input_spec("input_ids:int64:-1x128")
    assert (spec.name, tuple(spec.shape), spec.dtype) == ("input_ids", (-1, 128), paddle.int64)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("input_ids", "expected name:dtype:BxS"),
        ("input_ids:int65:4x8", "unknown dtype 'int65'"),
        ("input_ids:int64:4xq", "shape '4xq'"),
        ("input_ids:int64:0x8", "shape '0x8'"),
        ("1x:int64:4x8", "expected name:dtype:BxS"),
    ],
)
def test_bad_input_spec(text, fragment):
    with pytest.raises(PlannerError, match="--input-spec") as info:
        parse_input_spec(text)
    assert fragment in str(info.value)


def test_missing_file():
    with pytest.raises(PlannerError, match="file 'nowhere/model.py' not found"):
        load_target("nowhere/model.py")


def test_missing_module():
    with pytest.raises(PlannerError, match="no module named 'no_such_pkg_xyz.mod'"):
        load_target("no_such_pkg_xyz.mod:build")


def test_no_factory_and_no_model(tmp_path):
    path = write(tmp_path, "m.py", "")
    with pytest.raises(PlannerError, match=r"no factory build_model\(\) and no module-level nn.Layer"):
        load_target(path)


def test_named_factory_missing(tmp_path):
    path = write(tmp_path, "m.py", "def build_model():\n    return Net()\n")
    with pytest.raises(PlannerError, match="no factory named 'make'"):
        load_target(f"{path}:make")


def test_factory_raising_shows_the_users_traceback_tail(tmp_path):
    path = write(
        tmp_path,
        "broken.py",
        """
        def helper():
            return 1 / 0
        def build_model():
            return helper()
    """,
    )
    with pytest.raises(PlannerError) as info:
        load_target(path)
    err = info.value
    assert "build_model() raised ZeroDivisionError: division by zero" in err.message
    assert "broken.py" in err.message and "in helper" in err.message
    assert "\n" not in err.message
    assert "return 1 / 0" in err.detail and "return helper()" in err.detail


def test_a_factory_computing_with_parameter_values_is_built_eagerly_and_says_where(tmp_path):
    """``nn.utils.weight_norm`` reads the weight's norm while building (HF Wav2Vec2's positional
    conv, PaddleSpeech's port): Paddle raises on a lazy parameter, so the planner refused a model
    that builds. Built again eagerly, it loads with the note naming the line the lazy build stopped at."""
    path = write(
        tmp_path,
        "normed.py",
        """
        def build_model():
            net = Net()
            net.fc = nn.utils.weight_norm(net.fc, name="weight", dim=1)
            return net
        INPUT_SPEC = [paddle.static.InputSpec([2, 8], "float32", "x")]
    """,
    )
    loaded = load_target(path)
    assert sorted(name for name, _ in loaded.model.named_parameters()) == ["fc.bias", "fc.weight_g", "fc.weight_v"]
    assert all(p._is_initialized() for p in loaded.model.parameters())
    [note] = loaded.notes
    line = next(n for n, text in enumerate(open(path).read().splitlines(), 1) if "weight_norm" in text)
    assert note.startswith("build_model() does not build under paddle.LazyGuard() (")
    assert f"normed.py:{line} in build_model; " in note and "built eagerly instead" in note


def test_a_lazy_build_needs_no_note(tmp_path):
    loaded = load_target(
        write(tmp_path, "m.py", "def build_model():\n    return Net()\nINPUT_SPEC = []\n"), ["x:float32:2x8"]
    )
    assert loaded.notes == [] and not any(p._is_initialized() for p in loaded.model.parameters())


def test_import_error_in_model_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import paddle\nraise RuntimeError('config missing')\n")
    with pytest.raises(PlannerError, match="importing bad.py raised RuntimeError: config missing"):
        load_target(str(path))


def test_factory_returning_non_layer(tmp_path):
    path = write(tmp_path, "m.py", "def build_model():\n    return {'not': 'a layer'}\n")
    with pytest.raises(PlannerError, match=r"build_model\(\) returned a dict, not a paddle.nn.Layer"):
        load_target(path)


def test_no_input_spec_anywhere(tmp_path):
    path = write(tmp_path, "m.py", "def build_model():\n    return Net()\n")
    with pytest.raises(PlannerError, match="no input specs"):
        load_target(path)
    assert load_target(path, input_specs=["x:float32:2x8"]).input_specs[0].name == "x"


def test_bad_input_spec_constant(tmp_path):
    path = write(tmp_path, "m.py", "def build_model():\n    return Net()\nINPUT_SPEC = [[2, 8]]\n")
    with pytest.raises(PlannerError, match="INPUT_SPEC must give a non-empty list of paddle.static.InputSpec"):
        load_target(path)


def test_a_wrong_factory_name_lists_what_the_file_defines(tmp_path):
    path = write(
        tmp_path,
        "m.py",
        "import paddle\nfrom math import sqrt\n\nclass Net(paddle.nn.Layer):\n    pass\n\n"
        "def build_small():\n    return Net()\n\ndef _helper():\n    pass\n",
    )
    with pytest.raises(PlannerError) as err:
        load_target(f"{path}:build_large")
    assert str(err.value).endswith("no factory named 'build_large' in the module; it defines: Net, build_small")


def test_a_package_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    """As `python -m pkg.module` finds it; the console script's sys.path[0] is its bin folder."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "net.py").write_text(
        "import paddle\n\nINPUT_SPEC = [paddle.static.InputSpec([4, 2], 'float32', 'x')]\n\n"
        "def make():\n    return paddle.nn.Linear(2, 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    loaded = load_target("mypkg.net:make")
    assert isinstance(loaded.model, paddle.nn.Linear)
