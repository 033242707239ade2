"""``hide_fallback_warnings`` hides exactly megatron-core's TE/Apex fallback warnings: the same text from
another module, another megatron warning, and another category stay visible."""

from __future__ import annotations

import warnings

import pytest

from srpo_megatron.compat import fallbacks

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
APEX_NORM = "Apex is not installed. Falling back to Torch Norm"


def _shown(message: str, module: str, category: type[Warning] = UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        fallbacks._state.pop("filters", None)
        fallbacks.hide_fallback_warnings()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    fallbacks._state.pop("filters", None)
    return bool(caught)


@pytest.mark.parametrize(
    "module", ["megatron.core.optimizer", "megatron.core.models.backends", "megatron_fsdp.mixed_precision"]
)
@pytest.mark.parametrize("message", [TE_APEX, APEX_NORM])
def test_megatron_fallback_warnings_are_hidden(message, module):
    assert not _shown(message, module)


@pytest.mark.parametrize(
    "message, module, category",
    [
        (TE_APEX, "mypackage.optim", UserWarning),  # the same text elsewhere
        ("full scope is deprecated.", "megatron.core.transformer.transformer_config", UserWarning),
        ("Transformer Engine failed to initialise", "megatron.core.extensions", UserWarning),
        (TE_APEX, "megatron.core.optimizer", RuntimeWarning),  # another category
    ],
)
def test_other_warnings_stay_visible(message, module, category):
    assert _shown(message, module, category)


def test_the_notice_names_what_runs_instead_on_this_cpu_venv():
    line = fallbacks.fallback_notice()
    assert line is not None and "local layer spec" in line and "SDPA" in line
