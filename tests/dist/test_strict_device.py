"""Strict-device mode (srpo_megatron/testing/strict_device.py): the scoring pass, the training pass, the
EMA update and the weight sync keep every tensor that reaches the model or a collective on the runtime's
device, at TP2×PP2, at DP2 (distributed optimizer, bf16) and with an MoE policy at EP2 (megatron's alltoall
token dispatcher, the expert-parallel gradient reduction, the gather of the experts for the weight sync),
and the mode catches a planted host tensor and the host-tensor collectives the trainer used to issue."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import tiny_config

pytestmark = pytest.mark.strict_device



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_strict"), num_prompts=8)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_strict_moe"), num_prompts=8, moe=True)


def _samples(n: int = 8):
    """Routed samples: odd members succeed (GRPO), even members take SDPO with a teacher context; the
    second half are two-turn (their middle token a tool turn's, ``response_mask`` 0)."""
    from srpo_megatron.trainer.step_types import Sample

    out = []
    for m in range(n):
        sdpo = m % 2 == 0
        teacher = [1, 7, 8, 9, 3] if sdpo else None
        out.append(
            Sample(
                m // 4,
                m % 4,
                [1, 2, 3],
                [4 + m, 5, 6],
                [-1.0] * 3,
                advantage=0.5 if sdpo else -0.5,
                grpo=not sdpo,
                sdpo=sdpo,
                needs_teacher=sdpo,
                teacher_prompt_ids=teacher,
                response_mask=[1, 0, 1] if m >= n // 2 else None,
            )
        )
    return out


class _Engine:
    """Rank 0's in-process engine stand-in: consumes the stream and records what it got."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.weight_version = 0

    def update_weights(self, stream, version: int) -> None:
        for name, t in stream:
            self.names.append(name)
            _ = t.double().sum().item()  # the engine reads the tensor (a cross-device copy on a GPU)
        self.weight_version = version


def _step(rank, world, tiny, run_dir, tp, pp, extra, ep=1):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.strict_device import strict_device
    from srpo_megatron.trainer.microbatches.batches import rank_share
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.observe.stats import reduce_stats
    from srpo_megatron.trainer.observe.step_metrics import gather_stats
    from srpo_megatron.trainer.state.teacher import fp32_main_params
    from srpo_megatron.testing.sync_transports import sync_in_process

    with strict_device():
        cfg = tiny_config(tiny, run_dir, [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", *extra])
        groups = initialize_model_parallel(tp, pp, seed=1, ep=ep)
        assert groups.device.type == "cuda"  # emulated: mapped to the host, provenance-checked
        policy = Policy(cfg, groups)
        scored = scoring_pass(policy, rank_share(_samples(), 1, groups.dp_size, groups.dp_rank))
        before = [p.detach().double().clone() for p in policy.teacher.module.parameters()]
        stats = gather_stats(reduce_stats([scored.stats, learn(policy, scored, 1)]), groups.host)
        mains = fp32_main_params(policy.optimizer, policy.model, groups.device)
        model = [p.detach().float() for p in policy.model.parameters()]
        # The teacher's source: fp32 values (not the bf16 weights), within a bf16 rounding of them.
        main_gap = max(((m - p).abs() / p.abs().clamp_min(1e-3)).max().item() for m, p in zip(mains, model))
        fp32_values = any(bool((m != p).any()) for m, p in zip(mains, model, strict=True))
        policy.update_teacher()
        moved = any(
            not torch.equal(b, p.detach().double())
            for b, p in zip(before, policy.teacher.module.parameters(), strict=True)
        )
        engine = _Engine() if rank == 0 else None
        sync_in_process(policy.model, policy.table, groups, engine, version=2)
    return {
        "loss": stats.loss,
        "teacher_runs": stats.teacher_runs,
        "teacher_moved": moved,
        "main_gap": main_gap,
        "fp32_values": fp32_values,
        "synced": None if engine is None else (engine.weight_version, len(engine.names)),
        "synced_names": None if engine is None else sorted(engine.names),
    }


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "world", "extra"),
    [
        (2, 2, 1, 4, []),
        (1, 1, 1, 2, ["parallel.distributed_optimizer=true", "model.params_dtype=bf16"]),
        (2, 1, 1, 2, ["performance.fused_output=off"]),  # every other case: the fused output layer
        pytest.param(
            1, 1, 2, 2, ["model.params_dtype=bf16"], marks=pytest.mark.moe, id="moe-ep2-alltoall-bf16"
        ),
    ],
    ids=["tp2pp2", "dp2-distopt-bf16", "tp2-materialised-logits", "moe-ep2-alltoall-bf16"],
)
def test_a_training_step_keeps_tensors_on_the_device(request, tmp_path, tp, pp, ep, world, extra):
    tiny = request.getfixturevalue("tiny_moe" if ep > 1 else "tiny")
    out = run_distributed(_step, world, tiny, str(tmp_path), tp, pp, extra, ep, timeout=600)
    assert all(r["teacher_moved"] for r in out), "the EMA teacher must have been updated"
    assert out[0]["synced"][0] == 2 and out[0]["synced"][1] > 0
    assert out[0]["loss"] != 0.0 and out[0]["teacher_runs"] == 4
    for r in out:  # the EMA's source is the optimizer's fp32 main copy (gathered over DP when sharded)
        assert r["main_gap"] <= 2**-8, r["main_gap"]
        assert r["fp32_values"] == ("model.params_dtype=bf16" in extra)


def test_a_training_step_at_uneven_pipeline_stages(tmp_path):
    """A 3-layer policy at PP2 (stages of 1 and 2 layers, the split the 235B anchors' PP4/PP8 need): the
    step runs in strict-device mode and the weight sync sends every HF tensor once, each layer under its
    global index (the second stage's layers are 1 and 2)."""
    from srpo_megatron.testing.tiny import write_tiny_qwen3, write_tiny_run

    root, _, data = write_tiny_run(tmp_path / "run", num_prompts=8)
    hf = write_tiny_qwen3(tmp_path / "qwen3_3_layers", num_layers=3)
    out = run_distributed(_step, 2, (root, hf, data), str(tmp_path / "r"), 1, 2, [], timeout=600)
    from safetensors import safe_open

    assert not (hf / "model.safetensors.index.json").exists()  # one file holds every tensor
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        want = sorted(f.keys())
    names = out[0]["synced_names"]
    assert names == want, sorted(set(names) ^ set(want))
    assert out[0]["loss"] != 0.0 and all(r["teacher_moved"] for r in out)


def _planted(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.strict_device import StrictDeviceError, strict_device
    from srpo_megatron.trainer.passes import scoring
    from srpo_megatron.trainer.state.policy import Policy

    real = scoring.micro_batches_for

    def planted(*args, **kwargs):
        micro = real(*args, **kwargs)
        micro[-1].tokens = micro[-1].tokens.to("cpu")  # ONE host tensor among device tensors
        return micro

    with strict_device():
        policy = Policy(tiny_config(tiny, run_dir), initialize_model_parallel(1, 1, seed=1))
        samples = _samples()
        scoring.scoring_pass(policy, samples)  # the unplanted pass runs
        scoring.micro_batches_for = planted
        try:
            scoring.scoring_pass(policy, samples)
        except StrictDeviceError as e:
            return str(e)
        finally:
            scoring.micro_batches_for = real
    return None


def test_a_planted_host_tensor_is_caught(tiny, tmp_path):
    caught = run_distributed(_planted, 1, tiny, str(tmp_path))[0]
    assert caught is not None, "strict mode let a host tensor reach the model"
    assert "model input" in caught


def _old_paths(rank, world, tiny, run_dir):
    """The trainer's former host-tensor collectives, replayed under strict mode at DP2."""
    import torch.distributed as dist

    from srpo_megatron.losses import global_normalizers
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.strict_device import StrictDeviceError, strict_device
    from srpo_megatron.trainer.microbatches.batches import sample_tokens

    caught = {}
    with strict_device():
        groups = initialize_model_parallel(1, 1, seed=1)
        host_batch = sample_tokens(_samples(4), 8, torch.device("cpu"))  # the old host-built TokenBatch
        device_batch = sample_tokens(_samples(4), 8, groups.device)
        global_normalizers([device_batch], 1.0, groups.dp)  # today's path passes
        old = {
            "global_normalizers": lambda: global_normalizers([host_batch], 1.0, groups.dp),
            "_all_true": lambda: dist.all_reduce(torch.tensor([0.0]), op=dist.ReduceOp.MAX),
            "_stage_senders": lambda: dist.all_gather(
                [torch.zeros(1, dtype=torch.int64) for _ in range(world)], torch.tensor([0])
            ),
            "device tensor on the host group": lambda: dist.all_reduce(
                torch.zeros(1, device=groups.device), group=groups.host
            ),
        }
        for name, call in old.items():
            try:
                call()
                caught[name] = None
            except StrictDeviceError as e:
                caught[name] = str(e)
    return caught


def test_the_old_host_collectives_are_caught(tiny, tmp_path):
    for caught in run_distributed(_old_paths, 2, tiny, str(tmp_path)):
        missed = [name for name, msg in caught.items() if msg is None]
        assert not missed, f"strict mode missed {missed}"
