"""`autodist-plan export --to paddle-parallelize`: the exported dist.parallelize config lays the
parameters out exactly as the plan says (checked with real Paddle, in one process, and against
``apply_plan`` on 4 ranks).

A default plan, whose attentions and token lookup run on local tensors (``plan.local_view``,
``plan.vocab_lookup``), exports too: the module calls ``autodist.apply_local_views`` for what
``dist.parallelize`` has no key for, and trains HF GPT-2 at dp1 x mp2 and dp2 x mp2 on gloo ranks
to the single-device losses; with ``--paddle-only`` the module is Paddle alone (the planner's
``--no-local-view`` config, a comment per sub-layer on what it loses) and trains so at dp1 x mp2.

This file is also the rank program of the multi-process tests:
``python tests/test_export.py PLAN CONFIG OUT_DIR`` (layouts) and
``python tests/test_export.py train WORKLOAD CONFIG OUT_DIR`` (training).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from autodist.planner.review.export import ExportError, export_parallelize, paddle_key_matches
from autodist.planner.cli.review import export
from autodist.schemas import Block, HOOK_TYPES, StageHandoff, Plan, load_plan, save_plan


def placements_of(param) -> list[str] | None:
    """A Paddle parameter's placements in plan notation; None for a dense tensor."""
    if not param.is_dist():
        return None
    out = []
    for p in param.placements:
        if p.is_replicated():
            out.append("R")
        elif p.is_shard():
            out.append(f"S({p.get_dim()})")
        else:
            out.append("P")
    return out


def expected_layout(plan: Plan, fqn: str) -> tuple[list[str], list[int]]:
    """(placements without the pp dim, process ids of the stage's mesh) the plan asks for."""
    param, names = plan.params[fqn], plan.mesh.axes
    ids, shape = plan.mesh.process_ids, plan.mesh.shape
    if "pp" in names:
        per_stage = len(ids) // shape[0]
        ids = ids[param.stage * per_stage : (param.stage + 1) * per_stage]
    return [p for d, p in zip(names, param.placements) if d != "pp"], list(ids)


def actual_layout(param) -> tuple[list[str] | None, list[int] | None]:
    """(placements, process ids) of a parameter after distribution; (None, None) when dense."""
    if not param.is_dist():
        return None, None
    return placements_of(param), list(param.process_mesh.process_ids)


def parallelize_with(namespace: dict, model):
    """Run the exported module's ``parallelize`` (``namespace``: the module's globals)."""
    model, _ = namespace["parallelize"](model, None)
    return model


def run_source(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "exported_config", "exec"), namespace)
    return namespace


def assert_exported_layout_matches(plan: Plan, model) -> None:
    model = parallelize_with(run_source(export_parallelize(plan)), model)
    problems = []
    for fqn, param in model.named_parameters():
        want_placements, want_ids = expected_layout(plan, fqn)
        got_placements, got_ids = actual_layout(param)
        if (got_placements, got_ids) != (want_placements, want_ids):
            problems.append(
                f"{fqn}: exported gives {got_placements} on {got_ids}, plan {want_placements} on {want_ids}"
            )
    assert not problems, "\n".join(problems)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def planned_docstring(tmp_path_factory) -> Path:
    """A dp2 x mp2 plan made by the real planner for the harness's tiny docstring Llama (no
    sequence parallelism or ZeRO: Paddle's CPU collectives cannot run them; nothing on local
    tensors: dist.parallelize has no key for it)."""
    from harness.workloads import DOCSTRING_LLAMA_CONFIG

    from autodist.planner.cli import cli

    path = tmp_path_factory.mktemp("planned") / "plan.json"
    env = {f"LLAMA_DOCSTRING_{k.upper()}": str(v) for k, v in DOCSTRING_LLAMA_CONFIG.items()}
    args = [
        str(REPO / "plans/llama_docstring/model.py"),
        "--devices",
        "4",
        "--dp",
        "2",
        "--mp",
        "2",
        "--no-sequence-parallel",
        "--no-local-view",
        "--sharding-stage",
        "0",
        "--device",
        "cpu",
        "--quiet",
        "-o",
        str(path),
    ]
    result = CliRunner(env=env).invoke(cli, args)
    assert result.exit_code == 0, result.output
    return path


# -- what the exported module says -------------------------------------------------------------------


def test_keys_collapse_over_32_layers():
    from test_show import layered_plan

    source = export_parallelize(layered_plan(layers=32, dp=2, mp=2))
    assert source.count("dist.ColWiseParallel()") == 1 and source.count("dist.RowWiseParallel()") == 1
    assert "'llama[.]layers[.][0-9]+[.]self_attn[.]q_proj': dist.ColWiseParallel()," in source
    assert "'dp_config': {'sharding_level': 0}" in source


def test_a_subset_of_layers_gets_an_alternation_key():
    from test_show import layered_plan

    plan = layered_plan(layers=4, mp=2)
    for i in (2, 3):
        plan.params[f"llama.layers.{i}.self_attn.q_proj.weight"].placements = ["R"]
    source = export_parallelize(plan)
    key = "llama[.]layers[.](?:0|1)[.]self_attn[.]q_proj"
    assert f"{key!r}: dist.ColWiseParallel()," in source
    assert paddle_key_matches(key, "llama.layers.1.self_attn.q_proj", {"weight"})
    assert not paddle_key_matches(key, "llama.layers.2.self_attn.q_proj", {"weight"})


def test_paddle_key_matching_follows_paddle():
    # a key naming a parameter applies to the layer that owns it
    assert paddle_key_matches("lm_head.weight", "lm_head", {"weight"})
    assert not paddle_key_matches("lm_head.weight", "lm_head", set())
    # keys are full-length regular expressions
    assert paddle_key_matches("llama.layers.*.mlp", "llama.layers.12.mlp", set())
    assert not paddle_key_matches("llama.layers.*.mlp", "llama.layers.12.mlp.up_proj", set())
    # the exporter's escaped keys: [.] is a dot, never taken for a parameter name
    assert paddle_key_matches("llama[.]layers[.][0-9]+[.]mlp", "llama.layers.12.mlp", {"mlp"})
    assert not paddle_key_matches("llama[.]layers[.][0-9]+[.]mlp", "llama_layers.12.mlp", set())
    assert paddle_key_matches("lm[.]head.weight", "lm.head", {"weight"})


def test_pipeline_split_points_and_no_dp_config_without_dp():
    from test_show import layered_plan

    source = export_parallelize(layered_plan(layers=4, mp=2, pp=2))
    assert "'llama.layers.1': dist.SplitPoint.END," in source
    assert "dp_config" not in source
    assert "dim_names=['pp', 'mp']" in source


def test_a_vpp_plan_is_refused_with_the_way_out():
    """dist.parallelize's pp_config has one split point per stage boundary: VPP's chunks cycling
    over the stages cannot be written as one (the split points would not even be in order)."""
    from test_show import layered_plan

    plan = layered_plan(layers=4, mp=2, pp=2)
    plan.strategy = msgspec.structs.replace(plan.strategy, schedule="VPP", micro_batches=2, virtual_stages=2)
    with pytest.raises(ExportError, match="VPP with 2 chunks per stage: pp_config takes one split point"):
        export_parallelize(plan)


def test_what_paddle_cannot_express_is_an_error():
    from test_show import layered_plan

    plan = layered_plan(layers=2, dp=2, mp=2)
    plan.params["llama.layers.0.self_attn.q_proj.weight"].placements = ["S(0)", "R"]
    with pytest.raises(ExportError, match=r"llama.layers.0.self_attn.q_proj.weight: S\(0\) on dp"):
        export_parallelize(plan)


def test_cli_writes_a_file_or_stdout(tmp_path):
    from test_show import EXAMPLE

    out = tmp_path / "config.py"
    result = CliRunner().invoke(export, [str(EXAMPLE), "--to", "paddle-parallelize", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "'layers[.]0[.]mlp[.]fc_in': dist.ColWiseParallel()," in text
    assert "PrepareLayerOutput(reshard_output([dist.Replicate(), dist.Replicate()]))" in text
    result = CliRunner().invoke(export, [str(EXAMPLE), "--to", "paddle-parallelize"])
    assert result.exit_code == 0 and result.output == text


def test_cli_error_is_one_line_exit_2(tmp_path):
    from test_show import layered_plan

    plan = layered_plan(layers=2, dp=2, mp=2)
    plan.params["llama.layers.0.self_attn.q_proj.weight"].placements = ["S(0)", "R"]
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    out = tmp_path / "config.py"
    result = CliRunner().invoke(export, [str(path), "--to", "paddle-parallelize", "-o", str(out)])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_help_has_an_example():
    result = CliRunner().invoke(export, ["--help"])
    assert result.exit_code == 0 and "autodist-plan export plan.json --to paddle-parallelize" in result.output


# -- real Paddle, one process: the exported config gives the planned placements ---------------------


@pytest.mark.parametrize("dp, mp, head", [(2, 2, "R"), (1, 2, "R"), (2, 2, "S(1)")])
def test_exported_config_places_parameters_as_planned(dp, mp, head):
    from harness.plans import tensor_parallel_plan
    from harness.workloads import WORKLOADS

    workload = WORKLOADS["docstring_llama"]
    plan = tensor_parallel_plan(workload.build(0), dp=dp, mp=mp)
    # the LM head `weight` belongs to the model itself, which dist.parallelize never visits
    plan.params["weight"].placements = [*plan.params["weight"].placements[:-1], head]
    assert_exported_layout_matches(plan, workload.build(0))


def test_sequence_parallel_hooks_become_paddle_plans():
    from test_show import layered_plan

    plan = layered_plan(layers=2, dp=2, mp=2)
    sp = [("llama.embed_tokens", "post", "sequence_parallel_begin"), ("llama.norm", "post", "sequence_parallel_end")]
    for i in range(2):
        sp += [
            (f"llama.layers.{i}.self_attn", "pre", "sequence_parallel_end"),
            (f"llama.layers.{i}.self_attn", "post", "sequence_parallel_begin"),
        ]
    plan.hooks = [HOOK_TYPES[action](layer=layer, when=when) for layer, when, action in sp]
    source = export_parallelize(plan)
    assert "'llama[.]embed_tokens': dist.SequenceParallelBegin()," in source
    assert "'llama[.]layers[.][0-9]+[.]self_attn': dist.SequenceParallelDisable()," in source
    # gathering a layer's output has no Paddle plan of its own: Paddle's c_concat in a helper
    assert "'llama[.]norm': dist.PrepareLayerOutput(gather_sequence_output)," in source
    namespace = run_source(source)
    assert callable(namespace["gather_sequence_output"](namespace["MESH"]))


def test_exported_config_of_a_planned_model_places_parameters_as_planned(planned_docstring):
    from harness.workloads import WORKLOADS

    plan = load_plan(planned_docstring)
    assert plan.params["layers.0.self_attn.q_proj.weight"].placements == ["R", "S(1)"]  # a real tensor-parallel plan
    assert_exported_layout_matches(plan, WORKLOADS["docstring_llama"].build(0))


@pytest.mark.parametrize(
    "checked_in", sorted(REPO.glob("plans/*/plan_*.json")), ids=lambda p: p.parent.name + "/" + p.name
)
def test_every_checked_in_plan_exports(checked_in):
    """Every checked-in plan exports, Paddle-only too, except a VPP plan, which says why it cannot."""
    plan = load_plan(checked_in)
    if plan.strategy.virtual_stages > 1:
        with pytest.raises(ExportError, match="re-plan with --schedule 1F1B to export"):
            export_parallelize(plan, checked_in.name)
        return
    source = export_parallelize(plan, checked_in.name)
    compile(source, checked_in.name, "exec")
    paddle_only = export_parallelize(plan, checked_in.name, paddle_only=True)
    compile(paddle_only, checked_in.name, "exec")
    assert "apply_local_views" not in paddle_only


def _falcon_planned(local_view: bool) -> Plan:
    """Falcon's fused multi-query ``q|k|v`` at mp2: its local view holds the weight whole (K, V)."""
    from harness.planning import plan_target

    from autodist.planner.cost.search import SearchRequest

    target, request = (
        "tests/models/zoo/falcon_hf.py",
        SearchRequest(devices_per_node=2, mp=2, pp=1, sequence_parallel=False),
    )
    return plan_target(target, None, request, {"target": target}, local_view=local_view).plan


def _masked_fill_planned(local_view: bool) -> Plan:
    """An attention whose split Paddle's masked_fill stops (no SPMD rule): a local view, else replicated."""
    import paddle
    from test_mask_spellings import B, D, S, Encoder

    from autodist.planner.cost.search import SearchRequest
    from autodist.planner.driver import plan_model

    spec = [paddle.static.InputSpec([B, S, D], "float32", "x"), paddle.static.InputSpec([B, S], "int64", "mask")]
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    model = Encoder("expand_as+masked_fill", True)
    return plan_model(model, spec, request, {"target": "Encoder"}, local_view=local_view).plan


@pytest.mark.slow
@pytest.mark.parametrize("planned", [_falcon_planned, _masked_fill_planned], ids=["multi_query", "stopped"])
def test_the_paddle_only_config_is_the_no_local_view_plans(planned):
    """``--paddle-only`` of a local-view plan writes the config the planner's own ``--no-local-view``
    plan exports under the same strategy: a multi-query ``q|k|v`` held whole for its view is split
    by columns again and its output gathered; an attention local only because masked_fill stops its
    split is replicated. A comment names each sub-layer."""
    local, gathered = planned(True), planned(False)
    assert local.local_view and not gathered.local_view and local.strategy == gathered.strategy
    text = export_parallelize(local, paddle_only=True)
    assert _config_part(text) == _config_part(export_parallelize(gathered)), text
    for view in local.local_view:
        assert f"#: - {view.layer}: " in text, text


@pytest.mark.slow
def test_exported_pipeline_config_puts_parameters_on_their_stage():
    from harness.plans import tensor_parallel_plan
    from harness.workloads import WORKLOADS

    workload = WORKLOADS["paddleformers_llama"]
    flat = tensor_parallel_plan(workload.build(0), dp=1, mp=2)
    base = next(f for f in flat.params if ".layers." in f).split(".layers.")[0]  # "model" in paddleformers 1.2
    layers = sorted({int(f.split(".")[2]) for f in flat.params if f.startswith(f"{base}.layers.")})
    first_stage = {f"{base}.layers.{i}" for i in layers[: len(layers) // 2]}

    def stage_of(fqn: str) -> int:
        if fqn.startswith(f"{base}.embed_tokens"):
            return 0
        return 0 if any(fqn.startswith(prefix + ".") for prefix in first_stage) else 1

    params = {
        fqn: msgspec.structs.replace(p, placements=["R", *p.placements], stage=stage_of(fqn))
        for fqn, p in flat.params.items()
    }
    plan = msgspec.structs.replace(
        flat,
        mesh=msgspec.structs.replace(flat.mesh, axes=["pp", "mp"], shape=[2, 2], process_ids=[0, 1, 2, 3]),
        cluster=msgspec.structs.replace(flat.cluster, devices_per_node=4),
        strategy=msgspec.structs.replace(flat.strategy, pp=2, schedule="sequential"),
        params=params,
        blocks=[
            Block(layer=f"{base}.layers.{i}", kind="llama_decoder", stage=stage_of(f"{base}.layers.{i}.x"))
            for i in layers
        ],
        # The sequential schedule moves the activation to stage 1 after stage 0's last block.
        hooks=[
            *flat.hooks,
            StageHandoff(layer=f"{base}.layers.{layers[len(layers) // 2 - 1]}", when="post", to_stage=1),
        ],
    )
    load_plan(plan)  # consistent
    assert_exported_layout_matches(plan, workload.build(0))


# -- 4 ranks: the exported config and apply_plan agree ---------------------------------------------------


@pytest.mark.multiprocess
def test_exported_config_matches_apply_plan_on_4_ranks(tmp_path, planned_docstring):
    from harness.launcher import launch_ranks

    plan = load_plan(planned_docstring)
    assert plan.params["weight"].placements == ["R", "S(1)"]  # the model's own LM head, split too
    plan_path = str(planned_docstring)
    config = tmp_path / "parallel_config.py"
    config.write_text(export_parallelize(plan))
    out = tmp_path / "out"
    out.mkdir()
    job = launch_ranks(4, [__file__, plan_path, str(config), str(out)], tmp_path, timeout_s=240)
    job.raise_for_failure()
    for rank in range(4):
        layouts = json.loads((out / f"rank{rank}.json").read_text())
        assert layouts["apply_plan"].keys() == layouts["parallelize"].keys()
        different = {
            fqn: (layouts["apply_plan"][fqn], layouts["parallelize"][fqn])
            for fqn in layouts["apply_plan"]
            if layouts["apply_plan"][fqn] != layouts["parallelize"][fqn]
        }
        assert not different, f"rank {rank}: apply_plan vs exported config: {different}"


def rank_main(plan_path: str, config_path: str, out_dir: str) -> None:
    """On every rank: lay the same model out with apply_plan and with the exported config, and
    write both layouts (placements, mesh, local shard shape) per parameter."""
    from harness.workloads import WORKLOADS

    from autodist import apply_plan

    plan = load_plan(plan_path)
    workload = WORKLOADS["docstring_llama"]

    def layouts(model) -> dict:
        return {
            fqn: [*actual_layout(p), list(p._local_value().shape if p.is_dist() else p.shape)]
            for fqn, p in model.named_parameters()
        }

    applied, _, _ = apply_plan(workload.build(0), None, None, plan)
    exported = parallelize_with(runpy.run_path(config_path), workload.build(0))
    rank = int(os.environ.get("PADDLE_TRAINER_ID", 0))
    result = {"apply_plan": layouts(applied), "parallelize": layouts(exported)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


# -- a default plan (local views, a local lookup) exported trains like one device ----------------------------


def test_apply_local_views_refuses_another_model_in_one_error_and_changes_nothing():
    """GPT-2's plan on the docstring Llama: one PlanError naming the missing layers, and not one
    parameter of the model distributed or forward replaced."""
    from harness.planning import gloo_mp2_request
    from harness.workloads import WORKLOADS

    import autodist
    from autodist.planner.driver import plan_target
    from autodist.schemas import PlanError

    target = WORKLOADS["zoo_gpt2_hf"].planner_target
    plan = plan_target(target, None, gloo_mp2_request(1), {"target": target}).plan
    model = WORKLOADS["docstring_llama"].build(0)
    with pytest.raises(PlanError, match="local_view: the model has no layer transformer.h.0.attn"):
        autodist.apply_local_views(model, plan)
    assert not any(p.is_dist() for p in model.parameters())
    assert not any("forward" in vars(layer) for _, layer in model.named_sublayers())


TRAIN_STEPS = 3


def _trained_exported(workload_name: str, config_path: str, out_dir: str) -> None:
    """On every rank: ``workload_name``'s model laid out by the exported module, trained by a plain
    loop (the optimizer made over the parallelized model, each batch placed on the mesh split
    over dp); write the losses and each parameter's local shape."""
    import paddle
    import paddle.distributed as dist
    from harness.workloads import WORKLOADS, make_loader, train

    module = runpy.run_path(config_path)
    workload = WORKLOADS[workload_name]
    model, _ = module["parallelize"](workload.build(0), None)
    optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    mesh = module["MESH"]
    batch = [dist.Shard(0) if name == "dp" else dist.Replicate() for name in mesh.dim_names]
    loader = [
        (dist.shard_tensor(inputs, mesh, batch), dist.shard_tensor(labels, mesh, batch))
        for inputs, labels in make_loader(workload, steps=TRAIN_STEPS, seed=0)
    ]
    losses = train(workload, model, optimizer, None, loader, TRAIN_STEPS)
    local = {fqn: list(p._local_value().shape if p.is_dist() else p.shape) for fqn, p in model.named_parameters()}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps({"losses": losses, "local": local}))


def _config_part(module_text: str) -> str:
    """An exported module from ``MESH =`` on, its ``#:`` comments left out: the config itself."""
    body = module_text[module_text.index("MESH = ") :]
    return "\n".join(line for line in body.splitlines() if not line.startswith("#:"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("dp,paddle_only", [(1, False), (2, False), (1, True)])
def test_an_exported_local_view_plan_trains_like_one_device(tmp_path, dp, paddle_only):
    """HF GPT-2's default plan at dp x mp2: both attentions run on local tensors and the token
    lookup in the vocabulary-split table too; exported, it trains to one device's losses (1e-5).
    Without ``apply_local_views`` the exported config would refuse the plan (it used to).

    ``--paddle-only``: the module needs no autodist; its config is the one the planner's own
    ``--no-local-view`` plan exports (the fused outputs gathered, the table looked up in the global
    view), a comment names what each sub-layer loses, and it trains to one device's losses too."""
    import paddle
    from harness.launcher import launch_ranks
    from harness.planning import gloo_mp2_request
    from harness.workloads import WORKLOADS, make_loader, train

    from autodist.planner.driver import plan_target

    workload = WORKLOADS["zoo_gpt2_hf"]
    target = workload.planner_target
    plan = plan_target(target, None, gloo_mp2_request(dp), {"target": target}).plan
    assert [v.layer for v in plan.local_view] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert [lookup.layer for lookup in plan.vocab_lookup] == ["transformer.wte"]
    plan_path = tmp_path / "plan.json"
    save_plan(plan, plan_path)
    config = tmp_path / "parallel_config.py"  # the command as docs/workflow.md prints it
    flags = ["--paddle-only"] if paddle_only else []
    result = CliRunner().invoke(export, [str(plan_path), "--to", "paddle-parallelize", *flags, "-o", str(config)])
    assert result.exit_code == 0, result.output
    if paddle_only:
        text = config.read_text()
        assert "import autodist" not in text and "apply_local_views" not in text, text
        for layer in ("transformer.h.0.attn", "transformer.h.1.attn", "transformer.wte"):
            assert f"#: - {layer}: " in text, text
        gathered = plan_target(target, None, gloo_mp2_request(dp), {"target": target}, local_view=False).plan
        assert not gathered.local_view and not gathered.vocab_lookup
        assert _config_part(text) == _config_part(export_parallelize(gathered)), text
        # what the comments add up to is what the cost model prices between the two plans
        said = sum(int(n) for n in re.findall(r"\(\+(\d+) bytes received per rank per step", text))
        assert said == gathered.estimate.comm_bytes.mp - plan.estimate.comm_bytes.mp > 0, text
    else:
        assert "autodist.apply_local_views(model, PLAN_FILE)" in config.read_text()
        assert f"PLAN_FILE = {str(plan_path)!r}" in config.read_text()  # the path as given, read at run time
    out = tmp_path / "out"
    out.mkdir()
    job = launch_ranks(2 * dp, [__file__, "train", workload.name, str(config), str(out)], tmp_path, timeout_s=300)
    job.raise_for_failure()

    model = workload.build(0)
    optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    reference = train(workload, model, optimizer, None, make_loader(workload, steps=TRAIN_STEPS, seed=0), TRAIN_STEPS)
    for rank in range(2 * dp):
        result = json.loads((out / f"rank{rank}.json").read_text())
        losses = result["losses"]
        assert len(losses) == TRAIN_STEPS, (rank, losses)
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (rank, losses, reference)
        # what ran is the plan: the fused q|k|v, its output row and the table each rank's half
        for fqn in (
            "transformer.h.0.attn.c_attn.weight",
            "transformer.h.0.attn.c_proj.weight",
            "transformer.wte.weight",
        ):
            whole = plan.params[fqn].shape
            split = plan.params[fqn].placements[plan.mesh.axes.index("mp")]
            dim = int(split[2])
            assert result["local"][fqn] == [n // 2 if d == dim else n for d, n in enumerate(whole)], (rank, fqn)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1] == "train":
        _trained_exported(*sys.argv[2:5])
    else:
        rank_main(*sys.argv[1:4])
