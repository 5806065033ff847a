"""The model's analysis as a strategy runs it: one owner, built once, handed to cost, search and emit.

The traced analysis (:class:`~autodist.planner.recognise.analysis.ModelAnalysis`) is the model
as written. A strategy runs it in one of a few ways (:class:`RunsAs`), and two facts decide which:

- the sub-layers that run as local views (:func:`~autodist.schemas.parallel_dims.runs_local_views`):
  each stopped sub-layer among them is split as Megatron splits it
  (:func:`~autodist.planner.recognise.analysis.with_local_views`);
- whether the MoE layers run whole on every mp rank (:func:`~autodist.schemas.parallel_dims.runs_moe_locally`,
  which also asks whether their code holds an op Paddle runs on local tensors only):
  then none of their projections has a tensor-parallel role
  (:func:`~autodist.planner.recognise.analysis.experts_whole`).

:class:`AnalysisFor` builds the analysis for each way once and keeps it: the cost model prices
it (``search.PricedModel.cost_for``), the search ranks strategies by that price, and emit places
the chosen strategy's parameters and hooks from the same object, so what is priced is what is
placed. Many strategies run the model the same way (every strategy without mp, say), so there
are far fewer analyses than strategies.

Example::

    >>> from autodist.schemas import Strategy
    >>> analysis_for = AnalysisFor(moe_analysis)                       # doctest: +SKIP
    >>> analysis_for.runs_as(Strategy(dp=2, mp=2), frozenset({"layers.0.attn"}))   # doctest: +SKIP
    RunsAs(local=frozenset({'layers.0.attn'}), moe_whole=True)
    >>> analysis_for.runs_as(Strategy(dp=4), frozenset({"layers.0.attn"}))  # no mp: no local view  # doctest: +SKIP
    RunsAs(local=frozenset(), moe_whole=True)
    >>> analysis_for(RunsAs(moe_whole=True)) is analysis_for(RunsAs(moe_whole=True))  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autodist.schemas.parallel_dims import runs_moe_locally
from autodist.schemas.parallel_dims import runs_local_views
from autodist.schemas.plan import Strategy

if TYPE_CHECKING:  # the search imports this module; the analysis (Paddle, networkx) only when built
    from autodist.planner.recognise.analysis import ModelAnalysis


@dataclass(frozen=True)
class RunsAs:
    """How a strategy runs the traced model: the sub-layers run as local views (``local``), and
    whether each MoE layer runs whole on every mp rank (``moe_whole``). The default is the model
    as traced: no local view, the MoE layers' projections split like the rest."""

    local: frozenset[str] = frozenset()
    moe_whole: bool = False


class AnalysisFor:
    """``analysis_for(runs)``: the traced ``analysis`` as a strategy that :class:`RunsAs` ``runs``
    runs it, built on first use and kept. ``builds`` counts the builds per way of running (each
    is 1: tests/test_strategy_analysis.py)."""

    def __init__(self, analysis: ModelAnalysis) -> None:
        self.traced = analysis
        self.builds: Counter[RunsAs] = Counter()
        self._built: dict[RunsAs, ModelAnalysis] = {}
        self._moe = any(block.experts is not None for block in analysis.blocks)
        self._moe_local_only = bool(self._moe and analysis.moe_local_only)
        from autodist.planner.recognise.reshards import local_view_candidates

        #: Views whose row projection is a layer beside them (``SubLayer.joined``): not under
        #: sequence parallelism (applier/modes/local_calls.JOINED_UNDER_SEQUENCE_PARALLEL).
        self._joined = frozenset(
            layer for block in analysis.blocks for layer, sub in local_view_candidates(block) if sub.joined
        )

    def runs_as(self, strategy: Strategy, local_views: frozenset[str]) -> RunsAs:
        """How ``strategy`` runs the model when its sub-layers ``local_views`` may run as local
        views: all of them where local views run (but a joined one under sequence parallelism),
        none elsewhere; its MoE layers whole where they run locally (a model without one runs the
        same either way: ``moe_whole`` False)."""
        local = local_views if runs_local_views(strategy) else frozenset()
        if strategy.sequence_parallel:
            local -= self._joined
        return RunsAs(local, self._moe and runs_moe_locally(strategy, self._moe_local_only))

    def __call__(self, runs: RunsAs) -> ModelAnalysis:
        from autodist.planner.recognise.analysis import experts_whole, with_local_views

        if runs not in self._built:
            self.builds[runs] += 1
            analysis = with_local_views(self.traced, runs.local)
            self._built[runs] = experts_whole(analysis) if runs.moe_whole else analysis
        return self._built[runs]
