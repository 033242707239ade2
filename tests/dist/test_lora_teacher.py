"""The LoRA policy's self-teacher is the frozen base plus an fp32 EMA of the adapters, with no model of its
own: after 3 SRPO steps (megatron's distributed optimizer, the trainer's scoring and learning passes) its
logits equal transformers + ``peft`` with the base weights and a float64-reference EMA of the adapters
(fp32, <= 1e-5), its memory is exactly the adapters' fp32 size, and the student's adapters come back bit for
bit after the teacher's forward; a LoRA checkpoint (adapters, their EMA, Adam state) resumes exactly.
"""

from __future__ import annotations

import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.lora import ALPHA, RANK, load_peft_adapters, peft_model
from tests.helpers.trainer import TINY_POLICY_VOCAB, tiny, tiny_policy, tiny_step  # noqa: F401  (fixture)

EMA = 0.3  # teacher.ema_alpha in tests/helpers/trainer.tiny_policy
STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run(rank, world, hf_and_data, run_dir):
    from srpo_megatron.conversion.weights import stage_layer_offset
    from srpo_megatron.models.lora import global_lora_name, lora_parameters
    from srpo_megatron.trainer.state.adapter_teacher import AdapterEmaTeacher
    from srpo_megatron.trainer.state.offload import TEACHER, TEACHER_FP32

    extra = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "loss.mode=srpo"]
    policy = tiny_policy(hf_and_data, run_dir, extra)
    teacher, model = policy.teacher, policy.model
    assert isinstance(teacher, AdapterEmaTeacher) and teacher.module is model, "no second model"
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora." not in n}
    ref = [p.detach().double() for p in teacher.params]  # θ′₀ = the initial adapters (B = 0)
    for step in range(STEPS):
        tiny_step(policy, rank, step)  # scoring (teacher forward) + learning + EMA update
        # fp32 policy: the distributed optimizer's main params are the params themselves
        ref = [(1 - EMA) * r + EMA * p.detach().double() for r, p in zip(ref, teacher.params, strict=True)]
    student = [p.detach().clone() for p in teacher.params]
    ids = torch.randint(0, TINY_POLICY_VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(7).expand_as(ids)
    with torch.no_grad(), teacher.swapped_in():
        logits = model(ids, positions, None)
    offset = stage_layer_offset(model)
    names = [global_lora_name(n, offset) for n in lora_parameters(model)]
    return {
        "logits": logits[..., :TINY_POLICY_VOCAB].detach(),
        "ids": ids,
        "ref": dict(zip(names, ref, strict=True)),
        "ema_err": max((m.double() - r).abs().max().item() for m, r in zip(teacher.master, ref, strict=True)),
        "lag": max((m - s).abs().max().item() for m, s in zip(teacher.master, student, strict=True)),
        "restored": all(torch.equal(p, s) for p, s in zip(teacher.params, student, strict=True)),
        "base_moved": [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])],
        "ema_bytes": teacher.ema_bytes(),
        "adapter_numel": sum(p.numel() for p in teacher.params),
        "resident": {c: policy.offload.resident_bytes()[c] for c in (TEACHER, TEACHER_FP32)},
    }


def test_adapter_teacher_is_base_plus_float64_ema(tiny, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    (out,) = run_distributed(_run, 1, tiny, str(tmp_path / "run"), timeout=900)
    assert out["base_moved"] == [], "the frozen base changed"
    assert out["restored"], "the student's adapters were not restored after the teacher forward"
    assert out["ema_err"] <= 1e-6, f"fp32 adapter EMA vs float64 reference: {out['ema_err']}"
    assert out["lag"] > 1e-4, "the teacher must lag the student (an EMA, not a copy)"
    assert out["ema_bytes"] == 4 * out["adapter_numel"], "teacher memory = the adapters in fp32"
    assert out["resident"] == {"teacher bf16 copy": 0, "teacher fp32 copy": out["ema_bytes"]}
    hf, _ = tiny
    model = peft_model(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), TARGETS)
    load_peft_adapters(model, {n: r.float() for n, r in out["ref"].items()})
    with torch.no_grad():
        want = model(out["ids"]).logits
    diff = (out["logits"] - want).abs().max().item()
    assert diff <= 1e-5, f"teacher logits vs HF + peft(base, float64 EMA of the adapters): {diff}"


def _state(policy) -> dict[str, list[torch.Tensor]]:
    from srpo_megatron.trainer.state import offload as off

    moments = [
        torch.as_tensor(v).detach().clone().float()
        for opt in off._chained(policy.optimizer)
        for st in opt.optimizer.state.values()
        for k, v in sorted(st.items())
        if k in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "params": [p.detach().clone().float() for p in policy.model.parameters()],
        "teacher": [m.clone() for m in policy.teacher.master],
        "moments": moments,
    }


def _resume_run(rank, world, hf_and_data, run_dir, interrupt):
    from pathlib import Path

    from srpo_megatron.trainer.run.checkpoint import load_checkpoint, save_checkpoint

    extra = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "loss.mode=srpo", "model.params_dtype=bf16"]
    policy = tiny_policy(hf_and_data, run_dir, extra)
    for step in range(2):
        tiny_step(policy, rank, step)
    if interrupt:
        save_checkpoint(policy, run_dir, 2, {"weight_version": 2}, keep_last=2)
        policy = tiny_policy(hf_and_data, run_dir, extra)
        load_checkpoint(policy, Path(run_dir) / "checkpoints" / "step_000002", log=lambda _: None)
    tiny_step(policy, rank, 2)
    return _state(policy)


def test_lora_checkpoint_resumes_exactly(tiny, tmp_path):  # noqa: F811
    """DP 2, bf16 frozen base + bf16 adapters with fp32 main params: saving after 2 steps and resuming gives
    the uninterrupted run's 3rd step exactly (every parameter, the adapter EMA teacher, Adam's moments).
    Planted by hand: a checkpoint without the adapter EMA (``teacher_fp32``) restarts the teacher from the
    current adapters and the resumed teacher differs (by 0.017)."""
    straight = run_distributed(_resume_run, 2, tiny, str(tmp_path / "a"), False, timeout=900)
    resumed = run_distributed(_resume_run, 2, tiny, str(tmp_path / "b"), True, timeout=900)
    for rank, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        for key in a:
            assert len(a[key]) == len(b[key]) and a[key], f"rank {rank}: {key} count"
            worst = max((x - y).abs().max().item() for x, y in zip(a[key], b[key], strict=True))
            assert worst == 0.0, f"rank {rank}: {key} after the resumed step differs by {worst}"
