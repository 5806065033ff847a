"""A GPT-2-style model at mp8 pp2 with full recompute, as its plan prices it: local view against gathered.

The test suite's copy of HF's GPT-2 (``tests/models/zoo/gpt2_hf.py``: the fused ``c_attn``, the
LM head tied to ``wte``), its module sizes set before building, is planned for 2 nodes of 8 H100s
at mp8 pp2 (1F1B), full recompute, no sequence parallelism, batch 8 x 1024 tokens, twice: with
local views (the default) and with ``--no-local-view``, where each fused projection's output is
gathered over mp and the attention core runs whole on every one of the 8 ranks, and the token
lookup gathers the vocabulary-split table. Nothing runs: the numbers are the plans' own estimates
(the cost model's), per rank: the activations kept, the bytes moved over mp in one step, the step
time. Two sizes: GPT-2 medium (24 layers, hidden 1024, 16 heads) and a narrow one (hidden 256,
16 heads), each with the vocabulary padded to 50304 to divide over mp.

Run: ``.venv/bin/python bench/local_view_mp8_pp2.py [--markdown]`` (planning only; about 3 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
#: The models: name -> gpt2_hf's module sizes; the batch they are priced at.
MODELS = {
    "GPT-2 medium": dict(VOCAB=50304, N_EMBD=1024, N_HEAD=16, N_LAYER=24, N_POSITIONS=1024),
    "GPT-2 narrow": dict(VOCAB=50304, N_EMBD=256, N_HEAD=16, N_LAYER=24, N_POSITIONS=1024),
}
INPUT = "input_ids:int64:8x1024"


def gpt2(sizes: dict[str, int]):
    """tests/models/zoo/gpt2_hf.py at ``sizes`` (module constants its classes read when built)."""
    spec = importlib.util.spec_from_file_location("bench_gpt2_hf", REPO / "tests" / "models" / "zoo" / "gpt2_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in sizes.items():
        setattr(module, name, value)
    return module


def plans(sizes: dict[str, int]) -> dict[str, object]:
    """The two plans of the model at ``sizes``, by layout name."""
    import autodist

    model = gpt2(sizes)
    return {
        name: autodist.plan(
            model.build_model(),
            [INPUT],
            devices=8,
            nodes=2,
            device="h100-sxm",
            dp=1,
            mp=8,
            pp=2,
            schedule="1F1B",
            sequence_parallel=False,
            sharding_stage=0,
            recompute="full",
            local_view=local,
        )  # fmt: skip
        for name, local in (("local view", True), ("gathered", False))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows, notes = [], []
    for model, sizes in MODELS.items():
        made = plans(sizes)
        for name, plan in made.items():
            e, s = plan.estimate, plan.strategy
            assert (s.dp, s.mp, s.pp, s.recompute) == (1, 8, 2, "full"), s
            rows.append((model, name, len(plan.local_view), len(plan.vocab_lookup), e.memory.activations / MIB,
                         e.comm_bytes.mp / MIB, e.step_time_s * 1e3))  # fmt: skip
        notes += [f"{model}: {n}" for n in made["local view"].notes if n.startswith("local view")]
    if args.markdown:
        print(
            "| model | layout | local views | local lookups | activations per rank (MiB) "
            "| mp bytes per rank per step (MiB) | step (ms) |"
        )
        print("|---|---|---|---|---|---|---|")
        for model, name, views, lookups, act, mp, step in rows:
            print(f"| {model} | {name} | {views} | {lookups} | {act:.1f} | {mp:.1f} | {step:.1f} |")
    else:
        for row in rows:
            print(*row)
    for local, gathered in zip(rows[::2], rows[1::2]):
        print(
            f"\n{local[0]}, gathered / local view: activations {gathered[4] / local[4]:.2f}x, "
            f"mp bytes {gathered[5] / local[5]:.2f}x"
        )
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
