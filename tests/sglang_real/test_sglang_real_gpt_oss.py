"""gpt-oss against SGLang's own ``GptOssForCausalLM.load_weights`` (bf16: ``_load_normal_weights``;
marker ``sglang_real``, skipped without an sglang wheel on the path).

The engine's manifest (``hf_manifest``, from the conversion table) is the checkpoint's FILE names:
the fused per-layer expert tensors whole. SGLang routes every one of them to a parameter of its model:
``mlp.experts.gate_up_proj`` [E, H, 2F] to ``w13_weight`` (transposed by SGLang to [E, 2F, H]), its bias to
``w13_weight_bias``, ``down_proj`` [E, F, H] to ``w2_weight`` ([E, H, F]), ``self_attn.sinks`` to the sinks,
q/k/v to ``qkv_proj``, the router (weight and bias) to ``mlp.router``. SGLang's models cannot be built on
CPU, so the parameter names below are this file's reading of gpt_oss.py; SGLang's own renaming must land on
them or the test fails."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.testing import sglang_import
from tests.helpers.conversion import read_hf_tensors

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )


class _Recorded:
    """A parameter of SGLang's model recording what ``load_weights`` routes to it (and the shape)."""

    def __init__(self, name: str, log: list, numel: int = 0, tensors: dict | None = None) -> None:
        self.name, self.log, self._numel, self.tensors = name, log, numel, tensors
        self.data = SimpleNamespace(copy_=lambda t: self._record(None, t))

    def _record(self, shard, t) -> None:
        self.log.append((self.name, shard, tuple(t.shape)))
        if self.tensors is not None:
            self.tensors[(self.name, shard)] = t.clone()

    def numel(self) -> int:
        return self._numel

    def weight_loader(self, param, loaded, *args, **kwargs):
        shard = kwargs.get("shard_id", args[1] if len(args) > 1 else (args[0] if args else None))
        self._record(shard, loaded)


def sglang_param_names(config) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        names += [
            p + "self_attn." + s for s in ("qkv_proj.weight", "qkv_proj.bias", "o_proj.weight", "o_proj.bias")
        ]
        names += [p + "self_attn.sinks", p + "mlp.router.weight", p + "mlp.router.bias"]
        names += [
            p + "mlp.experts." + s for s in ("w13_weight", "w13_weight_bias", "w2_weight", "w2_weight_bias")
        ]
    return names


def _fake_params(config, log: list, tensors: dict | None = None) -> dict:
    heads = config.num_attention_heads
    return {
        n: _Recorded(n, log, numel=heads if n.endswith("sinks") else 0, tensors=tensors)
        for n in sglang_param_names(config)
    }


def _sglang_load(module, config, params: dict, requests: list) -> None:
    """SGLang's own ``GptOssForCausalLM.load_weights`` on a stand-in model of ``params``, once per request
    (a weight-sync bucket is one ``load_weights`` call)."""
    cls = module.GptOssForCausalLM
    fake = SimpleNamespace(
        config=config,
        quant_config=None,
        model=SimpleNamespace(),
        named_parameters=lambda: iter(params.items()),
        get_submodule=lambda name: SimpleNamespace(qkv_proj=SimpleNamespace(tp_group=None), moe_tp_rank=0),
    )
    fake._get_default_weight_mapping = lambda: cls._get_default_weight_mapping(fake)
    fake._load_normal_weights = lambda *a, **k: cls._load_normal_weights(fake, *a, **k)
    try:
        for weights in requests:
            cls.load_weights(fake, weights)
    except AssertionError as e:  # sglang 0.5.15's loader reads its own distributed state
        if "is not initialized" in str(e):
            pytest.skip(f"sglang {REAL.version}: gpt_oss load_weights needs SGLang's process groups ({e})")
        raise


@pytest.fixture(scope="module")
def oss_folder(tmp_path_factory):
    from srpo_megatron.testing.tiny import tiny_gpt_oss_model

    folder = tmp_path_factory.mktemp("oss") / "gpt_oss"
    tiny_gpt_oss_model(seed=0).save_pretrained(folder)
    return folder


def test_sglang_real_gpt_oss_load_weights_consumes_the_manifest(oss_folder):
    from transformers import AutoConfig

    module = REAL.models.get("gpt_oss")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: sglang.srt.models.gpt_oss does not import: {REAL.errors}")
    config = AutoConfig.from_pretrained(oss_folder)
    files = read_hf_tensors(oss_folder)
    manifest = hf_manifest(str(oss_folder))
    assert manifest == {n: tuple(t.shape) for n, t in files.items()}, (
        "the manifest is the file names and shapes"
    )
    e, h, f = config.num_local_experts, config.hidden_size, config.intermediate_size
    assert manifest["model.layers.0.mlp.experts.gate_up_proj"] == (e, h, 2 * f)
    assert manifest["model.layers.0.mlp.experts.down_proj"] == (e, f, h)
    log: list = []
    params = _fake_params(config, log)
    _sglang_load(module, config, params, [[(n, files[n].clone()) for n in manifest]])
    hits = Counter(name for name, _, _ in log)
    for name in params:
        want = 3 if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias") else 1
        assert hits[name] == want, f"{name}: {hits[name]} loads, expected {want}"
    assert sum(hits.values()) == len(manifest), "every name reaches exactly one parameter"
    shapes = {n: s for n, _, s in log}
    assert shapes["model.layers.0.mlp.experts.w13_weight"] == (
        e,
        2 * f,
        h,
    )  # SGLang transposes the fused tensor
    assert shapes["model.layers.0.mlp.experts.w2_weight"] == (e, h, f)
    assert shapes["model.layers.0.mlp.experts.w13_weight_bias"] == (e, 2 * f)
    assert shapes["model.layers.0.self_attn.sinks"] == (config.num_attention_heads,)


def test_sglang_real_gpt_oss_loads_the_trainers_fused_stream(oss_folder):
    """The trainer's export at EP 2 (per-expert slices ``x[e]``, EP rank order), fused on the sender
    (``weights.fused_experts``) and bucketed as the SGLang syncs do (``flat_buckets``, one ``load_weights``
    per bucket): SGLang's loader routes every tensor to its parameter once, and each expert parameter gets
    the checkpoint's fused tensor (transposed by SGLang where it transposes). The slices themselves are not
    SGLang names: its loader drops them without a word (no expert parameter loaded), hence the engine's
    gate refuses them (``tests/unit/test_fused_experts.py``)."""
    import torch
    from transformers import AutoConfig

    from srpo_megatron.buckets import flat_buckets
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.weights.fused_experts import fuse_expert_slices
    from tests.helpers.fused_experts import export_stream

    module = REAL.models.get("gpt_oss")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: sglang.srt.models.gpt_oss does not import: {REAL.errors}")
    config = AutoConfig.from_pretrained(oss_folder)
    files = read_hf_tensors(oss_folder)
    table = ConversionTable(Architecture.from_hf(oss_folder))
    manifest = hf_manifest(str(oss_folder))
    buckets = flat_buckets(fuse_expert_slices(export_stream(table, files, ep=2), table), 4096)
    requests = [[(n, t.clone()) for n, t in b.views()] for b in buckets]
    assert sorted(n for r in requests for n, _ in r) == sorted(manifest)
    log: list = []
    tensors: dict = {}
    _sglang_load(module, config, _fake_params(config, log, tensors), requests)
    hits = Counter(name for name, _, _ in log)
    assert sum(hits.values()) == len(manifest), "every name reaches exactly one parameter"
    for i in range(config.num_hidden_layers):
        p = x = f"model.layers.{i}.mlp.experts."  # SGLang's parameters (p), the checkpoint's names (x)
        w13 = next(t for (n, _), t in tensors.items() if n == p + "w13_weight")
        assert torch.equal(w13, files[x + "gate_up_proj"].transpose(-2, -1))
        w2 = next(t for (n, _), t in tensors.items() if n == p + "w2_weight")
        assert torch.equal(w2, files[x + "down_proj"].transpose(-2, -1))
        for param, hf in (("w13_weight_bias", "gate_up_proj_bias"), ("w2_weight_bias", "down_proj_bias")):
            assert torch.equal(next(t for (n, _), t in tensors.items() if n == p + param), files[x + hf])

    sliced = [t for q in export_stream(table, files, ep=2) for t in q.fetch()]
    assert any(n.endswith("gate_up_proj[1]") for n, _ in sliced)
    log = []
    _sglang_load(module, config, _fake_params(config, log), [sliced])
    assert not [n for n, _, _ in log if ".mlp.experts." in n], "SGLang loaded an expert from slices"
