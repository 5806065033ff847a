"""Calls across the packages with the wrong types, for tests/test_typecheck.py: mypy must name
each one (the line numbers are in the test)."""

from autodist.applier.placement.mesh import to_paddle_placement
from autodist.planner.cost.search import SearchRequest
from autodist.schemas import Strategy
from autodist.schemas.parallel_dims import expert_limit
from autodist.schemas.vocabulary import local_shape

local_shape([8, 6], "S(1)", [2])  # placements are a list, one per mesh axis
expert_limit(Strategy(dp=2), moe="yes")
SearchRequest(dtype="int8")  # not a training dtype
to_paddle_placement(["S(1)"])
