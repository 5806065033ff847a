"""Load the user's model: import the target, run its factory under ``paddle.LazyGuard()``, and
find its input specs.

A target is ``path/model.py``, ``path/model.py:factory`` or ``package.module:factory``; the
factory defaults to ``build_model`` and a module-level ``nn.Layer`` named ``model`` is accepted
too. Input specs come from ``--input-spec name:dtype:BxS`` (wins), else the module's
``input_spec()`` function or ``INPUT_SPEC`` list.

Example::

    >>> loaded = load_target("plans/llama_docstring/model.py")        # doctest: +SKIP
    >>> type(loaded.model).__name__, loaded.input_specs[0].shape  # doctest: +SKIP
    ('Model', (4, 1024))
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import paddle

from autodist.schemas.vocabulary import INPUT_DTYPES

from autodist.planner.errors import PlannerError

DEFAULT_FACTORY = "build_model"
MODULE_LEVEL_MODEL = "model"
#: The largest input dim and element count traced: beyond them Paddle's shape arithmetic
#: overflows (``--input-spec 99999999999999999999x8`` ended in a segfault).
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**53


@dataclass
class LoadedModel:
    model: paddle.nn.Layer  # built under paddle.LazyGuard(): parameters hold no memory yet
    input_specs: list[paddle.static.InputSpec]
    source: str  # the TARGET string as the user gave it
    #: The model file's ``loss_fn(output, labels)``, if it defines one (the training script's loss:
    #: ``autodist.applier.training.model_loss``, which ``calibrate --model`` times).
    loss_fn: Callable | None = None
    #: How the model was built when not lazily (:func:`_build`), for the plan's notes and a warning.
    notes: list[str] = field(default_factory=list)


def load_target(target: str, input_specs: list[str] | None = None) -> LoadedModel:
    """Import ``target``, build its model lazily and resolve its input specs.

    ``input_specs`` are CLI strings (``"input_ids:int64:4x1024"``); when given they replace the
    module's own. Every problem raises :class:`PlannerError` with one line naming it.
    """
    module_ref, factory_name = split_target(target)
    with user_code(target):
        with paddle.LazyGuard():
            module = _import(module_ref, target)
        model, notes = _build(module, factory_name, target)
    if input_specs:
        specs = [parse_input_spec(text) for text in input_specs]
    else:
        with user_code(target):
            specs = _module_input_specs(module, target)
    for spec in specs:
        check_shape(spec, target)
    loss_fn = getattr(module, "loss_fn", None)
    return LoadedModel(
        model=model, input_specs=specs, source=target, loss_fn=loss_fn if callable(loss_fn) else None, notes=notes
    )


@contextlib.contextmanager
def user_code(target: str) -> Iterator[None]:
    """Run the user's code (import, factory, ``input_spec()``, the traced forward) so that what it
    prints goes to stderr -- a plan written to stdout (``-q > plan.json``) stays a plan -- and a
    ``sys.exit()`` in it is an error, not a silent exit with nothing written.

    >>> with user_code("model.py"):
    ...     print("hello")                # goes to stderr
    >>> with user_code("model.py"):       # doctest: +ELLIPSIS
    ...     sys.exit(0)
    Traceback (most recent call last):
    autodist.planner.errors.PlannerError: model.py: the model's code called sys.exit(0) ...
    """
    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield
        except SystemExit as exc:
            raise PlannerError(
                f"{target}: the model's code called sys.exit({exc.code!r}) while autodist ran it; a model "
                'file must not exit (put script code under `if __name__ == "__main__":`)'
            ) from None


def check_shape(spec: paddle.static.InputSpec, target: str) -> None:
    """Refuse an input shape Paddle cannot trace: a dim above :data:`MAX_DIM` or more than
    :data:`MAX_ELEMENTS` elements (``-1``, a dynamic dim, counts as 1)."""
    shape = [int(d) for d in spec.shape]
    known = [d for d in shape if d != -1]
    if any(d > MAX_DIM for d in known) or math.prod(known) > MAX_ELEMENTS:
        raise PlannerError(
            f"{target}: input {spec.name!r} has shape {'x'.join(map(str, shape))}: too large to trace "
            f"(at most {MAX_DIM} per dim and {MAX_ELEMENTS:.0e} elements)"
        )


def split_target(target: str) -> tuple[str, str | None]:
    """``"dir/m.py:make"`` -> ``("dir/m.py", "make")``; no ``:factory`` gives ``None``.

    >>> split_target("pkg.mod:build"), split_target("model.py")
    (('pkg.mod', 'build'), ('model.py', None))
    """
    ref, sep, factory = target.rpartition(":")
    if not sep or not factory.isidentifier():
        return target, None
    return ref, factory


def parse_input_spec(text: str) -> paddle.static.InputSpec:
    """``"input_ids:int64:4x1024"`` -> ``InputSpec([4, 1024], "int64", "input_ids")``; ``-1`` marks
    a dynamic dim.

    >>> parse_input_spec("input_ids:int64:4x16").shape
    (4, 16)
    """
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isidentifier():
        raise PlannerError(f"--input-spec {text!r}: expected name:dtype:BxS, e.g. input_ids:int64:4x1024")
    name, dtype, dims = parts
    if dtype not in INPUT_DTYPES:
        raise PlannerError(f"--input-spec {text!r}: unknown dtype {dtype!r} (one of {', '.join(INPUT_DTYPES)})")
    try:
        shape = [int(d) for d in dims.lower().split("x")]
    except ValueError:
        shape = []
    if not shape or any(d == 0 or d < -1 for d in shape):
        raise PlannerError(
            f"--input-spec {text!r}: shape {dims!r} must be sizes joined by 'x', e.g. 4x1024 (-1 = dynamic)"
        )
    return paddle.static.InputSpec(shape, dtype, name)


# -- internals ---------------------------------------------------------------------------------------


def _import(module_ref: str, target: str) -> ModuleType:
    if module_ref.endswith(".py"):
        return import_model_file(module_ref, target)
    # As `python -m` does: a package or module in the current directory is found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_ref)
    except ModuleNotFoundError as exc:
        if exc.name and module_ref.startswith(exc.name):
            raise PlannerError(f"{target}: no module named {module_ref!r} (and no file {module_ref}.py)") from None
        raise _user_code_error(f"importing {module_ref}", exc) from None
    except Exception as exc:  # the user's module ran and raised: show where
        raise _user_code_error(f"importing {module_ref}", exc) from None


def import_model_file(path: str | Path, target: str | None = None) -> ModuleType:
    """Import a model file by path, as ``autodist-plan path.py`` does: under a unique, stable
    module name, with its folder on ``sys.path`` while it runs (the one model-file importer of
    the planner, its benchmarks and tests). ``target`` names it in errors (default: ``path``)."""
    path, target = Path(path), target or str(path)
    if not path.is_file():
        raise PlannerError(f"{target}: file {str(path)!r} not found")
    path = path.resolve()
    # A unique, stable module name: dataclasses and pickling look modules up in sys.modules.
    name = f"_autodist_target_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # a path ending in .py always has a loader
        raise PlannerError(f"{target}: Python cannot load {str(path)!r} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # The model file may import its neighbours, as `python model.py` would allow.
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):  # sys.exit, Ctrl-C: user_code() and the CLI decide
            raise
        raise _user_code_error(f"importing {path.name}", exc) from None
    finally:
        sys.path.remove(str(path.parent))
    return module


def _callables_of(module: ModuleType) -> str:
    """``"; it defines: build_small(), Model"``: the public functions and classes the module
    itself defines (not what it imports), for an error about a factory name."""
    names = sorted(
        name
        for name, value in vars(module).items()
        if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    )
    return f"; it defines: {', '.join(names)}" if names else "; it defines no functions or classes"


def _build(module: ModuleType, factory_name: str | None, target: str) -> tuple[paddle.nn.Layer, list[str]]:
    """The model the factory builds, under ``paddle.LazyGuard()`` (no parameter memory); a factory
    that computes with a parameter's values while building (``nn.utils.weight_norm`` reads the
    weight's norm: Paddle raises on a lazy parameter) is built again eagerly, and the note says so
    and where the lazy build stopped. An eager build that raises too is the error."""
    name = factory_name or DEFAULT_FACTORY
    factory = getattr(module, name, None)
    if factory is None and factory_name is None:
        model = getattr(module, MODULE_LEVEL_MODEL, None)
        if isinstance(model, paddle.nn.Layer):
            return model, []
        raise PlannerError(
            f"{target}: no factory {DEFAULT_FACTORY}() and no module-level nn.Layer named `{MODULE_LEVEL_MODEL}` "
            f"(name another factory with {target}:FACTORY){_callables_of(module)}"
        )
    if factory is None:
        raise PlannerError(f"{target}: no factory named {name!r} in the module{_callables_of(module)}")
    if not callable(factory):
        raise PlannerError(f"{target}: {name!r} is a {type(factory).__name__}, not a function returning a model")
    notes = []
    try:
        with paddle.LazyGuard():
            model = factory()
    except Exception as lazily:
        try:
            model = factory()
        except Exception as exc:
            raise _user_code_error(f"{name}()", exc) from None
        notes.append(
            f"{name}() does not build under paddle.LazyGuard() ({type(lazily).__name__} at {_location(lazily)}; a "
            "lazy parameter holds no values to compute with): built eagerly instead, its parameters in this "
            "process's memory"
        )
    if not isinstance(model, paddle.nn.Layer):
        raise PlannerError(f"{target}: {name}() returned a {type(model).__name__}, not a paddle.nn.Layer")
    return model, notes


def _module_input_specs(module: ModuleType, target: str) -> list[paddle.static.InputSpec]:
    if callable(getattr(module, "input_spec", None)):
        try:
            specs = module.input_spec()
        except Exception as exc:
            raise _user_code_error("input_spec()", exc) from None
        where = "input_spec()"
    elif hasattr(module, "INPUT_SPEC"):
        specs, where = module.INPUT_SPEC, "INPUT_SPEC"
    else:
        raise PlannerError(
            f"{target}: no input specs: define input_spec() or INPUT_SPEC in the module, "
            "or pass --input-spec name:dtype:BxS"
        )
    if isinstance(specs, paddle.static.InputSpec):
        specs = [specs]
    if (
        not isinstance(specs, (list, tuple))
        or not specs
        or not all(isinstance(s, paddle.static.InputSpec) for s in specs)
    ):
        raise PlannerError(f"{target}: {where} must give a non-empty list of paddle.static.InputSpec, got {specs!r}")
    return list(specs)


def _user_code_error(what: str, exc: BaseException) -> PlannerError:
    """A one-line error naming the exception and where in the user's code it came from, with
    the last frames of the traceback as detail."""
    where = f" (at {_location(exc)})" if exc.__traceback__ else ""
    message = f"{what} raised {type(exc).__name__}: {exc}".splitlines()[0] + where
    detail = "".join(traceback.format_list(_user_frames(exc)[-3:])).rstrip()
    return PlannerError(message, detail=detail)


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The user's own frames of ``exc``'s traceback: not the planner's, not an installed library's
    (paddle's internals); all of them when none is the user's."""
    frames = traceback.extract_tb(exc.__traceback__)
    planner_dir = str(Path(__file__).parent)
    return [f for f in frames if not f.filename.startswith(planner_dir) and "site-packages" not in f.filename] or frames


def _location(exc: BaseException) -> str:
    """``model.py:114 in __init__``: the last of the user's frames that raised ``exc``."""
    frame = _user_frames(exc)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
