"""The megatron-core version layer (srpo_megatron/compat/mcore.py) and each difference between the tested
versions, pinned per version: CI runs this file on 0.16.1 and on 0.19.2, and on each the branch the
project takes must be the one that version needs (taking the other fails here).
"""

from __future__ import annotations

import inspect
import warnings

import pytest

from srpo_megatron.compat import mcore

TESTED = ("0.16.1", "0.19.2")


def _pinned(table: dict[str, object], version: str) -> object:
    if version not in table:
        pytest.skip(f"megatron-core {version} is not one of the pinned versions {sorted(table)}")
    return table[version]


def test_tested_range_matches_pyproject():
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    assert mcore.TESTED_RANGE in deps
    for v in TESTED:
        assert mcore.version_is_tested(tuple(map(int, v.split("."))))
    assert not mcore.version_is_tested((0, 16, 0))
    assert not mcore.version_is_tested((0, 20, 0))
    assert mcore.version_is_tested((0, 19, 99))


def test_installed_version_is_one_ci_tests(mcore_version):
    assert mcore_version in TESTED, f"CI runs {TESTED}; got {mcore_version}"
    assert mcore.version_is_tested()


def test_untested_version_warns_once_naming_the_range(monkeypatch):
    monkeypatch.setattr(mcore, "_warned", [])
    monkeypatch.setattr(mcore, "mcore_version", lambda: (0, 21, 0))
    with pytest.warns(RuntimeWarning, match=r"megatron-core 0\.21\.0 is outside the tested range "):
        assert mcore.warn_if_untested() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mcore.warn_if_untested() is False  # once per process
    monkeypatch.setattr(mcore, "_warned", [])
    monkeypatch.setattr(mcore, "mcore_version", lambda: (0, 16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mcore.warn_if_untested() is False


def test_untested_warning_names_the_pyproject_range(monkeypatch):
    monkeypatch.setattr(mcore, "_warned", [])
    monkeypatch.setattr(mcore, "mcore_version", lambda: (0, 15, 0))
    with pytest.warns(RuntimeWarning) as record:
        mcore.warn_if_untested()
    assert "'megatron-core>=0.16.1,<0.20'" in str(record[0].message)


def test_common_state_location_per_version(mcore_version):
    """0.16 saves the common state to common.pt (get_default_save_common_strategy); 0.19 removed that and
    stores it as the 'common_state' ShardedObject. The streamed writer follows this switch; the
    file-level check against megatron's own save is tests/dist/test_conversion_stream.py."""
    want = _pinned({"0.16.1": True, "0.19.2": False}, mcore_version)
    assert mcore.save_writes_common_pt() is want


def test_ddp_grad_sync_asks_for_the_current_stream_only_from_0_19(mcore_version):
    """The CPU layer's ``torch.cuda.current_stream`` shim exists for 0.19's DDP; if 0.16 starts calling it
    or 0.19 stops, this fails (drop or extend the shim)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    want = _pinned({"0.16.1": False, "0.19.2": True}, mcore_version)
    source = inspect.getsource(pgb._ParamAndGradBucketGroup.start_grad_sync)
    assert ("torch.cuda.current_stream()" in source) is want


def test_gpt_model_deprecation_per_version(mcore_version):
    """0.19 deprecates GPTModel in favour of HybridModel (see the srpo_megatron.models docstring for
    what moving takes); 0.16 has no HybridModel."""
    from megatron.core.models.gpt import gpt_model

    want = _pinned({"0.16.1": False, "0.19.2": True}, mcore_version)
    assert ("GPTModel IS DEPRECATED" in inspect.getsource(gpt_model.GPTModel.__init__)) is want
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: F401

        has_hybrid = True
    except ImportError:
        has_hybrid = False
    assert has_hybrid is want


def test_hybrid_model_blockers_still_hold(mcore_version):
    """The reasons the policy is not on HybridModel yet (srpo_megatron.models docstring). When one stops
    holding in a new release this fails: time to move (or update the docstring)."""
    if mcore_version == "0.16.1":
        pytest.skip("megatron-core 0.16.1 has no HybridModel")
    _pinned({"0.19.2": True}, mcore_version)
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import TransformerConfig

    # 1. HybridStack's final norm is TENorm whatever the spec says, and TENorm needs Transformer Engine.
    assert "self.final_norm = TENorm(" in inspect.getsource(hybrid_block.HybridStack.__init__)
    if not te_ext.HAVE_TE:
        cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
        with pytest.raises(ImportError, match="Transformer Engine"):
            te_ext.TENorm(config=cfg, hidden_size=8)
    # 2. No llama3 RoPE scaling (GPTModel has rope_scaling/rope_scaling_factor).
    params = inspect.signature(HybridModel.__init__).parameters
    assert "rope_scaling" not in params and "rope_scaling_factor" not in params
