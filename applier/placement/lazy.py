"""Initialise a lazily built model's parameters to the values an eager build would have given.

Under ``paddle.LazyGuard()`` a parameter only records its initialiser; an eager build runs the
initialisers as the parameters are created, each drawing from the global random generator.
apply_plan re-creates that draw: for each lazy parameter, in the order they were created, it
materialises the *whole* tensor on every rank from the global generator (the same call the eager
build made, so the same values), then shards it and frees the whole tensor. Every rank draws
every parameter, also those it will not hold, so the generator stays where eager left it; the
cost is one parameter's full size of temporary memory at a time (docs/paddle-notes.md,
"Parameters and optimizers").

The creation order is known exactly when the model was built under :class:`LazyGuard` (this
module's, which records it). It also keeps each parameter it saw created (lazy: no storage yet)
for as long as a layer of that build lives (:class:`_Made`), so a parameter the model no longer
holds (a sub-layer replaced after the build, as a subclass does with ``self.blocks = ...``) is
still drawn in its turn, as the eager build drew it before
throwing it away (:class:`Dropped`). Under plain ``paddle.LazyGuard()`` it is taken to be the order
``named_parameters()`` lists them, which differs where a layer created its own parameters after
building sublayers (a timm ViT's ``cls_token``, an LM head created last): those are named in
one warning. A layer such a build made and threw away is not kept, but often seen: Paddle
numbers each kind of layer for the whole process, so it leaves a gap among the model's own
(:func:`discarded_layers`, named in another warning). So are random numbers a :class:`LazyGuard`
build drew itself (a random buffer), and a generator that moved between the build and apply_plan.

Example::

    >>> import paddle, autodist
    >>> from autodist.applier.placement.lazy import created_in_order, materialise
    >>> _ = paddle.seed(1)
    >>> eager = paddle.nn.Linear(2, 2).weight.numpy()
    >>> _ = paddle.seed(1)
    >>> with autodist.LazyGuard():
    ...     layer = paddle.nn.Linear(2, 2)
    >>> created_in_order(layer.parameters()), layer.weight._is_initialized()
    (True, False)
    >>> materialise(layer.weight, [layer])
    >>> bool((layer.weight.numpy() == eager).all())
    True
"""

from __future__ import annotations

import itertools
import pickle
import re
import sys
import warnings
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import NamedTuple

import paddle
from paddle.base.unique_name import UniqueNameGenerator
from paddle.utils import unique_name


class Build(NamedTuple):
    """One ``with LazyGuard():`` block, as it ended."""

    end: bytes  # the random generator's state
    drew: bool  # the block drew random numbers itself (not through a lazy initialiser)


#: Names generated under :class:`LazyGuard`: ``{name: (sequence number, index in _BUILDS)}``.
_CREATED: dict[str, tuple[int, int]] = {}


class _Made(list):
    """The parameters one :class:`LazyGuard` build created (lazy ones hold no storage), kept for
    apply_plan to draw those the model no longer holds. Every layer that created one holds this
    list, and :data:`_MADE` only a weak reference to it: a build never applied is let go with its
    layers, not kept for the process's life. A copy of the model shares it."""

    def __deepcopy__(self, memo: dict) -> _Made:
        return self


#: :class:`_Made` per build, while a layer of the build lives, until apply_plan has drawn them.
_MADE: weakref.WeakValueDictionary[int, _Made] = weakref.WeakValueDictionary()
_SEQUENCE = itertools.count()
_BUILDS: list[Build] = []

#: Paddle initialisers that draw nothing from the random generator (their order never matters).
_DETERMINISTIC = (
    paddle.nn.initializer.constant.ConstantInitializer,
    paddle.nn.initializer.assign.NumpyArrayInitializer,
    paddle.nn.initializer.Dirac,
    paddle.nn.initializer.Bilinear,
)


class _RecordingNames(UniqueNameGenerator):
    """Paddle's name generator, unchanged (same counters, same names), noting each name's turn."""

    def __init__(self, inner: UniqueNameGenerator, build: int):
        super().__init__(inner.prefix)
        self.ids = inner.ids  # shared: names go on where they were, and go on after exit
        self.build = build

    def generate(self, key: str) -> str:
        name = super().generate(key)
        _CREATED[name] = (next(_SEQUENCE), self.build)
        return name


class LazyGuard:
    """``paddle.LazyGuard()`` that also records the order in which parameters are created, so
    that :func:`~autodist.apply_plan` initialises them to exactly the eager build's values.

    Parameter names are Paddle's own (they are generated as usual, and recorded on the way).

    Example::

        >>> import paddle, autodist
        >>> with autodist.LazyGuard():
        ...     model = paddle.nn.Linear(4, 4)
        >>> model.weight._is_initialized()
        False
    """

    def __enter__(self) -> None:
        self._lazy = paddle.LazyGuard()
        self._lazy.__enter__()
        generator, checker = unique_name.switch()
        self._build, self._start = len(_BUILDS), generator_state()
        unique_name.switch(_RecordingNames(generator, build=self._build), checker)
        _BUILDS.append(Build(end=self._start, drew=False))  # until the block ends
        self._restore = generator, checker
        self._create = paddle.nn.Layer.create_parameter
        made = self._made = _MADE[self._build] = _Made()  # held here until the block ends
        create = self._create

        def create_parameter(layer, *args, **kwargs):
            param = create(layer, *args, **kwargs)
            if param is not None:  # None for a bias_attr=False
                made.append(param)
                object.__setattr__(layer, "_autodist_made", made)  # lives as long as the layer
            return param

        paddle.nn.Layer.create_parameter = create_parameter

    def __exit__(self, *exc) -> None:
        paddle.nn.Layer.create_parameter = self._create
        unique_name.switch(*self._restore)
        self._lazy.__exit__(*exc)
        _BUILDS[self._build] = Build(end=generator_state(), drew=drew_since(self._start))
        del self._made  # from here the build's layers keep it


def generator_state() -> bytes:
    """The global random generator's state (of the current device), comparable with ``==``."""
    return pickle.dumps(paddle.get_rng_state())


def drew_since(start: bytes) -> bool:
    """Whether the global generator drew numbers since it was in state ``start``; a
    ``paddle.seed`` in between is not a draw (the state is then that of a fresh generator with
    its seed). Only known on CPU: elsewhere False."""
    now = generator_state()
    if now == start or paddle.get_device() != "cpu":
        return False
    fresh = paddle.base.core.Generator()
    fresh.manual_seed(paddle.get_rng_state()[0].current_seed())
    return now != pickle.dumps([fresh.get_state()])


def is_lazy(param: paddle.Tensor) -> bool:
    """Built under a LazyGuard and not initialised yet."""
    return not param._is_initialized() and getattr(param, "_init_func", None) is not None


def created_in_order(params: Iterable[paddle.Tensor]) -> bool:
    """Whether every one of ``params`` was created under :class:`LazyGuard`, so its creation
    turn is known."""
    return all(p.name in _CREATED for p in params)


def creation_turn(param: paddle.Tensor) -> int:
    """The parameter's turn among the names generated under :class:`LazyGuard`."""
    return _CREATED[param.name][0]


def draws_randomly(param: paddle.Tensor) -> bool:
    """Whether the parameter's recorded initialiser draws from the random generator (an
    initialiser autodist does not know is taken to draw)."""
    initializer = getattr(getattr(param._init_func, "func", None), "__self__", None)
    return not isinstance(initializer, _DETERMINISTIC)


def unordered_parameters(model: paddle.nn.Layer) -> list[str]:
    """Parameters whose creation turn ``named_parameters()`` order may get wrong: a layer's own
    randomly drawn lazy parameters when a sublayer also holds some (which came first is not
    recorded by ``paddle.LazyGuard``)."""
    unsure = []
    for prefix, layer in model.named_sublayers(include_self=True):
        own = [(key, p) for key, p in layer._parameters.items() if p is not None and is_lazy(p) and draws_randomly(p)]
        below = any(
            is_lazy(p) and draws_randomly(p)
            for sub in layer.sublayers()
            for p in sub._parameters.values()
            if p is not None
        )
        if own and below:
            unsure += [f"{prefix}.{key}" if prefix else key for key, _ in own]
    return unsure


#: A name Paddle generated for a parameter: ``<kind>_<n>.<suffix>_<m>`` (``linear_3.w_0``), where
#: ``<kind>_<n>`` is the owning layer's name, numbered per kind for the whole process.
_GENERATED = re.compile(r"(?P<layer>(?P<kind>\w+?)_(?P<n>\d+))\.[a-z_]+_\d+")


def discarded_layers(model: paddle.nn.Layer) -> list[str]:
    """Layers the build created between the model's own layers of the same kind that the model
    does not hold (a sub-layer replaced after the build): Paddle numbers the layers of each kind
    for the whole process (``linear_0``, ``linear_1``, ...), so a model built in one go holds a
    run without gaps, and a gap is a layer its build made and threw away. Only kinds whose
    parameters draw randomly count (a thrown-away ``LayerNorm`` drew nothing; the parameters
    ``paddle.create_parameter`` makes are numbered alike, one kind). A replaced layer
    made before the model's first layer of its kind, or after its last, leaves no gap and is not
    seen (docs/paddle-notes.md, "Parameters and optimizers").

    >>> import paddle
    >>> class Classifier(paddle.nn.Layer):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.body = paddle.nn.Linear(4, 4)
    ...         self.head = paddle.nn.Linear(4, 10)
    >>> class FewerClasses(Classifier):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.head = paddle.nn.Linear(4, 3)  # the base's head is made and thrown away
    >>> names = paddle.utils.unique_name.guard()  # count from linear_0 for this example
    >>> with names, paddle.LazyGuard():
    ...     discarded_layers(Classifier()), discarded_layers(FewerClasses())
    ([], ['linear_3'])
    """
    held: dict[str, set[int]] = {}
    random: set[str] = set()
    for param in model.parameters():
        name = _GENERATED.fullmatch(param.name)
        if name:
            held.setdefault(name["kind"], set()).add(int(name["n"]))
            if not is_lazy(param) or draws_randomly(param):
                random.add(name["kind"])
    return [
        f"{kind}_{n}" for kind, ns in held.items() if kind in random for n in range(min(ns), max(ns)) if n not in ns
    ]


#: Said once per apply_plan of a lazily built model whose creation order is unsure.
UNORDERED = (
    "apply_plan: the model was built under paddle.LazyGuard(), which does not record the order parameters "
    "were created in; autodist initialises them in named_parameters() order, which may not be the eager "
    "build's for {names}: if not, training starts from other weights than an eager build with the same seed "
    "(not a wrong training, another start). Build under autodist.LazyGuard() for the eager build's values"
)
#: Said once per apply_plan of a model built under paddle.LazyGuard() that threw layers away.
DISCARDED = (
    "apply_plan: the model was built under paddle.LazyGuard() and does not hold the parameters of {names}, "
    "which its build created (a sub-layer replaced after the build, as a subclass does with self.head = ...): "
    "an eager build drew their random values and threw them away, a lazy one did not, so the parameters created "
    "after them start from other weights than an eager build with the same seed (not a wrong training, another "
    "start). Build under autodist.LazyGuard(), which draws them in their turn, for the eager build's values"
)
#: Said when a build under LazyGuard drew random numbers itself.
BUILD_DREW = (
    "apply_plan: the model's build drew random numbers itself, besides its parameters' initialisers (a buffer "
    "from paddle.randn, say, or weights set from paddle.normal); an eager build draws them among the "
    "parameters, a lazy one before all of them, so training starts from other weights than an eager build with "
    "the same seed (not a wrong training, another start)"
)
#: Said when something drew from the generator between the build and apply_plan.
GENERATOR_MOVED = (
    "apply_plan: the random generator moved between the model's build and apply_plan (something drew from it); "
    "the parameters are drawn from where it is now, so training starts from other weights than an eager build "
    "with the same seed (not a wrong training, another start)"
)


def _warn_the_caller(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside autodist (the user's
    ``apply_plan`` line), however deep inside apply_plan it is said."""
    level, caller = 2, sys._getframe(1)  # stacklevel 2 is this function's caller
    frame: FrameType | None = caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith("autodist."):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, stacklevel=level)


def creation_turns(model: paddle.nn.Layer, params: list[paddle.Tensor]) -> dict[int, int]:
    """``{id(param): its turn}``: the order lazily built parameters are initialised in, the
    order they were created in (recorded by autodist.LazyGuard, else taken to be the model's
    parameter order, with one warning naming those it may get wrong). Initialised parameters
    come first, in any order: they draw nothing."""
    built = [p for p in params if not is_lazy(p)]
    unbuilt = [p for p in params if is_lazy(p)]
    if not created_in_order(unbuilt):
        order = {id(p): i for i, p in enumerate(model.parameters())}
        unbuilt.sort(key=lambda p: order[id(p)])
        unsure = unordered_parameters(model)
        if unsure:
            _warn_the_caller(UNORDERED.format(names=", ".join(unsure)))
        discarded = discarded_layers(model)
        if discarded:
            _warn_the_caller(DISCARDED.format(names=", ".join(discarded)))
    else:
        unbuilt.sort(key=creation_turn)
        builds = {_CREATED[p.name][1] for p in unbuilt}
        if any(_BUILDS[b].drew for b in builds):
            _warn_the_caller(BUILD_DREW)
        elif len(builds) == 1 and generator_state() != _BUILDS[builds.pop()].end:
            _warn_the_caller(GENERATOR_MOVED)
    return {id(p): turn for turn, p in enumerate(built + unbuilt)}


class Dropped:
    """The parameters built under :class:`LazyGuard` together with ``held`` (the same builds)
    that the model no longer holds: a sub-layer replaced after the build. The eager build drew
    each in its turn and threw it away; :meth:`draw_before` draws them the same way, so the
    parameters created after them start from the eager values too."""

    def __init__(self, held: list[paddle.Tensor]):
        ids = {id(p) for p in held}
        builds = {_CREATED[p.name][1] for p in held if p.name in _CREATED}
        self._waiting = sorted(
            (p for b in builds for p in _MADE.get(b, []) if id(p) not in ids and is_lazy(p) and p.name in _CREATED),
            key=creation_turn,
        )
        for b in builds:  # drawn now or never: the records of these builds are done
            _MADE.pop(b, []).clear()

    def draw_before(self, param: paddle.Tensor) -> None:
        """Draw (and let go of) every dropped parameter created before ``param``."""
        turn = creation_turn(param) if param.name in _CREATED else -1
        while self._waiting and creation_turn(self._waiting[0]) < turn:
            self._waiting.pop(0).initialize()  # its whole tensor, freed with the last reference


def materialise(param: paddle.Tensor, owners: Iterable[paddle.nn.Layer]) -> None:
    """Run the parameter's initialiser on its whole (dense) tensor, from the global generator,
    then what the eager constructor of its owning layer would have done to it next and skipped
    under LazyGuard: ``nn.Embedding`` zeroes its ``padding_idx`` row."""
    param.initialize()
    for layer in owners:
        if isinstance(layer, paddle.nn.Embedding) and layer.weight is param and layer._padding_idx is not None:
            row = layer._padding_idx % layer._num_embeddings  # a negative index counts from the end
            with paddle.no_grad():
                param[row] = 0.0
