"""The hub FILE names of a transformers model's tensors, as writable views of its in-memory parameters.

transformers >= 5 holds each Qwen3-MoE layer's experts fused: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(expert ``e``'s gate rows ``[:I]``, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, while
``save_pretrained`` and every weight sync speak the per-expert file names
(``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj``). ``file_format_params`` maps
each file name to a view into the fused parameter, so copying a file tensor into its view updates the model
in place; models without fused experts (and older transformers) come back unchanged.
"""

from __future__ import annotations

import torch

_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def file_format_params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a model's ``state_dict(keep_vars=True)``) with fused expert tensors replaced by per-expert
    views under their file names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(_GATE_UP) and tensor.dim() == 3:
            base = name[: -len("gate_up_proj")]
            for e in range(tensor.shape[0]):
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith(_DOWN) and tensor.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


_GPT_OSS_FUSED = (
    "mlp.experts.gate_up_proj",
    "mlp.experts.gate_up_proj_bias",
    "mlp.experts.down_proj",
    "mlp.experts.down_proj_bias",
)


def gpt_oss_slice_params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss: ``state`` with each fused expert tensor ``x`` ``[E, ...]`` (fused in memory AND in the hub
    files: ``gate_up_proj`` ``[E, H, 2F]`` interleaved, its bias, ``down_proj`` ``[E, F, H]``, its bias)
    replaced by the conversion table's per-expert names ``x[e]`` (what every weight sync sends), as views."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(_GPT_OSS_FUSED):
            out.update({f"{name}[{e}]": tensor[e] for e in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return out
