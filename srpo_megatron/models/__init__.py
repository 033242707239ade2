"""Policy models: HF config -> megatron-core TransformerConfig, layer specs and GPTModel.

GPTModel vs HybridModel (megatron-core 0.19)
--------------------------------------------
megatron-core 0.19 logs "GPTModel IS DEPRECATED ... only accepting critical bug fixes" and points to
``megatron.core.models.hybrid.hybrid_model.HybridModel`` (Megatron-LM
``docs/user-guide/hybrid-model-migration.md``). The policy stays on ``GPTModel`` for now; this is what
moving it takes, read from the 0.19.2 sources and the migration guide.

- Specs. HybridModel takes one ``hybrid_stack_spec`` (a ``HybridStack`` with one spec per layer family)
  and a ``hybrid_layer_pattern``; one symbol is one layer, so each GPT block becomes two layers: ``*``
  (a ``TransformerLayer`` holding only ``self_attention``) and ``-`` (an ``MLPLayer`` holding only the
  ``mlp``; ``E`` for MoE). A dense N-layer policy is ``"*-" * N`` and ``num_layers`` is 2N. megatron's
  only stack spec (``hybrid_layer_specs.hybrid_stack_spec``) is Transformer Engine throughout (norms
  fused into ``linear_qkv``/``linear_fc1``); the CPU path needs our own local stack spec: a ``*`` layer
  with ``input_layernorm`` + local linears + :class:`~srpo_megatron.models.attention.SDPACoreAttention`
  and a ``-`` layer with ``pre_mlp_layernorm`` + the local MLP, the same modules ``policy.layer_spec``
  uses today.
- Checkpoint layout. GPT layer ``i`` splits into hybrid layers ``2i`` and ``2i+1``:
  ``decoder.layers.{i}.self_attention.*`` (and ``input_layernorm``) -> ``decoder.layers.{2i}.*``,
  ``decoder.layers.{i}.mlp.*`` (and ``pre_mlp_layernorm``) -> ``decoder.layers.{2i+1}.*``, and
  ``decoder.final_layernorm`` -> ``decoder.final_norm``; embedding and output layer keep their names.
  Existing GPT ``torch_dist`` checkpoints need not be rewritten: 0.19's
  ``dist_checkpointing/gpt_checkpoint_interop.py`` retargets a HybridModel's sharded state dict at a GPT
  checkpoint's keys on load (optimizer state too when saved model-space reshardable); a checkpoint saved
  by a HybridModel does not load into a GPTModel.
- Conversion table names (``conversion/table.py``). Every per-layer row's megatron name changes layer
  index as above (``layers.{i}`` -> ``layers.{2i}`` for q/k/v, o, ``input_layernorm``, q/k norms;
  ``layers.{2i+1}`` for gate/up/down and ``pre_mlp_layernorm``), ``final_layernorm`` becomes
  ``final_norm``, and the TE aliases become ``layers.{2i}.self_attention.linear_qkv.layer_norm_weight``
  and ``layers.{2i+1}.mlp.linear_fc1.layer_norm_weight``. The HF side, the QKV/gate-up packing and the
  streamed writer are unchanged; weight sync to SGLang uses the same table, so it follows.
- Pipeline layout. Stages come from the pattern: ``|`` marks stage boundaries (``"*-*-|*-*-"``), or
  without ``|`` the layers are sliced evenly (``num_layers_in_first/last_pipeline_stage`` for uneven
  splits); an even PP split of 2N hybrid layers equals today's split of N GPT layers only when each
  stage gets whole ``*-`` pairs, so the builder should always write the ``|`` boundaries itself.
  ``vp_stage`` works as today.

Why not yet, and what triggers the move:

1. megatron-core 0.16.1, the CI baseline (the newest release for Python 3.11), has no HybridModel, so
   the policy needs GPTModel anyway; a second builder would be dead code on CPU CI for the reason below.
2. HybridModel cannot be built without Transformer Engine in 0.19.2: ``HybridStack`` creates its final
   norm as ``TENorm`` whatever the spec says, and ``TENorm`` raises ImportError without TE. On CPU (no
   TE) the identical-logits-and-grads test cannot run without patching megatron, which the project
   does not do.
3. HybridModel takes no ``rope_scaling``/``rope_scaling_factor``, so Llama-3.x RoPE scaling (which
   ``build_policy`` passes to GPTModel) has no equivalent; only linear interpolation and YaRN.

The move is due when (a) a megatron-core release builds ``HybridStack``'s final norm from the spec (or
CI gains TE), so the GPTModel-vs-HybridModel logits/grads check can run in CI, and (b) HybridModel
accepts llama3 RoPE scaling, or (c) GPTModel is removed or misses a fix the policy needs; then the
tested range's floor moves to >= 0.19. ``tests/unit/test_mcore_versions.py`` pins the deprecation and
HybridModel's presence per version, so a release that changes either shows up in CI.
"""

from srpo_megatron.models.architecture import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    Architecture,
    UnsupportedModelError,
    padded_vocab_size,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "Architecture",
    "UnsupportedModelError",
    "padded_vocab_size",
]
