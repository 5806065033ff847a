"""Per-rank parameter bytes of PaddleFormers' Trainer at mp2: its own built-in Llama config
against an autodist plan installed with ``autodist.integrations.paddleformers.install``.

Two 2-rank gloo jobs train one step of a PaddleFormers ``LlamaForCausalLM`` (untied head) with
``TrainingArguments(enable_auto_parallel=True, tensor_model_parallel_size=2)``: one with
``use_intermediate_api=True`` (the Trainer asks the model class for its ``auto_dist_config``,
``llama/auto_dist_config.py``), one with the plan ``autodist.plan`` makes for the same model at
mp2. Each rank reports the bytes of its local parameter shards and which parameters are split.
On CPU the Trainer's ``fully_shard`` is replaced by a no-op (TEST-ONLY stand-in, as in
tests/test_trainer_paddleformers.py; its fused path is GPU-only).

    python bench/trainer_params.py [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the multi-process harness (launcher)

CONFIG = dict(
    vocab_size=4000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=128, fuse_rms_norm=False, tie_word_embeddings=False,
    use_single_model_implementation=True,  # the built-in config asks for it (llama/modeling.py)
)  # fmt: skip
BATCH, SEQ = 4, 32


def build():
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(1234)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def worker(job_path: str) -> None:
    import numpy as np
    import paddle.distributed as dist
    import paddleformers.trainer.trainer as trainer_module
    from paddleformers.trainer import Trainer, TrainingArguments

    from autodist.integrations.paddleformers import install, trainer_arguments

    job = json.loads(Path(job_path).read_text())
    trainer_module.fully_shard = lambda model, **_: model  # TEST-ONLY stand-in: fused path is GPU-only
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 4000, SEQ), "labels": rng.integers(0, 4000, SEQ)} for _ in range(BATCH)]
    degrees = {"enable_auto_parallel": True, "tensor_model_parallel_size": 2, "per_device_train_batch_size": BATCH}
    degrees.update(trainer_arguments(job["plan"]) if job["plan"] else {"use_intermediate_api": True})
    args = TrainingArguments(
        output_dir=job["out"], max_steps=1, dataloader_shuffle=False, amp_master_grad=False, save_strategy="no",
        report_to=[], disable_tqdm=True, **degrees,
    )  # fmt: skip
    trainer = Trainer(model=build(), args=args, train_dataset=data)
    if job["plan"]:
        install(trainer, job["plan"])
    trainer.train()
    total, split = 0, []
    for name, p in trainer.model.named_parameters():
        local = p._local_value() if p.is_dist() else p
        total += int(np.prod(local.shape)) * local.element_size()
        if list(local.shape) != list(p.shape):
            split.append(name)
    out = {"bytes": total, "split": split, "count": len(list(trainer.model.parameters()))}
    Path(job["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))


def run(workdir: Path) -> dict:
    import autodist
    from harness.launcher import launch_ranks

    plan_path = workdir / "plan.json"
    specs = [f"input_ids:int64:{BATCH}x{SEQ}", f"labels:int64:{BATCH}x{SEQ}"]  # what the Trainer passes
    plan = autodist.plan(build(), specs, devices=2, device="cpu", dp=1, mp=2, pp=1,
                         sequence_parallel=False, sharding_stage=0, micro_batches=1)  # fmt: skip
    autodist.save_plan(plan, plan_path)
    results = {}
    for name, plan_arg in (("built-in config", None), ("autodist plan", str(plan_path))):
        out = workdir / name.replace(" ", "_")
        out.mkdir()
        (out / "job.json").write_text(json.dumps({"out": str(out), "plan": plan_arg}))
        launch_ranks(2, [__file__, "--worker", str(out / "job.json")], out, timeout_s=600).raise_for_failure()
        results[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    results["one device"] = sum(int(__import__("numpy").prod(p.shape)) * 4 for p in build().parameters())
    return results


def report(results: dict, markdown: bool) -> str:
    whole = results["one device"]
    lines = ["| config | bytes per rank | of one device | split tensors | which |", "|---|---|---|---|---|"]
    lines.append(f"| one device | {whole:,} | 100% | 0 | |")
    for name in ("built-in config", "autodist plan"):
        rank0 = results[name][0]
        which = sorted({n.split(".")[-2] for n in rank0["split"]})
        lines.append(
            f"| {name} | {rank0['bytes']:,} | {100 * rank0['bytes'] / whole:.0f}% | {len(rank0['split'])} of "
            f"{rank0['count']} | {', '.join(which)} |"
        )
    text = "\n".join(lines)
    return text if markdown else text.replace("|", " ").replace("---", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        print(report(run(Path(tmp)), args.markdown))


if __name__ == "__main__":
    main()
