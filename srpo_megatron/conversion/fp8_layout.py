"""Which HF weights a blockwise-FP8 checkpoint (and SGLang's ``quantization=fp8`` engine) keeps in FP8.

One rule, used by the converter (import: which names carry a ``weight_scale_inv``; export ``--fp8``:
which to quantize), by the weight sync into an FP8 engine (which names go as ``weight`` +
``weight_scale_inv``) and by the start-up refusals. It is the rule of DeepSeek-V3's and Qwen3-FP8's hub
folders and of SGLang's block-FP8 linear method:

- FP8: the 2-D ``.weight`` of every projection inside a decoder layer (``model.layers.<i>.``): attention
  ``q/k/v/o_proj`` and MLA's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``; the
  MLP's and every expert's / shared expert's ``gate_proj``, ``up_proj``, ``down_proj``;
- bf16: embeddings, ``lm_head``, every norm, the MoE router (``mlp.gate.weight``) and its
  ``e_score_correction_bias``, biases, MTP's ``eh_proj`` (a plain ``nn.Linear`` in SGLang's NextN
  model), and any module the config lists in ``modules_to_not_convert`` / ``ignored_layers``.

:class:`Fp8Layout` is read from a folder's ``quantization_config``; a method other than ``fp8`` with
``fmt: e4m3`` and 2-D ``weight_block_size`` is not this layout (the caller refuses it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SCALE_SUFFIX = "_scale_inv"  # ``<name>.weight`` -> ``<name>.weight_scale_inv``
_PROJ = re.compile(r"^model\.layers\.\d+\..*(?<!eh)_proj(_with_mqa)?\.weight$")


@dataclass(frozen=True)
class Fp8Layout:
    """A blockwise-FP8 ``quantization_config``: block size and the modules kept in bf16."""

    block: tuple[int, int] = (128, 128)
    not_converted: tuple[str, ...] = ()  # module-name fragments kept in bf16 (config's lists)

    @classmethod
    def from_quantization_config(cls, qc: dict[str, Any], where: str) -> Fp8Layout:
        """``config.json``'s ``quantization_config`` -> layout; refuses what is not blockwise e4m3 FP8."""
        method = qc.get("quant_method")
        block = qc.get("weight_block_size")
        fmt = qc.get("fmt", "e4m3")
        if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
            raise ValueError(
                f"{where}: quantization_config {{quant_method: {method!r}, fmt: {fmt!r}, weight_block_size: "
                f"{block!r}}} is not blockwise e4m3 FP8 (quant_method fp8, fmt e4m3, weight_block_size "
                "[128, 128]), the only FP8 layout this project reads and writes; convert the folder to "
                "bf16 first or serve a bf16 export (tools/convert_megatron_to_hf.py)"
            )
        skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
        return cls(block=(int(block[0]), int(block[1])), not_converted=skip)

    def is_fp8(self, hf_name: str) -> bool:
        """Whether ``hf_name`` (a full HF parameter name) is stored / served as FP8 + ``weight_scale_inv``."""
        if not _PROJ.match(hf_name):
            return False
        module = hf_name[: -len(".weight")]
        return not any(frag and frag in module for frag in self.not_converted)

    @staticmethod
    def scale_name(hf_name: str) -> str:
        """``...proj.weight`` -> ``...proj.weight_scale_inv``."""
        return hf_name + SCALE_SUFFIX
