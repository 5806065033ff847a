"""Price the pipeline schedules for a large model (not a test: no asserts).

Traces the docstring Llama under ``paddle.LazyGuard()`` at 80 layers, hidden 4096 (9.5 B
parameters), and searches 4 nodes x 8 H100s three ways: with the schedule fixed to
``sequential`` (stage hand-offs, no micro-batch overlap), fixed to ``1F1B``, and free (what
``autodist-plan`` chooses). For each: the best strategy, its priced step time, the pipeline
hand-off bytes per rank and step, and, at the chosen strategy's pp (2 if it has none), the best
step time per schedule. Prints Markdown for docs/benchmarks.md. The global
batch is the spec's 4 sequences per device (128), the workload the table has always priced (since
2700320 the spec's batch alone is the global batch, and 4 would cap dp at 4).

    .venv/bin/python bench/pipeline_schedule.py
"""

from __future__ import annotations

from pathlib import Path

import paddle

from autodist.planner.cost.search import SearchRequest, search
from autodist.schemas.describe import strategy_text
from autodist.planner.errors import PlannerError
from autodist.planner.graph import build_graph
from autodist.planner.recognise.analysis import analyze
from autodist.planner.load import import_model_file
from autodist.planner.trace import trace_model

MODEL_FILE = Path(__file__).resolve().parents[1] / "plans" / "llama_docstring" / "model.py"
LAYERS, HIDDEN = 80, 4096
NODES, DEVICES_PER_NODE = 4, 8


def load_docstring_module():
    return import_model_file(MODEL_FILE)


def row(label: str, result) -> str:
    best = result.best
    est = best.estimate
    return (
        f"| {label} | {strategy_text(best.strategy, 'short')} | {est.step_time_s:.3f} | {est.tokens_per_s:,.0f} | "
        f"{est.mfu:.2f} | {est.comm_bytes.pp / 2**20:,.0f} | {est.memory.total / 2**30:.1f} |"
    )


def main() -> None:
    module = load_docstring_module()
    with paddle.LazyGuard():
        model = module.build_model(num_layers=LAYERS, hidden_size=HIDDEN)
    program = trace_model(model, module.input_spec())
    analysis = analyze(program, build_graph(program), model)
    base = dict(
        devices_per_node=DEVICES_PER_NODE,
        nodes=NODES,
        global_batch_size=module.BATCH_SIZE * NODES * DEVICES_PER_NODE,
        dtype="bf16",  # mixed precision on H100, as docs/benchmarks.md prices it (the model's own: fp32)
    )
    chosen = search(analysis, SearchRequest(**base))
    print(
        f"Docstring Llama, {LAYERS} layers, hidden {HIDDEN}, on {NODES} x {DEVICES_PER_NODE} "
        f"{SearchRequest(**base).device.name}\n"
    )
    print("| search | best strategy | step (s) | tokens/s | MFU | pp hand-off MiB/rank/step | memory GiB/rank |")
    print("|---|---|---|---|---|---|---|")
    for schedule in ("sequential", "1F1B"):
        print(row(f"schedule={schedule}", search(analysis, SearchRequest(**base, schedule=schedule))))
    print(row("free (the plan)", chosen))
    pp = max(2, chosen.best.strategy.pp)
    print(f"\nAt pp={pp} (the other degrees searched):\n")
    print("| schedule | best strategy | step (s) | tokens/s | MFU | pp hand-off MiB/rank/step | memory GiB/rank |")
    print("|---|---|---|---|---|---|---|")
    for schedule in ("sequential", "1F1B", "VPP"):
        try:
            print(row(schedule, search(analysis, SearchRequest(**base, pp=pp, schedule=schedule))))
        except PlannerError as exc:
            print(f"| {schedule} | none: {str(exc).splitlines()[0]} | | | | | |")


if __name__ == "__main__":
    main()
