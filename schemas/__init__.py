"""The autodist plan format (schema v2): msgspec Structs, strict I/O, JSON Schema.

Imports nothing but msgspec, so both the planner and the light run-time applier use it.

Example::

    >>> from autodist.schemas import load_plan, save_plan, PlanError
    >>> try:
    ...     load_plan(b'{"format": "autodist.plan", "version": 99}')
    ... except PlanError as err:
    ...     print(err.problems[0][:40])
    $.version: this plan is format version 9
"""

from autodist.schemas.checks import check_plan, shard_dim
from autodist.schemas.errors import PlanError, printable
from autodist.schemas.fingerprint import (
    ParameterDiff,
    dtype_name,
    parameter_diff,
    parameter_fingerprint,
    parameter_table,
)
from autodist.schemas.io import dump_plan, load_plan, plan_json_schema, save_plan
from autodist.schemas.plan import (
    FORMAT,
    VERSION,
    Alternatives,
    Block,
    Candidate,
    Cluster,
    CommEstimate,
    DataPlan,
    DeviceProfile,
    Estimate,
    ExpertCombine,
    ExpertDispatch,
    HOOK_TYPES,
    Hook,
    HookBase,
    ImplicitComm,
    InputSpec,
    Kernels,
    LocalAttribute,
    LocalBuffer,
    CallInput,
    LocalView,
    LocalWeight,
    MemoryEstimate,
    Mesh,
    ModelInfo,
    ParamPlan,
    Plan,
    Provenance,
    Rejected,
    Reshard,
    SequenceParallelBegin,
    SequenceParallelEnd,
    StageHandoff,
    Strategy,
    VocabLookup,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "Alternatives",
    "Block",
    "Candidate",
    "Cluster",
    "CommEstimate",
    "DataPlan",
    "DeviceProfile",
    "Estimate",
    "ExpertCombine",
    "ExpertDispatch",
    "HOOK_TYPES",
    "Hook",
    "HookBase",
    "ImplicitComm",
    "InputSpec",
    "Kernels",
    "LocalAttribute",
    "LocalBuffer",
    "CallInput",
    "LocalView",
    "LocalWeight",
    "MemoryEstimate",
    "Mesh",
    "ModelInfo",
    "ParameterDiff",
    "ParamPlan",
    "Plan",
    "PlanError",
    "Provenance",
    "Rejected",
    "Reshard",
    "SequenceParallelBegin",
    "SequenceParallelEnd",
    "StageHandoff",
    "Strategy",
    "VocabLookup",
    "check_plan",
    "dtype_name",
    "dump_plan",
    "load_plan",
    "parameter_diff",
    "parameter_fingerprint",
    "parameter_table",
    "plan_json_schema",
    "printable",
    "save_plan",
    "shard_dim",
]
