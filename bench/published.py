"""The cost model against published training runs: predicted / published step time per row.

Two sets, each priced with the strategy the authors ran (dp, mp, pp, schedule, micro-batches,
recompute), on a GPT traced at the row's sizes (tests/models/gpt.py: two blocks traced, the
block cost repeated to the row's depth), with the kernels that model selects and the row's GPU
runs (planner/kernels.py: the Megatron-LM GPT writes its softmax, priced eager; the MPT stand-in
calls ``F.scaled_dot_product_attention``, priced as flash attention on the h100 profile):

- Megatron-LM (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC 2021, table 1; also the Megatron-LM README): GPT, vocabulary 51200,
  sequence 2048, A100 80 GB (Selene: DGX A100, 8 HDR InfiniBand NICs per node), full activation
  recompute, micro-batches, schedule and DDP as the paper's script ran them (:func:`megatron_rows`),
  published teraFLOP/s per GPU counted with the paper's formula
  96 B s l h^2 (1 + s / 6h + V / 16 l h) (which includes the recompute). The first six rows,
  the ones within 1024 GPUs. ``--fit`` fits the A100 profiles' matmul efficiency on these rows
  (the ``matmul_efficiency`` of devices/a100-*.toml).
- Megatron-LM on H100 (the NVIDIA/Megatron-LM README, "Training Speed and Scalability", the
  weak-scaling table images/model_table.png, added in commit 937571c, July 2024): GPT,
  vocabulary 131072, sequence 4096, 1.7B to 462B on 48 to 6144 H100s, Megatron-Core with
  Transformer Engine (flash attention), sequence parallelism (``--tp-comm-overlap`` needs it),
  the distributed optimizer (``--overlap-param-gather`` needs it: ZeRO-1), published teraFLOP/s per GPU counted with Megatron's
  ``num_floating_point_operations`` (model FLOPs, no recompute). These runs overlap their
  tensor-, data- and pipeline-parallel communication with compute (``--tp-comm-overlap``,
  ``--overlap-grad-reduce``, ``--overlap-param-gather``), which the planner does not model (it
  prices Paddle, which exposes them): priced with that communication hidden, i.e. free links
  (the planner's own estimate, communication exposed, is printed beside it). Free links leave
  the profile's ``overlap_compute_loss`` nothing to act on: what the runs' hidden communication
  costs their compute lands in the fit. ``--fit`` fits the
  h100-sxm profile's matmul efficiency on these rows.
- MosaicML llm-foundry (scripts/train/benchmarking/README.md, "H100 80GB BF16"; not used for
  any fit: the validation set): MPT models with PyTorch FSDP FULL_SHARD (ZeRO-3), sequence 2048, the rows at 2048;
  published MFU (model FLOPs with attention, no recompute) converted to step time. Every row's
  "MP Mode" is Composer's ``DEFAULT`` mixed precision: bf16 parameters, gradients reduced in fp32
  (``Setup.grad_reduce_dtype``).

Tensor parallelism is priced as these systems run it, not as autodist's applier would run the
row's strategy: the GPT's fused q|k|v attention as a local view (each mp rank its own heads, the
core at 1/mp, Megatron's two all-reduces: ``model_cost(..., local_view_layers(analysis))``) and
the vocabulary-split token lookup on local tensors (one all-reduce of its output:
``estimate(..., local_views=True)``), under every strategy. apply_plan runs local views under
dp x mp with ZeRO 1, 2 or 3, micro-batches, full recompute, 1F1B and sequence parallelism, not
with VPP or selective recompute (``runs_local_views``), so priced as autodist would train a row
of those, the attention would be gathered (its core whole on every mp rank) and the
table all-gathered twice per micro-batch.

Run: ``.venv/bin/python bench/published.py [--fit] [--markdown]``. Nothing asserts on it.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@dataclass(frozen=True)
class Row:
    name: str
    hidden: int
    heads: int
    layers: int
    vocab: int
    seq: int
    gpus: int
    global_batch: int
    mp: int = 1
    pp: int = 1
    micro_batch: int = 1  # sequences per micro-batch
    zero: int = 0
    recompute: str = "full"
    schedule: str = "1F1B"
    published_s: float = 0.0  # step time implied by the published figure
    published: str = ""  # the figure as published
    sequence_parallel: bool = False
    comm_hidden: bool = False  # the run overlapped all its communication with compute (see price)
    virtual_stages: int = 1  # model chunks per rank of an interleaved (VPP) schedule
    grads_after_backward: bool = False  # the data-parallel all-reduce runs after the backward, not beside it
    grad_reduce: str | None = None  # the dtype its gradients are summed in over dp; None: bf16, as trained


def megatron_rows() -> list[Row]:
    """Table 1, rows 1-6 (params, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU),
    run as the paper's own scripts run them (``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM:
    micro-batch size, model chunks per rank, DDP implementation; the table gives none of them):

    - micro-batches of 16, 16, 16, 8, 4 and 2 sequences (``MBS``);
    - the 76.1B row interleaved, 5 of each stage's 15 layers per chunk (``--num-layers-per-virtual-
      pipeline-stage 5``: 3 chunks per rank, priced as VPP), the 39.1B row 1F1B;
    - the rows without a pipeline with PyTorch's DDP (``DDP=torch``: the gradient all-reduce in
      buckets beside the backward, as the planner prices it), the pipeline rows with Megatron's own
      (``DDP=local``: ``allreduce_gradients`` after the whole backward, exposed).
    """
    table = [
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
        ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
        ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
        ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
        ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
        ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    ]
    s, v = 2048, 51200

    def flops(h: int, layers: int) -> float:  # the paper's formula, per sequence, layer and h^2
        return 96 * s * (1 + s / (6 * h) + v / (16 * layers * h))

    rows = []
    for *row, micro_batch, chunks in table:
        made = _megatron_row(tuple(row), s, v, flops, micro_batch=micro_batch, virtual_stages=chunks)
        rows.append(replace(made, schedule="VPP" if chunks > 1 else made.schedule, grads_after_backward=made.pp > 1))
    return rows


def megatron_h100_rows() -> list[Row]:
    """The README's H100 weak-scaling table, all nine rows (params, heads, hidden,
    layers, TP, PP, GPUs, batch, teraFLOP/s per GPU; data-parallel size 48 in every row).

    The table gives neither the micro-batch size nor the recompute: priced with one sequence per
    micro-batch (as the A100 rows) and no recompute (the published figure counts none, and with
    Transformer Engine's flash attention there are no attention scores for selective recompute to
    drop); the pipeline rows with 1F1B, Megatron's schedule without virtual stages.
    """
    table = [
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    ]
    s, v = 4096, 131072

    def flops(h: int, layers: int) -> float:
        # Megatron's num_floating_point_operations for a GPT (no GQA, FFN 4h, no SwiGLU), per
        # sequence, layer and h^2: 12 s (2 + s/h + 4 + V / 2lh) = 72 s (1 + s / 6h + V / 12 l h).
        return 72 * s * (1 + s / (6 * h) + v / (12 * layers * h))

    # --tp-comm-overlap asserts --sequence-parallel: sequence parallelism on every tp row.
    settings = {"zero": 1, "recompute": "none", "comm_hidden": True}
    return [_megatron_row(row, s, v, flops, sequence_parallel=row[4] > 1, **settings) for row in table]


def _megatron_row(row: tuple, seq: int, vocab: int, flops: Callable[[int, int], float], **settings) -> Row:
    """A Megatron-LM table row ``(name, heads, hidden, layers, TP, PP, GPUs, batch, teraFLOP/s per
    GPU)`` as a :class:`Row`: the step time is the batch's FLOPs (``flops(hidden, layers)`` per
    sequence, layer and hidden^2) at the published rate; the pipeline rows run 1F1B."""
    name, heads, h, layers, tp, pp, gpus, batch, tflops = row
    total = flops(h, layers) * batch * layers * h * h
    return Row(
        name,
        h,
        heads,
        layers,
        vocab,
        seq,
        gpus,
        batch,
        mp=tp,
        pp=pp,
        schedule="1F1B" if pp > 1 else "none",
        published_s=total / (gpus * tflops * 1e12),
        published=f"{tflops} TFLOP/s",
        **settings,
    )


def mosaic_rows() -> list[Row]:
    """llm-foundry H100 BF16 rows at sequence 2048: (model, GPUs, micro-batch, accumulation,
    activation checkpointing, MFU %, parameters)."""
    sizes = {
        "1b": (2048, 16, 24),
        "3b": (2560, 20, 32),
        "7b": (4096, 32, 32),
        "13b": (5120, 40, 40),
        "30b": (7168, 56, 48),
        "70b": (8192, 64, 80),
    }
    table = [
        ("70b", 64, 8, 4, True, 42.57, 64862437376),
        ("70b", 32, 2, 16, True, 36.15, 64862437376),
        ("30b", 32, 14, 3, True, 43.92, 29975214080),
        ("30b", 16, 10, 3, True, 43.07, 29975214080),
        ("30b", 8, 3, 21, True, 38.11, 29975214080),
        ("13b", 64, 2, 1, False, 39.86, 12853954560),
        ("13b", 8, 2, 1, False, 39.79, 12853954560),
        ("7b", 8, 6, 1, False, 46.44, 6658859008),
        ("3b", 64, 6, 3, False, 40.8, 2651837440),
        ("3b", 16, 10, 3, False, 43.73, 2651837440),
        ("1b", 64, 20, 1, False, 40.85, 1315950592),
        ("1b", 8, 14, 1, False, 41.82, 1315950592),
    ]
    rows = []
    for name, gpus, mbs, accum, checkpointing, mfu, params in table:
        h, heads, layers = sizes[name]
        s, batch = 2048, gpus * mbs * accum
        # llm-foundry's MFU: (6 N + 12 l h s) FLOPs per token over 989 TFLOP/s per GPU.
        flops = batch * s * (6 * params + 3 * 4 * layers * h * s)
        rows.append(
            Row(
                f"mpt-{name} x{gpus}",
                h,
                heads,
                layers,
                50368,
                s,
                gpus,
                batch,
                micro_batch=mbs,
                zero=3,
                recompute="full" if checkpointing else "none",
                schedule="none",
                published_s=flops / (gpus * 989e12 * mfu / 100),
                published=f"MFU {mfu} %",
                grad_reduce="fp32",  # the README's "MP Mode" DEFAULT: Composer's FSDP reduce_dtype fp32
            )
        )
    return rows


def gpt_cost(hidden: int, heads: int, vocab: int, seq: int, sdpa: bool, device):
    """The ModelCost of a GPT block at these sizes, traced with two layers under LazyGuard, with
    the kernels the model selects that ``device`` runs (flash attention for ``sdpa`` on a GPU),
    and its attention as the published systems run it: a local view (each mp rank its own heads,
    Megatron's two all-reduces; ``reshards.local_view_layers``), whatever autodist's applier runs
    under the row's strategy (see the module docstring)."""
    from autodist.planner.cost.graph_cost import model_cost
    from autodist.planner.cost.strategy_analysis import AnalysisFor, RunsAs
    from autodist.planner.kernels import choose_kernels
    from autodist.planner.recognise.reshards import local_view_layers

    analysis = gpt_analysis(hidden, heads, vocab, seq, sdpa)
    kernels = choose_kernels(analysis.graph.graph["selected_kernels"], device)
    key = (hidden, heads, vocab, seq, sdpa, kernels.attention, tuple(kernels.fused))
    if key not in _COSTS:
        local = local_view_layers(analysis)
        assert local, "the GPT's fused qkv attention is a local-view candidate"
        _COSTS[key] = model_cost(AnalysisFor(analysis)(RunsAs(local)), kernels, local)
    return _COSTS[key]


_COSTS: dict = {}


@lru_cache(maxsize=None)
def gpt_analysis(hidden: int, heads: int, vocab: int, seq: int, sdpa: bool):
    """The analysed GPT (tests/models/gpt.py) at these sizes, two layers traced under LazyGuard."""
    import paddle

    from autodist.planner.graph import build_graph
    from autodist.planner.recognise.analysis import analyze
    from autodist.planner.trace import trace_model
    from models import gpt

    cfg = gpt.GPTConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_heads=heads,
        num_layers=2,
        max_positions=seq,
        batch_size=1,
        seq_len=seq,
        sdpa=sdpa,
    )
    with paddle.LazyGuard():
        model = gpt.build_model(cfg)
    traced = trace_model(model, gpt.input_spec(cfg))
    return analyze(traced, build_graph(traced), model)


def with_figures(device, **figures):
    """``device`` with some of its figures replaced."""
    return device.__class__(**{**{f: getattr(device, f) for f in device.__struct_fields__}, **figures})


def free_links(device):
    """``device`` with communication that costs nothing: what a run that overlaps all of it with
    compute exposes, as far as the planner can say (what stays exposed lands in the fit)."""
    return with_figures(
        device,
        intra_node_bandwidth=1e30,
        inter_node_bandwidth=1e30,
        intra_node_latency_s=0.0,
        inter_node_latency_s=0.0,
    )


def price(row: Row, device, sdpa: bool, exposed: bool = False) -> float:
    """The predicted step time of ``row``; a ``comm_hidden`` row with free links unless ``exposed``."""
    from autodist.planner.cost.step_time import Setup, StageTable, estimate
    from autodist.schemas import Strategy

    if row.comm_hidden and not exposed:
        device = free_links(device)
    if row.grads_after_backward:  # nothing runs beside the all-reduce (the rows' only overlapped collective)
        device = with_figures(device, comm_overlap=False)

    cost = gpt_cost(row.hidden, row.heads, row.vocab, row.seq, sdpa, device)
    cost = replace(cost, blocks=(cost.blocks[0],) * row.layers)
    dp = row.gpus // (row.mp * row.pp)
    strategy = Strategy(
        dp=dp,
        mp=row.mp,
        pp=row.pp,
        sharding_stage=row.zero,
        schedule=row.schedule,
        virtual_stages=row.virtual_stages,
        micro_batches=row.global_batch // (dp * row.micro_batch),
        sequence_parallel=row.sequence_parallel,
    )
    setup = Setup(
        device=device,
        devices_per_node=8,
        nodes=row.gpus // 8,
        seq_len=row.seq,
        global_batch=row.global_batch,
        recompute=row.recompute,
        grad_reduce_dtype=row.grad_reduce,
    )
    return estimate(StageTable(cost), strategy, setup, local_views=True).estimate.step_time_s


def table(rows: list[Row], device, sdpa: bool, markdown: bool) -> list[float]:
    ratios = []
    hidden = any(row.comm_hidden for row in rows)
    if markdown:
        extra = " planner, comm exposed (s) |" if hidden else ""
        print(
            "| run | GPUs | mp x pp | published | published step (s) | predicted step (s) | predicted / published |"
            + extra
        )
        print("|---|---|---|---|---|---|---|" + ("---|" if hidden else ""))
    for row in rows:
        predicted = price(row, device, sdpa)
        ratios.append(predicted / row.published_s)
        cells = [
            row.name,
            str(row.gpus),
            f"{row.mp} x {row.pp}",
            row.published,
            f"{row.published_s:.2f}",
            f"{predicted:.2f}",
            f"{ratios[-1]:.2f}",
        ]
        if hidden:
            exposed = price(row, device, sdpa, exposed=True)
            cells.append(f"{exposed:.2f} ({exposed / row.published_s:.2f})")
        print(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells))
    spread = math.exp(math.sqrt(sum(math.log(r) ** 2 for r in ratios) / len(ratios)))
    print(f"\ngeometric RMS error: {spread:.2f}x over {len(rows)} rows; range {min(ratios):.2f}-{max(ratios):.2f}\n")
    return ratios


def fit(device, rows: list[Row], sdpa: bool) -> float:
    """The matmul efficiency that best fits ``rows`` (least squared log error). The per-matmul
    overhead stays the profile's: these rows' matmuls are all large, so it hardly changes them
    and cannot be fitted from them."""
    best = None
    for efficiency in [x / 100 for x in range(30, 96, 1)]:
        trial = with_figures(device, matmul_efficiency=efficiency)
        err = sum(math.log(price(r, trial, sdpa) / r.published_s) ** 2 for r in rows)
        if best is None or err < best[0]:
            best = (err, efficiency)
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the matmul efficiencies on the Megatron-LM rows")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    from autodist.planner.cost.hardware import PROFILES

    if args.fit:
        print(f"fit on Megatron-LM A100: matmul_efficiency={fit(PROFILES['a100-80g'], megatron_rows(), False)}")
        print(f"fit on Megatron-LM H100: matmul_efficiency={fit(PROFILES['h100-sxm'], megatron_h100_rows(), True)}\n")
    print("Megatron-LM, Narayanan et al. SC 2021 table 1 (a100-80g profile; the A100 calibration set):\n")
    table(megatron_rows(), PROFILES["a100-80g"], sdpa=False, markdown=args.markdown)
    print("Megatron-LM README, H100 weak scaling (h100-sxm profile; the H100 calibration set):\n")
    table(megatron_h100_rows(), PROFILES["h100-sxm"], sdpa=True, markdown=args.markdown)
    print("MosaicML llm-foundry, H100 80GB BF16, FSDP FULL_SHARD (h100-sxm profile; not used for any fit):\n")
    table(mosaic_rows(), PROFILES["h100-sxm"], sdpa=True, markdown=args.markdown)


if __name__ == "__main__":
    main()
