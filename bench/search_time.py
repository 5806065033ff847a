"""Time the strategy search (not a test: no asserts on time).

Traces the docstring Llama under ``paddle.LazyGuard()`` at hidden 4096 and 32 / 80 layers,
then times ``model_cost`` (graph -> cost description, once per model), ``search`` on the
analysis (what the CLI runs: model_cost + enumeration) and ``search`` on the ready ModelCost
(the enumeration alone) for clusters of 8 to 1024 H100s; prints a Markdown table for
docs/benchmarks.md. Best of 3 each. The global batch is the model's spec batch (4) per device,
4 x devices, the workload the table has always priced: since 2700320 the spec's batch alone is
the global batch, and 4 sequences would cap dp at 4 and collapse the search on big clusters.

    .venv/bin/python bench/search_time.py
"""

from __future__ import annotations

import time
from pathlib import Path

import paddle

from autodist.planner import driver
from autodist.planner.load import import_model_file
from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.search import SearchRequest, search
from autodist.schemas.describe import strategy_text

MODEL_FILE = Path(__file__).resolve().parents[1] / "plans" / "llama_docstring" / "model.py"
CLUSTERS = [(8, 1), (8, 2), (8, 8), (8, 64), (8, 128)]  # (devices per node, nodes)
REPEATS = 3


def load_docstring_module():
    return import_model_file(MODEL_FILE)


def main() -> None:
    module = load_docstring_module()
    print("| layers | devices | model_cost (s) | search (s) | of which enumeration (s) | strategies priced | chosen |")
    print("|---|---|---|---|---|---|---|")
    for layers in (32, 80):
        with paddle.LazyGuard():
            model = module.build_model(num_layers=layers, hidden_size=4096)
        analysis = driver.analyse(model, driver.trace(model, module.input_spec()))
        cost_s, cost = best_time(lambda: model_cost(analysis))
        for devices_per_node, nodes in CLUSTERS:
            global_batch = module.BATCH_SIZE * devices_per_node * nodes
            request = SearchRequest(devices_per_node=devices_per_node, nodes=nodes, global_batch_size=global_batch)
            search_s, result = best_time(lambda: search(analysis, request))
            enumerate_s, _ = best_time(lambda: search(cost, request))
            print(
                f"| {layers} | {nodes} x {devices_per_node} | {cost_s:.3f} | {search_s:.3f} | {enumerate_s:.3f} | "
                f"{result.evaluated} | {strategy_text(result.best.strategy, 'short')} |"
            )


def best_time(run):
    """(fastest of REPEATS runs in seconds, the last result)."""
    best, result = float("inf"), None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


if __name__ == "__main__":
    main()
