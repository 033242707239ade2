"""gpt-oss's megatron TransformerConfig (models/gpt_oss.py) from the tiny config: the fields each HF feature
maps to, and the fusions that stay off whatever the performance overrides ask."""

from __future__ import annotations

import torch

from srpo_megatron.models.architecture import Architecture
from srpo_megatron.models.gpt_oss import alpha_sigmoid_gate
from srpo_megatron.models.policy import transformer_config_from_hf
from srpo_megatron.testing.tiny import TINY_GPT_OSS_LIMIT, TINY_GPT_OSS_WINDOW, tiny_gpt_oss_config


def test_config_fields_and_fusions_off():
    arch = Architecture.from_hf(tiny_gpt_oss_config(num_layers=4))
    cfg = transformer_config_from_hf(arch, bias_activation_fusion=True, bias_dropout_fusion=True)
    assert cfg.softmax_type == "learnable"
    assert cfg.window_size == (TINY_GPT_OSS_WINDOW - 1, 0)  # HF: W keys ending at the query itself
    assert cfg.window_attn_skip_freq == [1, 0, 1, 0]  # HF layer_types: even layers (0-based) slide
    assert cfg.add_bias_linear and cfg.add_qkv_bias
    assert cfg.activation_func_clamp_value == TINY_GPT_OSS_LIMIT and cfg.glu_linear_offset == 1.0
    assert cfg.moe_router_pre_softmax is False  # top-k on the logits, softmax over the k
    assert not cfg.bias_activation_fusion and not cfg.bias_dropout_fusion
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(cfg.activation_func(x), x * torch.sigmoid(1.702 * x))
    assert torch.equal(alpha_sigmoid_gate(x, 0.5), x * torch.sigmoid(0.5 * x))


# ---- expert biases stay out of the sequence-parallel all-reduce, on the local and the TE spec -----------


def test_every_expert_bias_and_only_those_leave_the_sp_reduce(monkeypatch):
    """The pass ``build_policy`` runs for gpt-oss names every routed-expert bias of the built model and no
    other parameter (attention and router biases are ordinary SP/DP parameters)."""
    from srpo_megatron.models import policy
    from srpo_megatron.models.gpt_oss import keep_expert_biases_out_of_the_sp_reduce
    from srpo_megatron.parallel import initialize_model_parallel

    ran = []
    monkeypatch.setattr(policy, "keep_expert_biases_out_of_the_sp_reduce", lambda m: ran.append(m))
    initialize_model_parallel(1, 1)
    model = policy.build_policy(tiny_gpt_oss_config(num_layers=2), use_te=False)
    assert ran == [model]  # build_policy runs the pass on every gpt-oss model, whatever the spec
    biases = {n for n, _ in model.named_parameters() if "bias" in n}
    experts = {n for n in biases if ".mlp.experts." in n}
    assert len(experts) == 2 * 4 * 2  # 2 layers x 4 experts x (fc1, fc2)
    for _, p in model.named_parameters():
        p.sequence_parallel = True  # as an SP build marks them (the stand-in for TE's / megatron's marking)
    assert set(keep_expert_biases_out_of_the_sp_reduce(model)) == experts
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert not marked & experts and (biases - experts) <= marked


def test_te_expert_bias_marks_are_cleared_as_te_and_megatron_leave_them():
    """The TE spec cannot build here (no TE), so a stand-in of TE's ``GroupedLinear`` as the experts'
    ``linear_fc2`` (parameters ``weight0..``/``bias0..``, each row-parallel bias marked ``sequence_parallel``
    as TE's ``reset_parameters`` marks it when its TP size is > 1) and of ``TERowParallelLinear``'s bias
    (megatron 0.19.2 marks it ``config.sequence_parallel`` under CPU initialisation) goes through megatron's
    real ``_set_expert_parameter_attributes`` where this megatron-core has it (0.19.2: every TE expert
    linear runs it), which keeps the mark; ``build_policy``'s pass clears it, and leaves the attention
    projection's bias (a real SP parameter) marked."""
    import torch

    from srpo_megatron.models.gpt_oss import keep_expert_biases_out_of_the_sp_reduce

    def linear(names):
        m = torch.nn.Module()
        for n in names:
            p = torch.nn.Parameter(torch.zeros(4))
            p.sequence_parallel = n.startswith("bias")
            m.register_parameter(n, p)
        return m

    grouped = linear(["weight0", "weight1", "bias0", "bias1"])  # stand-in: TE GroupedLinear (2 experts)
    sequential = linear(["weight", "bias"])  # stand-in: TERowParallelLinear of one local expert
    try:
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
    except ImportError:  # megatron-core 0.16.1 has no such step
        _set_expert_parameter_attributes = None
    if _set_expert_parameter_attributes is not None:
        for m in (grouped, sequential):
            _set_expert_parameter_attributes(m, "row", True)
        assert grouped.bias0.sequence_parallel and sequential.bias.sequence_parallel  # upstream keeps it
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.linear_fc2 = grouped
    layer.mlp.experts.local_experts = torch.nn.ModuleList([torch.nn.Module()])
    layer.mlp.experts.local_experts[0].linear_fc2 = sequential
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_proj = linear(["weight", "bias"])
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    cleared = keep_expert_biases_out_of_the_sp_reduce(model)
    assert sorted(cleared) == [
        "decoder.layers.0.mlp.experts.linear_fc2.bias0",
        "decoder.layers.0.mlp.experts.linear_fc2.bias1",
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias",
    ]
    assert not any(m.sequence_parallel for m in (grouped.bias0, grouped.bias1, sequential.bias))
    assert layer.self_attention.linear_proj.bias.sequence_parallel
