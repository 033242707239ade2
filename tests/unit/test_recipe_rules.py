"""The recipe's cross-section rules: one sampling temperature, the refusals at load time, and the shrunk
production recipes loading to exactly the configs they loaded to before ``base:``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from srpo_megatron.config import ConfigError, LossConfig, load_recipe, to_dict
from tests.helpers.flat_keys import flat

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "tiny_cpu_test.yaml"
# to_dict of every examples/*.yaml as it loaded before the Qwen3 recipes were shrunk to their differences
# (recorded once from the full files; loss.temperature already derived, so not among the keys).
BEFORE = json.loads((Path(__file__).with_name("recipes_before_shrink.json")).read_text())
# Keys added to the config since the snapshot, with their defaults: a recipe that does not set one loads
# it at exactly this value (any other value is a change the test reports).
ADDED_SINCE = {
    "rollout.off_policy_steps": 0,
    "rollout.partial": False,
    "rollout.true_on_policy_mode": False,
    "rollout.dynamic_sampling": False,
    "rollout.max_sampling_rounds": 4,
    "rollout.dynamic_sampling_criterion": "auto",
    "rollout.dynamic_sampling_std_eps": 1e-6,
    "loss.is_correction": "tis",
    "loss.is_level": "token",
    "loss.is_low": 0.5,
    "loss.is_high": 5.0,
    "loss.mask_stale_tokens": False,
    "loss.is_rejection_denominator": "drop",
    "rollout.precision": "bf16",
    "moe.expert_bias_update_rate": 0.0,
    "loss.aggregation": "token_mean",
    "teacher.enable_thinking": False,
    "rollout.parity_top_k": 0,
    "rollout.allow_reward_errors": False,
    "performance.fused_output": "auto",
    "run.checkpoint_fully_reshardable": False,
    "parallel.cp_comm_type": "p2p",
    "lora.rank": 0,
    "lora.alpha": 32.0,
    "lora.dropout": 0.0,
    "lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "lora.experts": False,
    "lora.sync": "adapter",
    "rollout.environment": "",
    "rollout.max_turns": 4,
    "rollout.tool_timeout_s": 10.0,
    "rollout.max_tool_output_tokens": 512,
    "rollout.on_tool_fault": "continue",
    "data.arithmetic.system": None,  # only where the recipe has a data.arithmetic section
    "rollout.sglang.concurrent_requests": 512,  # only where the recipe has a rollout.sglang section
}
# Keys a recipe set since the snapshot (recipe -> key -> value): the GRPO and SDPO baselines average per
# sequence as SDPO's code, with which the paper's baseline runs were made (issue 28, D1).
CHANGED_SINCE = {
    "qwen3_8b_grpo.yaml": {"loss.aggregation": "seq_mean_token_mean"},
    "qwen3_8b_sdpo.yaml": {"loss.aggregation": "seq_mean_token_mean"},
    # routing replay on: it now runs under the full recompute these MoE recipes need (compat/router_replay.py)
    "qwen3_235b_a22b_srpo.yaml": {"rollout.routing_replay": True},
    "qwen3_30b_a3b_srpo.yaml": {"rollout.routing_replay": True},
    "deepseek_v3_srpo.yaml": {"rollout.routing_replay": True},
}


# ---- the shrunk recipes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BEFORE), ids=str)
def test_every_recipe_loads_to_exactly_the_config_it_had_before_the_shrink(name):
    now = flat(to_dict(load_recipe(EXAMPLES / name)))
    had = flat(BEFORE[name])
    sglang = any(k.startswith("rollout.sglang.") for k in had)
    added = {k: v for k, v in ADDED_SINCE.items() if sglang or not k.startswith("rollout.sglang.")}
    before = {**added, **had, **CHANGED_SINCE.get(name, {})}
    changed = {
        k: (before.get(k), now.get(k)) for k in before.keys() | now.keys() if before.get(k) != now.get(k)
    }
    assert not changed, f"{name}: (before, now) per key: {changed}"


def test_only_the_grpo_and_sdpo_baselines_average_per_sequence():
    """SRPO keeps the paper's global token mean; the baselines reproduce how their runs were averaged."""
    for path in sorted(EXAMPLES.glob("*.yaml")):
        loss = to_dict(load_recipe(path))["loss"]
        changed = CHANGED_SINCE.get(path.name, {}).get("loss.aggregation")
        want = "seq_mean_token_mean" if changed else "token_mean"
        assert loss["aggregation"] == want, (path.name, loss["mode"], loss["aggregation"])


# Recipes written after the snapshot (each inherits a recorded one).
ADDED_RECIPES = {
    "qwen3_8b_srpo_async.yaml",
    "deepseek_v3_srpo.yaml",
    "glm45_air_srpo.yaml",
    "gpt_oss_20b_srpo.yaml",
    "kimi_k2_srpo.yaml",
    "qwen3_32b_lora_srpo.yaml",
    "qwen3_235b_a22b_lora_srpo.yaml",
    "smollm2_arith_lora_cpu.yaml",
    "smollm2_arith_calc_cpu.yaml",
}


def test_every_example_recipe_is_recorded():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted({*BEFORE, *ADDED_RECIPES})


def test_the_off_policy_recipe_is_the_separate_recipe_one_step_off():
    sep = flat(to_dict(load_recipe(EXAMPLES / "qwen3_8b_srpo_separate.yaml")))
    off = flat(to_dict(load_recipe(EXAMPLES / "qwen3_8b_srpo_async.yaml")))
    changed = {k for k in sep.keys() | off.keys() if sep.get(k) != off.get(k)}
    assert changed == {"run.dir", "rollout.off_policy_steps"} and off["rollout.off_policy_steps"] == 1


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.off_policy_steps=1"], "needs rollout.placement: separate"),
        (["rollout.partial=true"], "needs rollout.off_policy_steps >= 1"),
        (["rollout.off_policy_steps=-1"], "must be >= 0"),
        (["rollout.max_sampling_rounds=0"], "must be >= 1"),
    ],
)
def test_off_policy_keys_are_refused_where_they_cannot_work(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_recipe(TINY, overrides)


def test_the_qwen3_variants_inherit_the_8b_recipe_and_state_only_their_differences():
    for path in sorted(EXAMPLES.glob("qwen3_*.yaml")):
        text = path.read_text()
        if path.name == "qwen3_8b_srpo.yaml":
            assert "base:" not in text
            continue
        # a LoRA variant inherits its full fine-tuning recipe (which inherits the 8B one)
        parent = path.name.replace("_lora", "") if "_lora_" in path.name else "qwen3_8b_srpo.yaml"
        assert (EXAMPLES / parent).is_file() and f"\nbase: {parent}" in text, path.name
        assert len(text.splitlines()) < 40, f"{path.name} restates its base"


# ---- one sampling temperature --------------------------------------------------------------------------


def test_the_loss_divides_by_the_sampling_temperature():
    cfg = load_recipe(TINY, ["rollout.temperature=0.7"])
    assert cfg.loss.temperature == cfg.rollout.temperature == 0.7
    assert "temperature" not in to_dict(cfg)["loss"]  # one key in the saved recipe too
    assert LossConfig(temperature=0.9).temperature == 0.9  # the loss alone (tests, tools) still takes one


def test_loss_temperature_in_a_recipe_is_refused_with_the_fix(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\nloss: {{temperature: 1.0}}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe)
    msg = str(err.value)
    assert "loss.temperature is not a recipe key" in msg  # what
    assert "divides logits by the sampling temperature" in msg  # why
    assert "set rollout.temperature" in msg  # fix
    with pytest.raises(ConfigError, match=r"loss\.temperature is not a recipe key"):
        load_recipe(TINY, ["loss.temperature=0.7"])


# ---- refusals at load time -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["srpo", "grpo", "sdpo"])
def test_kl_coef_without_a_reference_policy_is_refused(mode):
    """The trainer computes no reference log-probs (TokenBatch.ref_logp stays None), so a KL penalty
    would raise in the GRPO loss at step 1 (or be meaningless where no GRPO token exists)."""
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, [f"loss.mode={mode}", "loss.kl_coef=0.01"])
    msg = str(err.value)
    assert "loss.kl_coef=0.01" in msg and "no reference policy" in msg and "set loss.kl_coef=0" in msg
    assert load_recipe(TINY, ["loss.kl_coef=0"]).loss.kl_coef == 0.0


SGLANG = ["rollout.engine=sglang", "rollout.sglang={model_path: /m, disk_sync_dir: /d}"]
COLOCATED, SEPARATE = (
    ["rollout.placement=colocated"],
    ["rollout.placement=separate", "rollout.engine_nodes=1"],
)
# (placement, weight_sync, None = it loads / words of the refusal naming the keys)
PAIRS = [
    ("colocated", "tensor", None),
    ("colocated", "disk", None),
    ("colocated", "distributed", "placement=colocated cannot use rollout.sglang.weight_sync=distributed"),
    ("separate", "distributed", None),
    ("separate", "disk", None),
    ("separate", "tensor", "placement=separate cannot use rollout.sglang.weight_sync=tensor"),
]


@pytest.mark.parametrize(("placement", "sync", "refusal"), PAIRS, ids=[f"{p}-{s}" for p, s, _ in PAIRS])
def test_every_placement_and_weight_sync_pair_loads_or_is_refused_naming_the_keys(placement, sync, refusal):
    where = COLOCATED if placement == "colocated" else SEPARATE
    overrides = [*SGLANG, *where, f"rollout.sglang.weight_sync={sync}"]
    if refusal is None:
        cfg = load_recipe(TINY, overrides)
        assert (cfg.rollout.placement, cfg.rollout.sglang.weight_sync) == (placement, sync)
        return
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, overrides)
    msg = str(err.value)
    assert refusal in msg and "; use " in msg, msg  # names the keys, then the fix
    assert "attach_broadcast_group" not in msg  # not an internal method


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["rollout.placement=separate", "rollout.engine_nodes=1"], "separate needs rollout.engine=sglang"),
        (
            [*SGLANG, "rollout.placement=separate", "rollout.sglang.weight_sync=distributed"],
            "engine_nodes >= 1",
        ),
        ([*SGLANG, "rollout.engine_nodes=2"], "only applies to placement separate"),
        ([*SGLANG, "rollout.engine_nodes=-1"], "rollout.engine_nodes=-1 must be >= 0"),
    ],
)
def test_placement_node_counts_are_checked_where_the_trainer_loads_them(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_recipe(TINY, overrides)


# ---- every tool loads the same TrainConfig --------------------------------------------------------------


def test_doctor_and_the_server_launcher_refuse_a_recipe_exactly_as_train_does(tmp_path):
    from srpo_megatron.doctor.command import recipe_checks
    from srpo_megatron.doctor.expectations import NodeExpectations
    from srpo_megatron.rollout.sglang.servers import recipe_rollout_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {EXAMPLES / 'qwen3_8b_srpo.yaml'}\nparallel: {{optimizer_offload: true}}\n")
    with pytest.raises(ConfigError) as train:
        load_recipe(recipe)
    assert "unknown key(s) ['optimizer_offload']" in str(train.value)
    with pytest.raises(ConfigError) as servers:
        recipe_rollout_config(str(recipe), [])  # the SGLang servers of a separate placement
    assert str(servers.value) == str(train.value)
    (check,) = recipe_checks(str(recipe), [], NodeExpectations.from_environment())
    assert (check.name, check.status, check.detail) == ("recipe", "fail", str(train.value))
