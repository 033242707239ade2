"""The hub's Multi-Token-Prediction layers (GLM-4.5, DeepSeek-V3): skipped on import, re-emitted on export.

GLM-4.5 and DeepSeek-V3 checkpoints ship ``num_nextn_predict_layers`` extra decoder layers after the
``num_hidden_layers`` of the model, as ``model.layers.{L}.*`` .. ``model.layers.{L+n-1}.*`` (their own
attention, MoE, ``enorm``/``hnorm``/``eh_proj`` and ``shared_head``). They serve speculative decoding, not
the policy: the policy is not trained through them, so they are not in the conversion table.

- Import (``checkpoint.hf_to_megatron``) leaves them out with one line of notice and records the source
  folder in ``hf_source.json`` beside ``hf_config.json``; the trainer's checkpoints record their
  ``model.hf_dir`` the same way (``trainer/run/checkpoint.py``).
- Export (``checkpoint.megatron_to_hf``) writes them back unchanged (same names, same values; cast only if
  the export dtype differs from theirs) from that folder, or from an explicit ``mtp_from``, when it has
  them; otherwise it says in one line that the export has no MTP layers. The exported ``config.json``
  keeps ``num_nextn_predict_layers`` either way (transformers does not build the MTP layers; SGLang
  needs them only for speculative decoding with the NextN draft).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from srpo_megatron.models.architecture import Architecture

SOURCE_FILE = "hf_source.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_names(arch: Architecture, names: list[str]) -> list[str]:
    """The names of ``names`` that belong to layers past the model's ``num_layers`` (the MTP layers)."""
    out = []
    for name in names:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= arch.num_layers:
            out.append(name)
    return out


def notice(names: list[str], arch: Architecture, source: Path) -> str:
    """The one line printed when import skips MTP tensors."""
    layers = sorted({int(_LAYER.match(n).group(1)) for n in names})
    return (
        f"skipping {len(names)} MTP tensors of hub layers {layers} (num_nextn_predict_layers="
        f"{arch.mtp_layers}): the MTP head is not part of the policy; export re-emits them from {source}"
    )


def record_source(ckpt_dir: Path, hf_dir: str | Path) -> None:
    """Note the HF folder a checkpoint came from (where export finds the MTP layers)."""
    (Path(ckpt_dir) / SOURCE_FILE).write_text(json.dumps({"hf_dir": str(Path(hf_dir).resolve())}) + "\n")


def recorded_source(ckpt_dir: Path) -> Path | None:
    """The HF folder :func:`record_source` noted for ``ckpt_dir`` (None when none was)."""
    path = Path(ckpt_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    return Path(json.loads(path.read_text())["hf_dir"])
