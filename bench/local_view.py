"""Per-rank activation memory of GPT-2's attention at mp2: local view against the gathered layout.

The tests' GPT-2 (tests/models/zoo/gpt2_hf.py, HF's ``c_attn`` fused q|k|v) is planned at mp2 twice,
with local views (the default) and without (``--no-local-view``: the fused projection's output is
gathered and the attention core runs whole on every rank), and each plan is applied on 2 gloo
ranks. One forward + backward runs with ``paddle.autograd.saved_tensors_hooks`` active inside the
first block's attention sub-layer: the bytes of the tensors it saves for backward (each rank's
local values; tensors of a weight's shape, the weights themselves, left out) are the activations
the attention keeps per rank. Also recorded: the scores' shape
on each rank.

Communication is not measured here: the gathered layout's row all-reduce is inserted by Paddle
inside its own ops, where no Python wrapper sees it.

Run: ``.venv/bin/python bench/local_view.py [--markdown]`` (launches its own 2 ranks; about 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TARGET = "tests/models/zoo/gpt2_hf.py"


def make_plans(folder: Path) -> dict[str, str]:
    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_target
    from autodist.schemas import save_plan

    request = SearchRequest(
        devices_per_node=2, dp=1, mp=2, pp=1, sharding_stage=0, sequence_parallel=False, global_batch_size=2
    )
    paths = {}
    for name, local in (("local view", True), ("gathered", False)):
        plan = plan_target(TARGET, None, request, {"target": TARGET}, local_view=local).plan
        paths[name] = str(folder / f"{name.replace(' ', '_')}.json")
        save_plan(plan, paths[name])
    return paths


def worker(plans: dict[str, str], out: str) -> None:
    import paddle
    import paddle.distributed as dist

    from autodist import apply_plan
    from models.zoo import gpt2_hf

    dist.init_parallel_env()
    results = {}
    for name, path in plans.items():
        paddle.seed(0)
        model = gpt2_hf.build_model()
        model.eval()  # no dropout: both layouts compute the same thing
        model, _, _ = apply_plan(model, None, None, path)
        attn = model.transformer.h[0].attn
        saved, scores = [], []

        weights = {tuple((p._local_value() if p.is_dist() else p).shape) for p in attn.parameters()}

        def pack(t):
            local = t._local_value() if t.is_dist() else t
            if tuple(local.shape) not in weights:  # the weights' own values are no activations
                saved.append(local.numel().item() * local.element_size())
            return t

        forward, matmul = attn.forward, paddle.matmul

        def recorded(x, y, *args, **kwargs):
            out = matmul(x, y, *args, **kwargs)
            local = out._local_value() if out.is_dist() else out
            if local.ndim == 4 and local.shape[-1] == local.shape[-2]:
                scores.append(list(local.shape))
            return out

        def measured(*args, **kwargs):
            paddle.matmul = recorded
            try:
                with paddle.autograd.saved_tensors_hooks(pack, lambda t: t):
                    return forward(*args, **kwargs)
            finally:
                paddle.matmul = matmul

        attn.forward = measured
        tokens = paddle.randint(0, gpt2_hf.VOCAB, [2, 8])
        gpt2_hf.loss(model, tokens, tokens).backward()
        results[name] = {"saved_bytes": sum(saved), "saved_tensors": len(saved), "scores": scores}
    Path(out).with_suffix(f".rank{dist.get_rank()}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("PLANS", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker[0]).read_text()), args.worker[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plans = folder / "plans.json"
        plans.write_text(json.dumps(make_plans(folder)))
        out = folder / "result"
        env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
        subprocess.run(
            [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(folder / "log"),
             __file__, "--worker", str(plans), str(out)],
            check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    rows = [
        (name, r, ranks[r][name]["saved_bytes"], ranks[r][name]["saved_tensors"], ranks[r][name]["scores"][0])
        for name in ("gathered", "local view")
        for r in range(2)
    ]
    ratio = ranks[0]["local view"]["saved_bytes"] / ranks[0]["gathered"]["saved_bytes"]
    if args.markdown:
        print(
            "| layout | rank | activation bytes block 0's attention saves for backward | tensors | scores on the rank |"
        )
        print("|---|---|---|---|---|")
        for name, r, size, count, shape in rows:
            print(f"| {name} | {r} | {size} | {count} | {shape} |")
        print(f"\nlocal view / gathered: {ratio:.2f}")
    else:
        for row in rows:
            print(*row)
        print(f"local view / gathered: {ratio:.2f}")


if __name__ == "__main__":
    main()
