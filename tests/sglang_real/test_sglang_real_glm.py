"""GLM-4.5 weight names against SGLang's own ``glm4_moe.Glm4MoeForCausalLM.load_weights`` (marker
``sglang_real``; runs in the sglang tier of ``tools/dev test``, skips without an sglang wheel).

SGLang skips names it does not know silently, so a name the trainer sends that SGLang does not map would
never load. Every name of the GLM4_MOE conversion table (what weight sync sends: q/k/v with their biases,
QK-norm, the dense first layer's gate/up/down, the router and its ``e_score_correction_bias``, every
routed expert's gate/up/down, the shared experts) must reach exactly one of SGLang's parameters, and every
parameter must receive all its shards. SGLang's model cannot be built on CPU, so its parameter names
(``glm_param_names``) are this file's reading of glm4_moe.py (fused ``qkv_proj``/``gate_up_proj``, experts
as ``w13_weight``/``w2_weight`` of a FusedMoE, the bias a parameter of ``mlp.gate``); SGLang's own renaming
must land on them. The bias's shape and dtype are checked against SGLang's ``Glm4MoeGate`` (fp32 ``[E]``).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.testing import sglang_import
from srpo_megatron.testing.tiny import tiny_glm_moe_config

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )


class _Recorded:
    """A parameter of SGLang's model whose ``weight_loader`` records what SGLang routes to it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def weight_loader(self, param, loaded, *args, **kwargs):
        shard = kwargs.get("shard_id", args[1] if len(args) > 1 else (args[0] if args else None))
        self.log.append((self.name, shard, kwargs.get("expert_id"), tuple(loaded.shape), loaded.dtype))


def glm_param_names(config) -> list[str]:
    """SGLang's parameter names of a GLM-4.5 model (glm4_moe.py)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        attn = ["qkv_proj.weight", "o_proj.weight"]
        attn += ["qkv_proj.bias"] if config.attention_bias else []
        attn += ["q_norm.weight", "k_norm.weight"] if config.use_qk_norm else []
        names += [p + "self_attn." + s for s in attn]
        if i < config.first_k_dense_replace:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
        else:
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
            names += [p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"]
            names += [p + "mlp.shared_experts.gate_up_proj.weight", p + "mlp.shared_experts.down_proj.weight"]
    return names


def _load(config, names_shapes: dict[str, tuple[int, ...]]):
    module = REAL.models.get("glm4_moe")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: glm4_moe does not import: {REAL.errors}")
    log: list = []
    params = {n: _Recorded(n, log) for n in glm_param_names(config)}
    fake = SimpleNamespace(
        config=config, num_fused_shared_experts=0, named_parameters=lambda: iter(params.items())
    )
    weights = [(n, torch.zeros(s, dtype=torch.float32)) for n, s in names_shapes.items()]
    module.Glm4MoeForCausalLM.load_weights(fake, weights)
    return params, log


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_sglang_real_glm_load_weights_consumes_the_tables_names(grouped):
    config = tiny_glm_moe_config(grouped=grouped)
    table = ConversionTable(Architecture.from_hf(config.to_dict()))
    sent = {n: table.hf_shape(n) for n in table.hf_names()}
    params, log = _load(config, sent)
    hits = Counter(name for name, *_ in log)
    assert sum(hits.values()) == len(sent), "every name the trainer sends reaches exactly one parameter"
    experts = config.n_routed_experts
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            want = 3
        elif name.endswith("gate_up_proj.weight"):
            want = 2
        elif name.endswith("experts.w13_weight"):
            want = 2 * experts
        elif name.endswith("experts.w2_weight"):
            want = experts
        else:
            want = 1
        assert hits[name] == want, f"{name}: {hits[name]} shards loaded, expected {want}"
    w13 = {(s, e) for n, s, e, *_ in log if n.endswith("layers.1.mlp.experts.w13_weight")}
    assert w13 == {(s, e) for e in range(experts) for s in ("w1", "w3")}
    bias = [shape for n, _, _, shape, _ in log if n.endswith("mlp.gate.e_score_correction_bias")]
    assert bias == [(experts,)] * (config.num_hidden_layers - config.first_k_dense_replace)


def test_sglang_real_glm_planted_megatron_name_is_dropped():
    """The check can fail: a megatron-style name (not converted) reaches no parameter."""
    config = tiny_glm_moe_config()
    table = ConversionTable(Architecture.from_hf(config.to_dict()))
    sent = {n: table.hf_shape(n) for n in table.hf_names()}
    sent.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    sent["model.layers.1.mlp.router.expert_bias"] = (config.n_routed_experts,)
    _, log = _load(config, sent)
    assert sum(1 for _ in log) == len(sent) - 1


def test_sglang_gate_keeps_the_bias_in_fp32():
    """SGLang's Glm4MoeGate holds e_score_correction_bias in fp32 (weight sync sends it in fp32)."""
    import inspect

    module = REAL.models.get("glm4_moe")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: glm4_moe does not import: {REAL.errors}")
    src = inspect.getsource(module.Glm4MoeGate.__init__)
    assert "e_score_correction_bias" in src and "torch.float32" in src


def test_sglang_real_decodes_the_glm_policys_sync_with_an_fp32_bias(tmp_path):
    """The megatron GLM policy's colocated sync (fp32, then bf16) into a TP2 stand-in: SGLang's decoder gives
    every TP rank the checkpoint's tensors bit for bit, and in the bf16 sync the expert biases stay fp32."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.distributed import run_distributed
    from srpo_megatron.testing.sglang_standin import SGLangStandInServer
    from srpo_megatron.testing.tiny import write_tiny_glm_moe
    from tests.helpers.conversion import read_hf_tensors
    from tests.helpers.sglang_sync import policy_sync_worker

    if REAL.utils is None or REAL.tensor_bucket is None:
        pytest.skip(f"sglang {REAL.version}: utils/tensor_bucket do not import: {REAL.errors}")
    folder = write_tiny_glm_moe(tmp_path / "glm")
    files = read_hf_tensors(folder)
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tp_size=2)
    try:
        (served,) = run_distributed(
            policy_sync_worker, 1, str(folder), server.url, sorted(files), timeout=600
        )
        assert served == 2
        versions = [b["weight_version"] for p, b in server.bodies if p == "/update_weights_from_tensor"]
        for version, dtype in (("1", torch.float32), ("2", torch.bfloat16)):
            updates = [u for v, u in zip(versions, server.tensor_updates, strict=True) if v == version]
            for rank in range(2):
                got = {n: t for update in updates for n, t in update[rank]}
                assert set(got) == set(files)
                for name, t in got.items():
                    want = files[name] if name.endswith("e_score_correction_bias") else files[name].to(dtype)
                    assert t.dtype == want.dtype and torch.equal(t, want), name
    finally:
        server.close()
