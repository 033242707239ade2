"""SDPACoreAttention's sinks and sliding windows against HF gpt-oss's eager attention (values and the
gradients of q, k, v and the sinks), on the padded path and the packed THD path, per megatron layer number."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from srpo_megatron.models.attention import SDPACoreAttention

HEADS, GROUPS, DIM, WINDOW = 4, 2, 8, 3


def _attention(layer_number: int, *, sinks: bool = True, window: bool = True) -> SDPACoreAttention:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        softmax_type="learnable" if sinks else "vanilla",
        window_size=(WINDOW - 1, 0) if window else None,
        window_attn_skip_freq=[1, 0] if window else None,  # layer 1 sliding, layer 2 full (1-based)
    )
    attn = SDPACoreAttention(config, layer_number, AttnMaskType.causal, "self")
    if sinks:
        with torch.no_grad():
            attn.softmax_offset.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(layer_number))
    return attn


class _HFModule(torch.nn.Module):
    """What HF's eager_attention_forward reads from its module."""

    def __init__(self, sinks: torch.Tensor):
        super().__init__()
        self.sinks, self.num_key_value_groups, self.training = sinks, HEADS // GROUPS, False


def _hf(q, k, v, sinks, window):
    """HF eager gpt-oss attention; q/k/v ``[b, heads, s, d]`` -> ``[b, s, heads, d]``."""
    s = q.size(2)
    pos = torch.arange(s)
    if window:
        fn = sliding_window_causal_mask_function(WINDOW)
        zero = torch.tensor(0)
        allowed = fn(zero, zero, pos[:, None], pos[None, :])
    else:
        allowed = pos[:, None] >= pos[None, :]
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(_HFModule(sinks), q, k, v, mask, scaling=DIM**-0.5)
    return out


def _inputs(b: int, s: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HEADS, s, DIM, generator=gen).requires_grad_()
    k = torch.randn(b, GROUPS, s, DIM, generator=gen).requires_grad_()
    v = torch.randn(b, GROUPS, s, DIM, generator=gen).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("layer_number,window", [(1, True), (2, False)], ids=["sliding", "full"])
def test_padded_path_matches_hf_values_and_grads(layer_number, window):
    attn = _attention(layer_number)
    assert (attn.window_left is not None) == window
    q, k, v = _inputs(2, 9, seed=layer_number)
    sinks_hf = attn.softmax_offset.detach().clone().requires_grad_()
    want = _hf(q, k, v, sinks_hf, window)  # [b, s, heads, d]
    grad = torch.randn_like(want)
    (want * grad).sum().backward()
    ref = [t.grad.clone() for t in (q, k, v, sinks_hf)]
    for t in (q, k, v):
        t.grad = None
    got = attn(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), None)  # [s, b, heads*d]
    got = got.reshape(9, 2, HEADS, DIM).transpose(0, 1)
    (got * grad).sum().backward()
    assert (got - want).abs().max().item() <= 1e-6
    for name, a, b in zip("qkv", (q.grad, k.grad, v.grad), ref[:3], strict=True):
        assert (a - b).abs().max().item() <= 1e-6, name
    assert (attn.softmax_offset.grad - ref[3]).abs().max().item() <= 1e-6


def test_packed_thd_path_equals_each_sequence_alone():
    """Two sequences packed end to end (THD): each attends only its own window, as it would alone."""
    attn = _attention(1)
    lengths = [5, 7]
    qs, ks, vs = zip(*(_inputs(1, n, seed=10 + n) for n in lengths), strict=True)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )

    def thd(ts):  # [1, heads, n, d] each -> [t, heads, d]
        return torch.cat([t[0].transpose(0, 1) for t in ts])

    packed = attn(thd(qs), thd(ks), thd(vs), None, packed_seq_params=params)  # [t, heads*d]
    grad = torch.randn_like(packed)
    (packed * grad).sum().backward()
    packed_grads = [torch.cat([t.grad[0].transpose(0, 1) for t in ts]) for ts in (qs, ks, vs)]
    sink_grad = attn.softmax_offset.grad.clone()
    attn.softmax_offset.grad = None
    for ts in (qs, ks, vs):
        for t in ts:
            t.grad = None
    alone = torch.cat(
        [
            attn(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), None)[:, 0]
            for q, k, v in zip(qs, ks, vs, strict=True)
        ]
    )
    (alone * grad).sum().backward()
    assert (packed - alone).abs().max().item() <= 1e-6
    for got, ts in zip(packed_grads, (qs, ks, vs), strict=True):
        want = torch.cat([t.grad[0].transpose(0, 1) for t in ts])
        assert (got - want).abs().max().item() <= 1e-6
    assert (sink_grad - attn.softmax_offset.grad).abs().max().item() <= 1e-6


def test_vanilla_layers_keep_sdpa():
    attn = _attention(2, sinks=False, window=True)  # layer 2 is a full layer: nothing explicit
    assert attn.softmax_offset is None and attn.window_left is None and not attn.explicit
