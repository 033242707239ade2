"""Both distributed-optimizer checkpoint formats resume exactly (trainer/run/optimizer_format.py): the tiny
Qwen3-MoE at DP 2 (a dense and an expert distributed optimizer, bf16 params, fp32 main params), saved
after two real trainer steps in megatron's fast ``dp_reshardable`` format (the default) and in
``fully_reshardable``, loaded into a fresh policy: what was saved is what is loaded (main params, Adam
moments and step, params) and the third step equals the uninterrupted run's bit for bit. The checkpoint
records its format and layout in dist_checkpointing's content metadata. Planted: loading the fast
checkpoint as ``fully_reshardable`` (ignoring the recorded format) fails. Repeated saves run on the
save strategy the trainer keeps per format (megatron's cached distribution and plan) and load exactly;
planted: one kept strategy for both formats fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.moe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
FORMATS = {"dp_reshardable": "false", "fully_reshardable": "true"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_moe_ckpt"), num_prompts=4, moe=True)


def _samples(dp_rank: int, step: int):
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(100 * step + dp_rank)
    out = []
    for m in range(4):
        prompt = torch.randint(10, 2000, (4,), generator=g).tolist()
        resp = torch.randint(10, 2000, (4,), generator=g).tolist()
        out.append(Sample(0, m, prompt, resp, [-2.0] * 4, advantage=1.0 if m % 2 else -1.0))
    return out


def _policy(tiny, run_dir: str, fully: str):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.state.policy import Policy

    _, hf, data = tiny
    ov = [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        f"run.checkpoint_fully_reshardable={fully}",
        "parallel.distributed_optimizer=true",
        "model.params_dtype=bf16",
        "optim.lr=0.02",
        "optim.clip_grad=0.0",
        "teacher.ema_alpha=0.3",
    ]
    return Policy(load_config(TrainConfig, str(RECIPE), ov), initialize_model_parallel(1, 1, seed=1))


def _step(policy, rank: int, step: int) -> float:
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    stats = learn(policy, scoring_pass(policy, _samples(rank, step)), 1)
    policy.update_teacher()
    return stats.loss


def _state(policy) -> dict[str, list[torch.Tensor]]:
    from srpo_megatron.trainer.state import offload as off

    out: dict[str, list[torch.Tensor]] = {"step": [], "exp_avg": [], "exp_avg_sq": []}
    for opt in off._chained(policy.optimizer):
        for st in opt.optimizer.state.values():
            for k in out:
                out[k].append(torch.as_tensor(st[k]).detach().clone().float())
    chained = off._chained(policy.optimizer)
    out["main"] = [m.detach().clone() for o in chained for g in o.shard_fp32_from_float16_groups for m in g]
    out["params"] = [p.detach().clone() for p in policy.model.parameters()]
    out["teacher"] = [p.detach().clone() for p in policy.teacher.module.parameters()]
    return out


def _run(rank, world, tiny, root, plant=False):
    from megatron.core import dist_checkpointing

    from srpo_megatron.trainer.run import optimizer_format
    from srpo_megatron.trainer.run.checkpoint import load_checkpoint, save_checkpoint

    first = _policy(tiny, f"{root}/train", "false")
    for step in range(2):
        _step(first, rank, step)
    before = _state(first)
    metadata = {}
    for f, flag in FORMATS.items():  # the same trained state, saved in each format
        first.cfg.run.checkpoint_fully_reshardable = flag == "true"
        path = save_checkpoint(first, f"{root}/{f}", 2, {"weight_version": 2}, keep_last=2)
        metadata[f] = dist_checkpointing.load_content_metadata(str(path))
    straight = (_step(first, rank, 2), _state(first))
    if plant:  # ignore the recorded format: load every checkpoint as the old fully_reshardable
        optimizer_format.loadable_sharding = lambda saved, groups, path: optimizer_format.RESHARDABLE
    out = {}
    for f in FORMATS:
        policy = _policy(tiny, f"{root}/{f}", "false")  # the recipe's current flag does not matter on load
        load_checkpoint(policy, Path(root) / f / "checkpoints" / "step_000002", log=lambda _: None)
        loaded = _state(policy)
        out[f] = (loaded, _step(policy, rank, 2), _state(policy))
    return before, metadata, straight, out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_both_optimizer_formats_resume_bit_exactly(tiny, tmp_path):
    results = run_distributed(_run, 2, tiny, str(tmp_path), timeout=900)
    for rank, (before, metadata, (loss, after), out) in enumerate(results):
        for f, meta in metadata.items():
            assert meta["distrib_optim_sharding_type"] == f, (rank, meta)
            assert meta["srpo_layout"] == {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "dp": 2, "cp": 1}, meta
        for f, (loaded, resumed_loss, resumed) in out.items():
            bad = [k for k in before if not _equal(before[k], loaded[k])]
            assert not bad, f"rank {rank} {f}: differs after load: {bad}"
            assert resumed_loss == loss, f"rank {rank} {f}: loss {resumed_loss!r} != {loss!r}"
            bad = [k for k in after if not _equal(after[k], resumed[k])]
            assert not bad, f"rank {rank} {f}: the resumed step differs: {bad}"


def test_loading_the_fast_format_as_reshardable_fails(tiny, tmp_path):
    from srpo_megatron.testing.distributed import RankFailed

    with pytest.raises(RankFailed, match="loading the model/optimizer shards failed"):
        run_distributed(_run, 2, tiny, str(tmp_path), True, timeout=900)


def _save_fast(rank, world, tiny, root):
    from srpo_megatron.trainer.run.checkpoint import save_checkpoint

    policy = _policy(tiny, root, "false")
    _step(policy, rank, 0)
    save_checkpoint(policy, root, 1, {"weight_version": 1}, keep_last=1)
    return _state(policy)


def _load_fast(rank, world, tiny, root):
    from srpo_megatron.trainer.run.checkpoint import load_checkpoint

    policy = _policy(tiny, root, "false")
    load_checkpoint(policy, Path(root) / "checkpoints" / "step_000001", log=lambda _: None)
    return _state(policy)


def test_a_fast_checkpoint_saved_at_dp2_loads_at_dp1(tiny, tmp_path):
    """``dp_reshardable`` reshards over DP (megatron cuts the buckets again): every optimizer value of the
    two DP 2 shards is loaded at DP 1 (compared as sorted multisets: the shards' order differs)."""
    saved = run_distributed(_save_fast, 2, tiny, str(tmp_path), timeout=900)
    (loaded,) = run_distributed(_load_fast, 1, tiny, str(tmp_path), timeout=900)
    for key in ("exp_avg", "exp_avg_sq", "main"):
        both = torch.cat([t.flatten().float() for rank in saved for t in rank[key]]).sort().values
        one = torch.cat([t.flatten().float() for t in loaded[key]]).sort().values
        assert torch.equal(both, one), f"{key}: the DP 1 load differs from the DP 2 shards"
    assert {float(s) for s in loaded["step"]} == {1.0}


def _repeated(rank, world, tiny, root, plant=False):
    """Three saves per format on one policy, formats alternating, a step before each: the second and third
    of each run on the kept strategy (megatron's cached distribution and save plan); the last of each is
    loaded into a fresh policy."""
    from srpo_megatron.trainer.run import checkpoint as ckpt

    if plant:  # one kept strategy for both formats: the fast plan would write the reshardable state
        keyed = ckpt._save_strategy
        ckpt._save_strategy = lambda policy, sharding: keyed(policy, "one")
    policy = _policy(tiny, f"{root}/train", "false")
    saved = {}
    for step in range(1, 7):
        _step(policy, rank, step)
        f = list(FORMATS)[step % 2]
        policy.cfg.run.checkpoint_fully_reshardable = FORMATS[f] == "true"
        ckpt.save_checkpoint(policy, f"{root}/{f}", step, {"weight_version": step}, keep_last=1)
        saved[f] = (step, _state(policy))
    kept = {k: s.base_strategy.validated_cache_reuse for k, s in ckpt._SAVE_STRATEGIES[policy].items()}
    out = {}
    for f, (step, _) in saved.items():
        fresh = _policy(tiny, f"{root}/{f}", "false")
        ckpt.load_checkpoint(fresh, Path(root) / f / "checkpoints" / f"step_{step:06d}", log=lambda _: None)
        out[f] = _state(fresh)
    return kept, {f: s for f, (_, s) in saved.items()}, out


def test_repeated_saves_on_the_kept_strategy_load_exactly(tiny, tmp_path):
    """The trainer keeps megatron's save strategy across saves, per optimizer format (its training loop's
    ``--ckpt-assume-constant-structure``): megatron's plan cache is in use by the third save of each format,
    and what each last save wrote is what loads."""
    for rank, (kept, saved, loaded) in enumerate(
        run_distributed(_repeated, 2, tiny, str(tmp_path), timeout=900)
    ):
        assert kept == {"dp_reshardable": True, "fully_reshardable": True}, (rank, kept)
        for f in FORMATS:
            bad = [k for k in saved[f] if not _equal(saved[f][k], loaded[f][k])]
            assert not bad, f"rank {rank} {f}: differs after load: {bad}"


def test_one_kept_strategy_for_both_formats_is_caught(tiny, tmp_path):
    """Planted: one strategy kept across formats (the cache keyed without the format) fails the next save:
    its kept plan names the other format's optimizer tensors (megatron: "Could not find FQN")."""
    from srpo_megatron.testing.distributed import RankFailed

    with pytest.raises(RankFailed, match="Could not find FQN"):
        run_distributed(_repeated, 2, tiny, str(tmp_path), True, timeout=900)
