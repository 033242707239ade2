"""Which distributed-optimizer checkpoint format a run saves and may load (trainer/run/optimizer_format.py):
the fast ``dp_reshardable`` by default, ``fully_reshardable`` with the recipe flag; a load takes the format
recorded in the checkpoint (none recorded: the older ``fully_reshardable``), and a fast checkpoint resumed
at another TP/PP/EP/ETP is refused in one line naming the layouts and the fix (DP/CP changes load)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from srpo_megatron.config.run import RunConfig
from srpo_megatron.conversion.checkpoint_files import CheckpointError
from srpo_megatron.trainer.run import optimizer_format as fmt


def _groups(tp=1, pp=1, ep=1, etp=1, dp=2, cp=1):
    return SimpleNamespace(tp_size=tp, pp_size=pp, ep_size=ep, etp_size=etp, dp_size=dp, cp_size=cp)


def test_the_default_saves_fast_and_the_flag_saves_reshardable():
    fast = fmt.content_metadata(RunConfig(), _groups(ep=2))
    assert fast == {
        "distrib_optim_sharding_type": "dp_reshardable",
        "srpo_layout": {"tp": 1, "pp": 1, "ep": 2, "etp": 1, "dp": 2, "cp": 1},
    }
    slow = fmt.content_metadata(RunConfig(checkpoint_fully_reshardable=True), _groups())
    assert slow["distrib_optim_sharding_type"] == "fully_reshardable"


def test_a_load_takes_the_saved_format_and_older_checkpoints_are_reshardable():
    saved = fmt.content_metadata(RunConfig(), _groups(tp=2))
    assert fmt.loadable_sharding(saved, _groups(tp=2, dp=4, cp=2), "ck") == "dp_reshardable"  # DP/CP reshard
    assert fmt.loadable_sharding(None, _groups(tp=4), "ck") == "fully_reshardable"
    slow = fmt.content_metadata(RunConfig(checkpoint_fully_reshardable=True), _groups(tp=2))
    assert fmt.loadable_sharding(slow, _groups(pp=2, ep=2), "ck") == "fully_reshardable"


@pytest.mark.parametrize("axis", ["tp", "pp", "ep", "etp"])
def test_a_fast_checkpoint_at_another_model_layout_is_refused_with_the_fix(axis):
    saved = fmt.content_metadata(RunConfig(), _groups())
    with pytest.raises(CheckpointError) as e:
        fmt.loadable_sharding(saved, _groups(**{axis: 2}), "/runs/x/checkpoints/step_000010")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("/runs/x/checkpoints/step_000010: ")
    assert "saved at TP1 PP1 EP1 ETP1" in msg and f"{axis.upper()}2" in msg
    assert "run.checkpoint_fully_reshardable=true" in msg


def test_an_unknown_saved_format_is_refused():
    with pytest.raises(CheckpointError, match=r"'fully_sharded_model_space'.*does not load"):
        fmt.loadable_sharding({"distrib_optim_sharding_type": "fully_sharded_model_space"}, _groups(), "ck")
