"""A LoRA policy end to end in ``srpo train`` (tiny Qwen3, real Qwen vocabulary, CPU engine), both syncs.

``lora.sync: merged`` sends ``W + (alpha/r) B A`` as plain HF weights (``weights.export``); ``adapter`` sends
only the PEFT-named adapters into the engine's peft-wrapped model (``weights.lora_engine_sync``). Either way,
after each sync the engine's sampled-token log-probs must equal the trainer's scoring pass on the same
tokens: ``logprob/gap_max`` < 1e-4 and the top-K KL < 1e-6, the bound of the full-weight fp32 parity test
(tests/integration/test_train_parity.py; not 0: the HF engine and megatron's local kernels sum in different
orders). The lr is high enough that the adapters' B moves off zero in step 1 (checked: the synced B's norm),
so steps 2 and 3 sync a real delta. Adapter mode moves exactly the adapters' bytes per sync (counted on the
engine: every tensor it receives). A planted bug (the engine's adapter scaling 1 instead of alpha/r; the
merged delta without its scaling) must break the parity bound.

The adapter sync into SGLang runs against the named stand-in server (``testing/sglang_standin.py``, in this
process; the trainer reaches it over HTTP as a colocated ``mode: http`` engine): each sync loads
``srpo-policy-v<v>`` from tensors and unloads the previous one, every ``/generate`` names the adapter
loaded last, and the same parity bound holds (``tests/unit/test_sglang_lora_standin.py`` plants a missing
``lora_path``, a missing unload and a reused name).
"""

from __future__ import annotations

import json

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.healthy import assert_healthy_runs
from tests.helpers.train import read_metrics, train_overrides

RANK, ALPHA = 4, 8.0
LORA = {"lora.rank": RANK, "lora.alpha": ALPHA, "train.steps": 3, "optim.lr": 1e-2, "rollout.parity_top_k": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_lora"), num_prompts=4)


def _train_rank(rank, world, overrides, log, plant):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.models import lora as lora_model
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train
    from tests.helpers.recipe import RECIPE

    update_lora, update_weights = HFEngine.update_lora, HFEngine.update_weights

    def record(kind, named, version):
        named = list(named)
        b = [t for n, t in named if "lora_B" in n]
        row = {
            "kind": kind,
            "version": version,
            "bytes": sum(t.numel() * t.element_size() for _, t in named),
            "tensors": len(named),
            "b_norm": float(sum(t.double().norm() ** 2 for t in b) ** 0.5) if b else None,
        }
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")
        return named

    def lora(self, named, version, config):
        if plant == "scaling":
            config = {**config, "lora_alpha": config["r"]}  # PEFT scaling 1 instead of alpha/r
        update_lora(self, record("adapter", named, version), version, config)

    def full(self, named, version):
        update_weights(self, record("full", named, version), version)

    HFEngine.update_lora, HFEngine.update_weights = lora, full
    if plant == "no_lora_path":  # SGLang serves the base model alone
        from srpo_megatron.rollout.sglang.engine import SGLangEngine

        SGLangEngine._with_adapter = lambda self, body: body
    if plant == "scaling":
        delta = lora_model.lora_weight_delta
        lora_model.lora_weight_delta = lambda m: delta(m) / m._lora_plan.scaling  # merged without alpha/r
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name, plant=None, **extra):
    root, hf, data = tiny
    run_dir = root / name
    log = root / f"{name}.sync.jsonl"
    run_distributed(
        _train_rank, 1, train_overrides((root, hf, data), run_dir, **extra), str(log), plant, timeout=900
    )
    syncs = log.read_text().splitlines() if log.exists() else []  # the CPU engine's syncs only
    return read_metrics(run_dir), [json.loads(x) for x in syncs]


def _adapter_bytes(tiny) -> int:
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.conversion.lora_table import LoraTable
    from srpo_megatron.models.architecture import Architecture

    cfg = json.loads((tiny[1] / "config.json").read_text())
    table = LoraTable(Architecture.from_hf(cfg), LoraConfig(rank=RANK, alpha=ALPHA))
    return 4 * table.numel()  # fp32 engine


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_sync_engine_logp_equal_trainer(tiny, sync):
    rows, syncs = _run(tiny, f"lora_{sync}", **{**LORA, "lora.sync": sync})
    assert len(rows) == 3
    print(f"cpu engine, lora.sync={sync}, logprob/gap_max per step:", [r["logprob/gap_max"] for r in rows])
    for r in rows:
        assert r["logprob/gap_max"] < 1e-4, (sync, r["step"], r["logprob/gap_max"])
        assert 0.0 <= r["logprob/topk_kl_max"] < 1e-6, (sync, r["step"])
    assert_healthy_runs(tiny[0] / f"lora_{sync}")
    assert [s["kind"] for s in syncs] == [{"merged": "full", "adapter": "adapter"}[sync]] * len(syncs)
    assert len(syncs) >= 3 and [s["version"] for s in syncs] == sorted({s["version"] for s in syncs})
    if sync == "adapter":
        assert all(s["bytes"] == _adapter_bytes(tiny) for s in syncs), (syncs, _adapter_bytes(tiny))
        assert syncs[0]["b_norm"] == 0.0 and syncs[-1]["b_norm"] > 1e-3, "B must move for the test to bite"


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_sync_without_scaling_breaks_parity(tiny, sync):
    rows, _ = _run(tiny, f"plant_{sync}", plant="scaling", **{**LORA, "lora.sync": sync, "train.steps": 2})
    assert rows[0]["logprob/gap_max"] < 1e-4  # step 1 syncs B = 0: no delta, no gap yet
    assert rows[-1]["logprob/gap_max"] > 1e-4, rows[-1]["logprob/gap_max"]


def _run_sglang(tiny, name, plant=None, **extra):
    """``_run`` with a colocated SGLang engine: the stand-in server, in this process, over HTTP."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    sglang = f"{{model_path: {tiny[1]}, mode: http, url: {server.url}}}"
    try:
        rows, _ = _run(
            tiny, name, plant, **{**LORA, "rollout.engine": "sglang", "rollout.sglang": sglang, **extra}
        )
    finally:
        server.close()
    return rows, server


def test_lora_adapter_sync_into_sglang_standin_engine_logp_equal_trainer(tiny):
    rows, server = _run_sglang(tiny, "lora_sglang")
    assert len(rows) == 3
    for r in rows:
        assert r["logprob/gap_max"] < 1e-4, (r["step"], r["logprob/gap_max"])
        assert 0.0 <= r["logprob/topk_kl_max"] < 1e-6, r["step"]
    print("sglang stand-in, logprob/gap_max per step:", [r["logprob/gap_max"] for r in rows])
    assert_healthy_runs(tiny[0] / "lora_sglang")
    assert server.rejected == []
    loaded: list[str] = []
    for route, body in server.bodies:
        if route == "/load_lora_adapter_from_tensors":
            loaded.append(body["lora_name"])
        elif route == "/unload_lora_adapter":
            assert body["lora_name"] == loaded[-2], (loaded, body)
        elif route == "/generate":
            assert body.get("lora_path") == loaded[-1], "every generate names the adapter loaded last"
    assert len(loaded) >= 3 and len(set(loaded)) == len(loaded) and set(server.loras) == {loaded[-1]}
    releases = [tags for kind, tags in server.memory_log if kind == "release"]
    assert releases and all("weights" not in tags for tags in releases), "no sync sends the base again"
    b = [t for n, t in server.loras[loaded[-1]].items() if "lora_B" in n]
    assert sum(t.double().norm() ** 2 for t in b) ** 0.5 > 1e-3, "B must move for the test to bite"


def test_sglang_generate_without_lora_path_breaks_parity(tiny):
    rows, _ = _run_sglang(tiny, "plant_sglang", plant="no_lora_path", **{"train.steps": 2})
    assert rows[0]["logprob/gap_max"] < 1e-4  # step 1 syncs B = 0: base and adapter agree
    assert rows[-1]["logprob/gap_max"] > 1e-4, rows[-1]["logprob/gap_max"]
