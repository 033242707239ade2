"""``rollout.true_on_policy_mode`` end to end in ``srpo train`` (tiny Qwen3, real Qwen vocabulary, CPU engine,
fp32): the engine's reported log-probs equal the trainer's scoring-pass π_old exactly, ``logprob/gap_max``
0.0 at every one of 3 SRPO steps, with full-weight syncs and with LoRA adapter syncs
(``rollout/true_on_policy.py``). Without the mode the same run reads the decode loop's float-level gap
(measured ~1e-6), so the metric can tell. Planted bugs must make it non-zero: a
weight sync that leaves one tensor stale (a dropped tensor), the decode-time log-probs reported instead of
the rescored ones, and the rescoring's softmax over the HF vocabulary rather than the trainer's padded one
(151669 vs 151680 columns).

Multi-turn (the calculator scaffold of ``tests/integration/test_train_multi_turn.py``): the finished
trajectories are rescored together, and the gap on assistant tokens is 0.0 at every step; rescoring each
turn's call alone (the planted bug) leaves 9.5e-7.

Not covered (a float-level gap remains there, see the module doc): ``lora.sync: merged`` (the engine
computes with W + s·BA, the trainer with W x + s·B(A x); measured 9.5e-7 from step 2), packed
micro-batches and TP > 1.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.healthy import assert_healthy_runs
from tests.helpers.train import read_metrics, train_overrides

ON = {"rollout.true_on_policy_mode": "true", "train.steps": 3}
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "optim.lr": 1e-2, "lora.sync": "adapter"}
STALE = "model.layers.0.mlp.down_proj.weight"  # the tensor the planted sync drops


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("true_on_policy"), num_prompts=4)


def _train_rank(rank, world, overrides, plant):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train
    from tests.helpers.recipe import RECIPE

    if plant == "stale_tensor":  # the sync installs every tensor but one, which keeps its old value
        install = HFEngine.update_weights

        def update(self, named_tensors, version):
            old = self.model.state_dict()[STALE].clone()
            install(self, named_tensors, version)
            self.model.state_dict()[STALE].copy_(old)

        HFEngine.update_weights = update
    if plant == "decode_logprobs":  # the decode loop's own log-probs reach the trainer
        HFEngine._rescore = lambda self, prompts, out, temperature: None
    if plant == "unpadded_vocab":  # the softmax over the HF vocabulary, not the trainer's padded one
        from srpo_megatron.rollout import true_on_policy

        true_on_policy.padded_vocab_size = lambda vocab, tp: vocab
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _gaps(tiny, name, plant=None, **extra):
    run_dir = tiny[0] / name
    run_distributed(_train_rank, 1, train_overrides(tiny, run_dir, **extra), plant, timeout=900)
    rows = read_metrics(run_dir)
    assert_healthy_runs(run_dir)
    print(name, "logprob/gap_max per step:", [r["logprob/gap_max"] for r in rows])
    return [r["logprob/gap_max"] for r in rows]


def test_gap_is_exactly_zero_dense(tiny):
    assert _gaps(tiny, "dense", **ON) == [0.0, 0.0, 0.0]


def test_gap_is_exactly_zero_lora_adapter_sync(tiny):
    assert _gaps(tiny, "lora", **ON, **LORA) == [0.0, 0.0, 0.0]


def test_without_the_mode_the_gap_is_float_level(tiny):
    gaps = _gaps(tiny, "off", **{"train.steps": 1})
    assert 0.0 < gaps[0] < 1e-4, gaps


@pytest.mark.parametrize("plant", ["stale_tensor", "decode_logprobs", "unpadded_vocab"])
def test_planted_bug_makes_the_gap_nonzero(tiny, plant):
    gaps = _gaps(tiny, f"plant_{plant}", plant, **{**ON, "train.steps": 2})
    if plant == "stale_tensor":  # step 1 serves the loaded weights: nothing is stale yet
        assert gaps[0] == 0.0 and gaps[1] > 0.0, gaps
    else:
        assert any(g > 0.0 for g in gaps), gaps


def _multi_turn_rank(rank, world, overrides, plant):
    from srpo_megatron.rollout.hf_engine import HFEngine
    from tests.helpers.scripted_calculator import multi_turn_rank

    if plant == "per_turn":  # each turn's call rescored alone, the trajectories never together
        HFEngine.rescore = lambda self, prompts, out, temperature: None
    return multi_turn_rank(rank, world, overrides)


@pytest.mark.parametrize("plant", [None, "per_turn"])
def test_multi_turn_assistant_gap_is_exactly_zero(tiny, plant):
    from tests.helpers.scripted_calculator import ENV

    run_dir = tiny[0] / f"multi_turn_{plant}"
    extra = {"rollout.environment": ENV, "rollout.max_new_tokens": 96, "rollout.max_turns": 4, **ON}
    run_distributed(_multi_turn_rank, 1, train_overrides(tiny, run_dir, **extra), plant, timeout=1200)
    rows = read_metrics(run_dir)
    assert_healthy_runs(run_dir)
    gaps = [r["logprob/gap_max"] for r in rows]
    print(f"multi-turn, plant={plant}, logprob/gap_max per step:", gaps)
    assert max(r["multiturn/turns_mean"] for r in rows) > 1, "trajectories must take several turns"
    if plant is None:
        assert gaps == [0.0, 0.0, 0.0], gaps
    else:
        assert any(g > 0.0 for g in gaps), gaps
