"""Our dp2 x mp2 plan for the docstring model against what ``paddle.distributed.to_distributed``
itself assigns, run for real in a subprocess posing as rank 0 of a 4-rank world (its
conversion only shards tensors locally, so no collective is needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autodist.planner.driver import plan_target
from autodist.planner.cost.search import SearchRequest

ROOT = Path(__file__).resolve().parents[1]
DOCSTRING = ROOT / "plans" / "llama_docstring"
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_layers=2, seq_length=16)

TO_DISTRIBUTED = """
import json, sys
import numpy as np
import paddle
from paddle.distributed import to_distributed
from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig
sys.path.insert(0, {folder!r})
import model as m

config = m.LlamaConfig(**{sizes!r})
net = m.build_model(config)

class Tokens(paddle.io.Dataset):
    def __getitem__(self, i):
        return np.zeros([config.seq_length], "int64"), np.zeros([config.seq_length], "int64")
    def __len__(self):
        return 8

dist_config = ToDistributedConfig()
dist_config.input_spec = m.input_spec(config)
opt = paddle.optimizer.SGD(0.1, parameters=net.parameters())
net, _, _ = to_distributed(net, opt, paddle.io.DataLoader(Tokens(), batch_size=4), device_num=4, node_num=1,
                           config=dist_config)

def short(p):
    name = type(p).__name__
    return "R" if name == "Replicate" else "P" if name == "Partial" else f"S({{p.get_dim()}})"

print(json.dumps({{
    fqn: {{"mesh": list(p.process_mesh.dim_names), "placements": [short(x) for x in p.placements]}} if p.is_dist() else None
    for fqn, p in net.named_parameters()
}}))
"""


def to_distributed_placements() -> dict:
    rank0_of_4 = {
        "PADDLE_TRAINER_ID": "0",
        "PADDLE_TRAINERS_NUM": "4",
        "PADDLE_RANK_IN_NODE": "0",
        "PADDLE_LOCAL_SIZE": "4",
        "PADDLE_GLOBAL_SIZE": "4",
        "PADDLE_LOCAL_RANK": "0",
        "PADDLE_GLOBAL_RANK": "0",
    }
    script = TO_DISTRIBUTED.format(folder=str(DOCSTRING), sizes=SIZES)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **rank0_of_4},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dp2_mp2_weights_match_to_distributed(monkeypatch):
    for field, value in SIZES.items():
        monkeypatch.setenv(f"LLAMA_DOCSTRING_{field.upper()}", str(value))
    plan = plan_target(str(DOCSTRING / "model.py"), None, SearchRequest(devices_per_node=4, dp=2, mp=2, pp=1), {}).plan
    reference = to_distributed_placements()
    assert set(reference) == set(plan.params)
    sharded = {fqn: ref for fqn, ref in reference.items() if ref is not None}
    # to_distributed splits exactly the 7 projections of each block ...
    assert len(sharded) == 7 * SIZES["num_layers"]
    for fqn, ref in sharded.items():
        assert ref["mesh"] == plan.mesh.axes == ["dp", "mp"]
        assert plan.params[fqn].placements == ref["placements"], fqn
    assert {tuple(ref["placements"]) for ref in sharded.values()} == {("R", "S(1)"), ("R", "S(0)")}
    # ... and leaves the rest dense (replicated). We agree on the norms; the embedding and the LM
    # head we split over the vocabulary on purpose (to_distributed keeps them whole on every rank).
    for fqn in set(reference) - set(sharded):
        expected = ["R", "S(0)"] if fqn == "embed_tokens.weight" else ["R", "S(1)"] if fqn == "weight" else ["R", "R"]
        assert plan.params[fqn].placements == expected, fqn
