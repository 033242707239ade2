"""The DeepSeek-V3 conversion table against SGLang's own ``DeepseekV3ForCausalLM.load_weights``
(``sglang/srt/models/deepseek_v2.py``, marker ``sglang_real``).

What SGLang expects (read in its source, 0.5.15.post1 and 0.5.23): the hub's names. Per layer
``self_attn.{q_a_proj, q_a_layernorm, q_b_proj}`` (``q_lora_rank`` set; else ``q_proj``),
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; dense MLPs ``mlp.{gate,up,down}_proj``
(stacked into ``gate_up_proj``), MoE layers ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``
(a parameter there), per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` (into the FusedMoE ``w13``/``w2``)
and ``mlp.shared_experts.*``. With q compression it loads ``q_a_proj`` and ``kv_a_proj_with_mqa`` as ONE
fused parameter ``fused_qkv_a_proj_with_mqa`` = ``cat([q_a, kv_a], 0)``, and only once both have arrived in
the same ``load_weights`` call (it caches the first in a dict local to the call). ``kv_b_proj`` is loaded
as is; ``post_load_weights`` then re-derives MLA's absorbed ``w_kc``/``w_vc`` for the layers whose
``kv_b_proj`` came in the call. Layers >= ``num_hidden_layers`` (MTP) are skipped unless it loads the
NextN draft.

SGLang's models cannot be built on CPU, so the target parameter names (``sglang_param_names``) are this
file's reading of deepseek_v2.py; SGLang's own renaming must land on them, shard by shard.
"""

from __future__ import annotations

import types
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.testing import sglang_import
from srpo_megatron.testing.tiny import tiny_deepseek_model
from tests.helpers.conversion import read_hf_tensors

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

VARIANTS = {
    "q_lora+moe": dict(q_lora_rank=24, num_layers=3, first_k_dense_replace=1),
    "q_proj+dense": dict(q_lora_rank=None, rope_interleave=False),
}


class _Recorded:
    """A parameter of SGLang's model whose ``weight_loader`` records what SGLang routes to it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def weight_loader(self, param, loaded, *args, **kwargs):
        shard = kwargs.get("shard_id", args[1] if len(args) > 1 else (args[0] if args else None))
        self.log.append((self.name, shard, kwargs.get("expert_id"), loaded))


def sglang_param_names(config) -> list[str]:
    """SGLang's parameter names of a DeepSeek-V3 model (deepseek_v2.py, no shared-expert fusion)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        attn = ["kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
        if config.q_lora_rank is not None:
            attn += ["fused_qkv_a_proj_with_mqa.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
        else:
            attn += ["q_proj.weight", "kv_a_proj_with_mqa.weight"]
        names += [p + "self_attn." + s for s in attn]
        if i >= config.first_k_dense_replace:
            names += [
                p + s
                for s in (
                    "mlp.gate.weight",
                    "mlp.gate.e_score_correction_bias",
                    "mlp.experts.w13_weight",
                    "mlp.experts.w2_weight",
                    "mlp.shared_experts.gate_up_proj.weight",
                    "mlp.shared_experts.down_proj.weight",
                )
            ]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


def _load(config, weights: list[tuple[str, torch.Tensor]]):
    """Run SGLang's ``DeepseekV3ForCausalLM.load_weights`` on a stand-in ``self`` that records every load;
    returns (the load log, the weight names ``post_load_weights`` was given)."""
    module = REAL.models.get("deepseek_v2")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: deepseek_v2 does not import: {REAL.errors}")
    cls = module.DeepseekV3ForCausalLM
    log: list = []
    params = {n: _Recorded(n, log) for n in sglang_param_names(config)}
    post: list = []
    fake = SimpleNamespace(
        config=config,
        quant_config=None,
        num_fused_shared_experts=0,
        model=SimpleNamespace(),
        pp_group=SimpleNamespace(is_last_rank=True, is_first_rank=True),
        named_parameters=lambda: iter(params.items()),
        post_load_weights=lambda is_nextn=False, weight_names=None: post.append(list(weight_names or [])),
    )
    for attr in ("do_load_weights", "_initialize_nextn_conf", "_maybe_quant_weights_to_fp8_ue8m0"):
        if hasattr(cls, attr):
            setattr(fake, attr, types.MethodType(getattr(cls, attr), fake))
    cls.load_weights(fake, weights)
    return params, log, post


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        tiny_deepseek_model(seed=i, **kw).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sglang_real_deepseek_load_weights_consumes_the_tables_names(folders, variant):
    """The table's HF names are the checkpoint's file names, SGLang routes every one of them to a parameter
    and every parameter receives all its shards; the fused q_a/kv_a parameter gets ``cat([q_a, kv_a])``
    and every layer's ``kv_b_proj`` reaches ``post_load_weights`` (w_kc / w_vc)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folders[variant])
    table = ConversionTable(Architecture.from_hf(folders[variant]))
    files = read_hf_tensors(folders[variant])
    assert set(table.hf_names()) == set(files), sorted(set(table.hf_names()) ^ set(files))[:6]
    for name, t in files.items():
        assert table.hf_shape(name) == tuple(t.shape), name
    params, log, post = _load(config, [(n, files[n]) for n in table.hf_names()])
    hits = Counter(name for name, *_ in log)
    experts = config.n_routed_experts
    for name in params:
        want = 1
        if name.endswith("gate_up_proj.weight"):
            want = 2
        elif name.endswith("experts.w13_weight"):
            want = 2 * experts
        elif name.endswith("experts.w2_weight"):
            want = experts
        assert hits[name] == want, f"{name}: {hits[name]} shards loaded, expected {want}"
    assert set(hits) == set(params)
    for name, _, _, loaded in log:
        if name.endswith("fused_qkv_a_proj_with_mqa.weight"):
            p = name.removesuffix("fused_qkv_a_proj_with_mqa.weight")
            want = torch.cat([files[p + "q_a_proj.weight"], files[p + "kv_a_proj_with_mqa.weight"]])
            assert torch.equal(loaded, want), name
    kv_b = {n for n in post[0] if n.endswith("kv_b_proj.weight")}
    assert kv_b == {f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(config.num_hidden_layers)}


def test_sglang_real_deepseek_drops_a_q_a_proj_whose_kv_a_comes_in_another_call(folders):
    """SGLang's constraint on weight sync: a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` must travel in
    the same ``load_weights`` call (one update request); split over two, neither is loaded (silently)."""
    from transformers import AutoConfig

    folder = folders["q_lora+moe"]
    config = AutoConfig.from_pretrained(folder)
    files = read_hf_tensors(folder)
    q_a, kv_a = (
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    )
    _, log_q, _ = _load(config, [(q_a, files[q_a])])
    _, log_kv, _ = _load(config, [(kv_a, files[kv_a])])
    assert log_q == [] and log_kv == []
    _, log_both, _ = _load(config, [(q_a, files[q_a]), (kv_a, files[kv_a])])
    assert [n for n, *_ in log_both] == ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"]


def test_sglang_real_deepseek_skips_mtp_layers(folders):
    """Names of layers >= num_hidden_layers (the hub's MTP layer) load nothing in the policy's model: the
    table does not list them, and SGLang would drop them anyway."""
    from transformers import AutoConfig

    folder = folders["q_proj+dense"]
    config = AutoConfig.from_pretrained(folder)
    table = ConversionTable(Architecture.from_hf(folder))
    layers = {int(n.split(".")[2]) for n in table.hf_names() if n.startswith("model.layers.")}
    assert layers == set(range(config.num_hidden_layers))
    mtp = f"model.layers.{config.num_hidden_layers}.self_attn.kv_b_proj.weight"
    files = read_hf_tensors(folder)
    _, log, _ = _load(config, [(mtp, files["model.layers.0.self_attn.kv_b_proj.weight"])])
    assert log == []


def test_sglang_real_deepseek_loads_every_fused_q_a_kv_a_when_synced_in_small_buckets(folders):
    """The weight sync's buckets (``buckets.bucketize``, here 2 kB: a few tensors each) never split a layer's
    q_a/kv_a pair, so SGLang's loader, called once per bucket as an update request does, loads every
    layer's fused parameter (split, it would load none of them and say nothing)."""
    from transformers import AutoConfig

    from srpo_megatron.buckets import bucketize

    folder = folders["q_lora+moe"]
    config = AutoConfig.from_pretrained(folder)
    table = ConversionTable(Architecture.from_hf(folder))
    files = read_hf_tensors(folder)
    fused = []
    buckets = list(bucketize(((n, files[n]) for n in table.hf_names()), 2048))
    assert len(buckets) > 3 * config.num_hidden_layers
    for bucket in buckets:
        _, log, _ = _load(config, bucket)
        fused += [n for n, *_ in log if n.endswith("fused_qkv_a_proj_with_mqa.weight")]
    assert sorted(fused) == [
        f"model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa.weight"
        for i in range(config.num_hidden_layers)
    ]
