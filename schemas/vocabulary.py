"""The words plans are written in, in one place: mesh axes, placements and dtypes (the one dtype table).

Used by the plan types (:mod:`autodist.schemas.plan`), the planner and the applier alike.
A *mesh axis* is one of ``pp``, ``dp``, ``mp`` (a plan's ``mesh.axes`` lists the axes it
has, in this order); a *dim* is always a tensor dimension (``S(1)`` splits tensor dim 1).

Example::

    >>> MESH_AXES
    ('pp', 'dp', 'mp')
    >>> shard_dim("S(1)"), shard_dim("R"), is_placement("S(1)\\n")
    (1, None, False)
    >>> DTYPE_BYTES[TRAINING_DTYPES["bf16"]], training_bytes("bf16")
    (2, 2)
"""

from __future__ import annotations

import re
import typing
from typing import Literal

#: The mesh axes, outermost first: pipeline stages, data parallel, tensor (model) parallel.
#: mp is innermost so its ranks are neighbours (inside one node when it fits).
MeshAxis = Literal["pp", "dp", "mp"]
MESH_AXES: tuple[MeshAxis, ...] = ("pp", "dp", "mp")

#: A placement on one mesh axis: ``"R"`` replicate, ``"P"`` partial (pending sum), ``"S(k)"``
#: shard tensor dim ``k``.
PLACEMENT_PATTERN = r"R|P|S\([0-9]\)"
_PLACEMENT = re.compile(rf"(?:{PLACEMENT_PATTERN})")
_SHARD = re.compile(r"S\(([0-9])\)")


def is_placement(text: str) -> bool:
    """``True`` for ``R``, ``P`` and ``S(k)`` exactly (no surrounding text, no newline)."""
    return _PLACEMENT.fullmatch(text) is not None


def shard_dim(placement: str) -> int | None:
    """The tensor dim a placement splits, or None: ``shard_dim("S(1)") == 1``."""
    match = _SHARD.fullmatch(placement)
    return int(match.group(1)) if match else None


def local_shape(shape: list[int], placements: list[str], mesh_shape: list[int]) -> list[int]:
    """The part of a tensor of ``shape`` one rank holds: each ``S(k)`` divides dim ``k`` by the
    size of its mesh axis (``placements`` and ``mesh_shape`` are in the mesh's axis order).

    >>> local_shape([8, 6], ["R", "S(1)"], [2, 3])
    [8, 2]
    """
    local = list(shape)
    for size, placement in zip(mesh_shape, placements):
        dim = shard_dim(placement)
        if dim is not None:
            local[dim] //= size
    return local


DType = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool", "complex64"
]  # fmt: skip
#: Bytes per element of each tensor dtype (plan memory sums, checkpoint files, traced values; a
#: ``complex64`` one: a rotary table a local view is called with, Mistral's ``freqs_cis``).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
               "uint8": 1, "bool": 1, "complex64": 8}  # fmt: skip
#: The floating-point tensor dtypes (activations and weights, not masks or indices).
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
#: The training dtypes the planner prices (``--dtype``), as tensor dtypes.
TrainingDType = Literal["bf16", "fp16", "fp32"]
TRAINING_DTYPES: dict[str, DType] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: The dtypes a model input may have (``--input-spec``).
INPUT_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "float64", "bool")


def as_dtype(name: str) -> DType:
    """``name`` as a plan's tensor dtype; ValueError for a dtype plans do not know (``complex128``).

    >>> as_dtype("bfloat16")
    'bfloat16'
    """
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown tensor dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return typing.cast(DType, name)


def training_dtype(tensor_dtype: str) -> TrainingDType | None:
    """The training dtype ``--dtype`` names for a tensor dtype, or None (``float64``, integers).

    >>> training_dtype("float32"), training_dtype("float64")
    ('fp32', None)
    """
    names = {tensor: name for name, tensor in TRAINING_DTYPES.items()}
    return typing.cast(TrainingDType, names[tensor_dtype]) if tensor_dtype in names else None


def training_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype as ``--dtype`` names it (``bf16``: 2)."""
    return DTYPE_BYTES[TRAINING_DTYPES[dtype]]


#: A numbered child of an experts container: ``3`` (a ``LayerList``'s) or ``expert_3`` (a
#: ``LayerDict``'s, as Hugging Face's Switch Transformers names them).
_EXPERT_NAME = re.compile(r"(?:[A-Za-z_]*_)?([0-9]+)")


def expert_number(name: str) -> int | None:
    """Which expert a container's child is, or None for a child that is not a numbered expert.

    >>> expert_number("3"), expert_number("expert_12"), expert_number("router")
    (3, 12, None)
    """
    found = _EXPERT_NAME.fullmatch(name)
    return int(found.group(1)) if found else None
