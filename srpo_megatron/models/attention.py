"""Core attention for megatron-core's local layer spec that runs anywhere torch runs (CPU included).

``SDPACoreAttention`` is a drop-in for the spec's ``core_attention`` slot (same constructor and forward
signature as ``megatron.core.transformer.dot_product_attention.DotProductAttention``). It calls
``torch.nn.functional.scaled_dot_product_attention`` with a causal mask and native GQA, so it needs no
CUDA buffers (megatron's DotProductAttention preallocates from ``torch.cuda.current_device()``) and no
materialised repeat of K/V heads. It has no parameters. Dropout is not supported (RL policies train
with attention dropout 0; the config loader rejects anything else).
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention via SDPA. Shapes follow megatron: sequence-first, heads local to the TP rank."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPACoreAttention does not support context parallelism; set context_parallel_size=1"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"SDPACoreAttention does not implement attention dropout (got {dropout}); set it to 0"
            )
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> context ``[sq, b, np*hn]``.

        ``attention_mask`` follows megatron's convention (bool, True = masked out, ``[b, 1, sq, sk]``);
        when it is None the mask type decides (causal for decoder self-attention).
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPACoreAttention supports neither packed sequences nor attention bias"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None if attention_mask is None else ~attention_mask
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        if causal and q.size(2) != k.size(2):
            raise NotImplementedError("causal SDPA attention needs equal query and key lengths (no KV cache)")
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1),
        )
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
