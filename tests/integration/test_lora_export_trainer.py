"""A real LoRA training checkpoint, exported with ``tools/convert_megatron_to_hf.py --lora-adapter-out``,
loads with ``peft.PeftModel.from_pretrained`` onto the HF base and gives the trainer's logits (fp32, <= 1e-5);
the merged export (``--out-dir``, same call) loads with transformers alone and gives them too.

``srpo train`` runs 2 SRPO steps of the tiny LoRA recipe (lr high enough that every B moves off zero, so the
adapters change the logits) and saves its checkpoint; the trainer's own policy (``trainer/state/policy.py``)
is then rebuilt (new megatron groups, same layout) and loaded from that checkpoint the way a resume loads it
(``trainer/run/checkpoint.load_checkpoint``), and its forward on fixed token ids is the reference. The tool
runs as a subprocess, as users run it. Two models: a tiny dense Qwen3 (every attention and MLP projection; at
TP1 and at TP2, world 2), and a tiny Qwen3-MoE with ``lora.experts: true`` at EP1 and at EP2 (world 2;
attention plus every routed expert's gate/up/down, which the trainer's checkpoint stores stacked per layer and
expert and the PEFT folder holds as peft's ``target_parameters`` on transformers' fused experts). The base
model alone must be > 1e-3 away from the trainer's logits, so the comparison measures the adapters.

``test_planted_export_bugs_break_the_logits`` runs the same tool in process with one exporter bug planted at
a time (alpha/r scaling dropped, the fused QKV's k and v adapters exchanged, an expert's gate and up adapters
exchanged, the experts' B laid out expert-major instead of peft's expert-minor) and shows each moves peft's
logits off the trainer's by far more than the bound. Without reading the trainer's stacked expert keys the
MoE export failed ("no adapter tensor ...local_experts.0...").
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.healthy import assert_healthy_runs
from tests.helpers.train import read_metrics, train_overrides

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_megatron_to_hf.py"
peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(1800)]

RANK, ALPHA, STEPS = 4, 8.0, 2
LORA = {"lora.rank": RANK, "lora.alpha": ALPHA, "train.steps": STEPS, "optim.lr": 1e-2, "run.save_every": 0}
MOE = {"lora.experts": "true", "lora.sync": "merged", "moe.grouped_gemm": "false"}
# (tiny model, world size, recipe overrides): the MoE run at EP2 saves each rank's experts as its shards
MODELS = {
    "dense": ("dense", 1, {}),
    "dense_tp2": ("dense", 2, {"parallel.tp": 2}),
    "moe": ("moe", 1, MOE),
    "moe_ep2": ("moe", 2, {**MOE, "parallel.ep": 2}),
}


def _train_then_score(rank, world, overrides, ids):
    """``srpo train`` for the run, then the trainer's policy rebuilt and loaded from the saved checkpoint:
    its logits on ``ids`` (the vocabulary's real rows) and the checkpoint it read."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel
    from srpo_megatron.train import train
    from srpo_megatron.trainer.run.checkpoint import latest_checkpoint, load_checkpoint
    from srpo_megatron.trainer.state.policy import Policy
    from tests.helpers.recipe import RECIPE

    cfg = load_config(TrainConfig, str(RECIPE), overrides)
    train(cfg)
    ckpt = latest_checkpoint(cfg.run.dir)
    p = cfg.parallel
    groups = initialize_model_parallel(p.tp, p.pp, seed=cfg.run.seed, ep=p.ep, etp=p.etp, cp=p.cp)
    policy = Policy(cfg, groups)
    load_checkpoint(policy, ckpt, log=lambda _: None)
    model = policy.model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        if groups.tp_size > 1:  # the vocabulary-parallel logits, gathered
            logits = gather_from_tensor_model_parallel_region(logits)
    destroy_model_parallel()
    return {"logits": logits[..., : policy.arch.vocab_size].detach().clone(), "ckpt": str(ckpt)}


@pytest.fixture(
    scope="module",
    params=["dense", "dense_tp2", *(pytest.param(k, marks=pytest.mark.moe) for k in ("moe", "moe_ep2"))],
)
def trained(request, tmp_path_factory):
    """(kind, root, hf_dir, checkpoint, ids, the trainer's logits on ids) of a 2-step LoRA run."""
    from srpo_megatron.testing.tiny import write_tiny_run

    kind = request.param
    model, world, extra = MODELS[kind]
    tiny = write_tiny_run(tmp_path_factory.mktemp(f"lora_export_{kind}"), num_prompts=8, moe=model == "moe")
    root, hf, _ = tiny
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    run_dir = root / "run"
    overrides = train_overrides(tiny, run_dir, **LORA, **extra)
    out = run_distributed(_train_then_score, world, overrides, ids, timeout=1500)[0]
    assert len(read_metrics(run_dir)) == STEPS
    assert_healthy_runs(run_dir)
    return kind, root, hf, Path(out["ckpt"]), ids, out["logits"]


def _peft_logits(hf: Path, adapter: Path | None, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(ids).logits


def test_tool_export_loads_in_peft_with_the_trainers_logits(trained, tmp_path):
    from safetensors.torch import load_file

    kind, _, hf, ckpt, ids, want = trained
    out = subprocess.run(
        [sys.executable, str(TOOL), "--megatron-dir", str(ckpt), "--lora-adapter-out", str(tmp_path / "a"),
         "--out-dir", str(tmp_path / "merged")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = {n: t for n, t in tensors.items() if "lora_B" in n}
    assert b and all(t.abs().max() > 0 for t in b.values()), "every B must have moved off zero"
    if kind.startswith("moe"):  # the experts' adapters are in the folder (peft's target_parameters wrappers)
        config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert any(".mlp.experts.base_layer.lora_B" in n for n in b) and any(
            ".mlp.experts.lora_B" in n for n in b
        )
    got = _peft_logits(hf, tmp_path / "a", ids)
    base = _peft_logits(hf, None, ids)
    assert (base - want).abs().max() > 1e-3, "the adapters must change the logits for the test to bite"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    merged = _peft_logits(tmp_path / "merged", None, ids)
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------- planted bugs
def _tool_main():
    spec = importlib.util.spec_from_file_location("convert_megatron_to_hf", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _plant(monkeypatch, bug: str) -> None:
    from srpo_megatron.conversion import lora_export, lora_table

    if bug == "no_scaling":  # PEFT's scaling alpha/r written as 1
        config = lora_export.peft_adapter_config
        monkeypatch.setattr(
            lora_export, "peft_adapter_config", lambda lo, *a: {**config(lo, *a), "lora_alpha": lo.rank}
        )
    elif bug == "k_v_swapped":  # the fused QKV's k and v adapters exchanged (same shapes under GQA)
        to_peft = lora_table.LoraTable.to_peft

        def swapped(self, name, full):
            peft_name, t = to_peft(self, name, full)
            other = (
                peft_name.replace(".k_proj.", ".@.")
                .replace(".v_proj.", ".k_proj.")
                .replace(".@.", ".v_proj.")
            )
            return other, t

        monkeypatch.setattr(lora_table.LoraTable, "to_peft", swapped)
    elif bug == "gate_up_swapped":  # an expert's gate and up adapters exchanged
        pack = lora_export.pack_experts

        def exchanged(table, adapters):
            swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
            key = lambda n: re.sub(r"\.lora\.(gate_proj|up_proj)\.", lambda m: f".lora.{swap[m[1]]}.", n)  # noqa: E731
            return pack(table, {key(n): t for n, t in adapters.items()})

        monkeypatch.setattr(lora_export, "pack_experts", exchanged)
    elif bug == "b_expert_major":  # the experts' B laid out [out, E*r] (expert-major), not peft's [out, r*E]
        pack = lora_export.pack_experts

        def transposed(table, adapters):
            out = pack(table, adapters)
            e = table.arch.num_experts
            for n, b in out.items():
                if ".mlp.experts." in n and "lora_B" in n:
                    out[n] = b.reshape(b.shape[0], -1, e).transpose(1, 2).reshape(b.shape[0], -1).contiguous()
            return out

        monkeypatch.setattr(lora_export, "pack_experts", transposed)


@pytest.mark.parametrize("bug", ["no_scaling", "k_v_swapped", "gate_up_swapped", "b_expert_major"])
def test_planted_export_bugs_break_the_logits(trained, tmp_path, monkeypatch, bug):
    kind, _, hf, ckpt, ids, want = trained
    if kind.startswith("dense") and bug in ("gate_up_swapped", "b_expert_major"):
        pytest.skip("an expert bug: the dense model has no experts")
    if kind in ("dense_tp2", "moe_ep2"):
        pytest.skip(
            "the exporter's bugs are shown on the TP1/EP1 checkpoints; the layout changes only storage"
        )
    _plant(monkeypatch, bug)
    assert _tool_main()(["--megatron-dir", str(ckpt), "--lora-adapter-out", str(tmp_path / "a")]) == 0
    got = _peft_logits(hf, tmp_path / "a", ids)
    assert (got - want).abs().max() > 1e-4, f"planted {bug} went unnoticed"
