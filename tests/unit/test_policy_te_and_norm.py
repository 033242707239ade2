"""The policy's GPU-path choices that a CPU can still check.

- A broken Transformer Engine install (the package is on the path, its import raises ImportError, OSError
  or RuntimeError, as a missing extension, a missing ``.so`` or a CUDA driver mismatch do) is one line
  naming the error and the fix, never a silent local spec; ``performance.layer_spec: local`` turns it into
  a warning. The stand-in: a ``transformer_engine`` package written to a temporary folder put first on
  ``sys.path``, whose ``__init__`` raises.
- The decoder's final norm is pinned: megatron's ``TransformerBlock`` picks apex's ``FusedLayerNorm`` for a
  bare layer spec whenever ``apex`` imports (0.16.1 and 0.19.2: ``transformer_block.LayerNormImpl``), and
  ``FusedLayerNorm`` refuses RMSNorm. The stand-in: an importable ``apex`` module (no kernels) with
  ``apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction``, the name megatron's
  ``fusions/fused_layer_norm.py`` imports; megatron's own ``FusedLayerNorm`` is the real one. It runs in a
  fresh process (megatron decides at import time), on whichever megatron-core is first on the path
  (the 0.19.2 tier runs it again: ``tests/helpers/mcore_next.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from srpo_megatron.config import ConfigError, PerformanceConfig
from srpo_megatron.models import performance as perf
from srpo_megatron.models.performance import Accelerators

ROOT = Path(__file__).resolve().parents[2]

BROKEN = {
    "ModuleNotFoundError": "from transformer_engine_torch import *  # the compiled extension is missing",
    "OSError": "raise OSError('libtransformer_engine.so: cannot open shared object file: No such file')",
    "RuntimeError": "raise RuntimeError('CUDA driver version is insufficient for CUDA runtime version')",
}


@pytest.fixture(params=sorted(BROKEN))
def broken_te(request, tmp_path, monkeypatch):
    """A ``transformer_engine`` package whose import raises the parametrised error (module doc)."""
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN[request.param] + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    return request.param


def test_a_broken_transformer_engine_is_one_line_naming_the_error_and_the_fix(broken_te):
    problem = perf.transformer_engine_problem()
    assert problem is not None and "\n" not in problem
    assert (
        broken_te in problem and "performance.layer_spec: local" in problem and "fix the install" in problem
    )
    with pytest.raises(ConfigError, match=broken_te) as e:
        perf.check_transformer_engine(PerformanceConfig(layer_spec="auto"), cuda=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=broken_te):
        perf.check_transformer_engine(PerformanceConfig(layer_spec="te"), cuda=True)
    from srpo_megatron.models.policy import transformer_engine_available

    with pytest.raises(ConfigError, match=broken_te):  # build_policy / layer_spec with use_te=None
        transformer_engine_available()


def test_layer_spec_local_turns_a_broken_te_into_a_warning_and_the_local_spec(broken_te):
    with pytest.warns(RuntimeWarning, match=broken_te):
        perf.check_transformer_engine(PerformanceConfig(layer_spec="local"), cuda=True)
    perf.check_transformer_engine(PerformanceConfig(layer_spec="auto"), cuda=False)  # no CUDA: TE unused
    gpu = Accelerators(
        cuda=True,
        transformer_engine=False,
        apex_grad_accum=True,
        te_rope=False,
        torch_compile=True,
        transformer_engine_problem=perf.transformer_engine_problem(),
    )
    with pytest.raises(ConfigError, match=broken_te):
        perf.use_transformer_engine(PerformanceConfig(layer_spec="auto"), gpu)
    with pytest.warns(RuntimeWarning, match=broken_te):
        assert perf.use_transformer_engine(PerformanceConfig(layer_spec="local"), gpu) is False


def test_transformer_engine_not_installed_is_no_problem(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # find_spec: None, as when not installed
    assert not perf.transformer_engine_installed()
    assert perf.transformer_engine_problem() is None
    perf.check_transformer_engine(
        PerformanceConfig(layer_spec="te"), cuda=True
    )  # use_transformer_engine's job
    from srpo_megatron.models.policy import transformer_engine_available

    assert transformer_engine_available() is False


FINAL_NORM_SCRIPT = textwrap.dedent(
    """
    import json, sys, types

    # Stand-in for an installed apex (module doc): importable, no kernels.
    apex = types.ModuleType("apex")
    normalization = types.ModuleType("apex.normalization")
    fln = types.ModuleType("apex.normalization.fused_layer_norm")

    class FusedLayerNormAffineFunction:  # stand-in: megatron only checks that it imports
        @staticmethod
        def apply(*args):
            raise RuntimeError("stand-in apex kernel called")

    fln.FusedLayerNormAffineFunction = FusedLayerNormAffineFunction
    apex.normalization, normalization.fused_layer_norm = normalization, fln
    sys.modules.update({"apex": apex, "apex.normalization": normalization,
                        "apex.normalization.fused_layer_norm": fln})

    import megatron.core
    from megatron.core.transformer import transformer_block
    from srpo_megatron.models import policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)
    cfg = dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6)
    out = {"mcore": megatron.core.__version__,
           "block_default": transformer_block.LayerNormImpl.__name__}
    model = policy.build_policy(cfg, use_te=False)
    norm = model.decoder.final_layernorm
    out["pinned"] = [type(norm).__name__, norm.eps]
    out["norms"] = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
    # The planted bug: the bare layer spec reaches GPTModel (the behaviour before the pin).
    policy.decoder_spec = lambda arch, config, **kw: policy.layer_spec(arch, use_te=False)
    try:
        norm = policy.build_policy(cfg, use_te=False).decoder.final_layernorm
        out["bare"] = type(norm).__name__
    except Exception as e:
        out["bare"] = "raised " + type(e).__name__ + ": " + str(e)[:120]
    print(json.dumps(out))
    """
)


def test_final_norm_is_rmsnorm_when_apex_imports(mcore_version):
    """With apex importable, megatron's block default is FusedLayerNorm; the policy's final norm is still
    ``torch.nn.RMSNorm`` with the model's epsilon, and so is every other norm. The bare spec (planted, the
    behaviour before the pin) does not build: FusedLayerNorm refuses RMSNorm."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    env.pop("RANK", None)
    run = subprocess.run(
        [sys.executable, "-c", FINAL_NORM_SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["mcore"].split("+")[0] == mcore_version  # the subprocess ran the megatron under test
    assert out["block_default"] == "FusedLayerNorm"  # the stand-in apex is what megatron saw
    assert out["pinned"] == ["RMSNorm", 1e-6]
    assert out["norms"] == ["RMSNorm"]
    assert out["bare"].startswith("raised") and "not supported in FusedLayerNorm" in out["bare"]
