"""LoRA adapters out of the trainer: a PEFT adapter folder (write and read), and the merge into HF weights.

PEFT folder (what ``peft.PeftModel.from_pretrained(base, folder)`` loads; peft 0.21's ``save_pretrained``
writes the same two files)::

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules, bias none,
                                 task_type CAUSAL_LM, base_model_name_or_path
    adapter_model.safetensors    base_model.model.<HF module>.lora_{A,B}.weight (no adapter name in keys)

:func:`write_peft_folder` takes ``{megatron adapter name: full tensor}`` (the names of ``lora_table.py``);
:func:`read_peft_folder` gives it back. ``lora_alpha`` is written as given, so PEFT's scaling ``alpha / r``
is the trainer's ``LoraConfig.scaling`` (no rsLoRA).

Merge: :func:`merge_lora` is the pure math on HF-named tensors, ``W' = W + (alpha/r) * B @ A`` per adapted
module, accumulated in fp32 (fp64 for fp64 weights) and cast back to W's dtype; :func:`merge_hook` applies it
to one HF tensor at a time, as the streaming export writes them.

Routed experts (Qwen3-MoE): transformers 5 holds a layer's experts as two fused 3-D parameters
(``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``down_proj`` ``[E, H, F]``), not per-expert ``nn.Linear``, so
PEFT's ``target_modules`` cannot name an expert's ``gate_proj``. peft 0.21 reaches them through
``target_parameters`` (``lora.ParamWrapper``: one adapter per 3-D parameter, ``lora_A`` ``[E*r, in]``
expert-major, ``lora_B`` ``[out, r*E]`` expert-minor, delta ``B[:, :, e] @ A[e]``). The trainer's separate
gate and up adapters fit it exactly as a rank-2r adapter per expert, A = ``[A_gate; A_up]``, B =
``blockdiag(B_gate, B_up)``, with ``rank_pattern``/``alpha_pattern`` 2r/2alpha so the scaling stays
alpha/r (:func:`pack_experts`, :func:`expert_target_parameters`); ParamWrapper takes no dropout, so such a
folder says ``lora_dropout: 0`` (dropout is off at inference). Other families' expert adapters are refused
(:func:`check_peft_exportable`). The merged export covers experts per expert (the checkpoint files name
them one by one, ``mlp.experts.{e}.gate_proj.weight``).

Checkpoints: :func:`checkpoint_lora_config` reads the ``lora`` section of a trainer checkpoint's
``recipe.yaml``, :func:`read_checkpoint_lora` the adapters at full shape through a reader that finds each
one as named or stacked over layers / layers and experts (``conversion/checkpoint.stored_adapter_keys``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_table import LoraTable, LoraTableError
from srpo_megatron.conversion.output_guard import ConversionInputError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RECIPE_FILE = "recipe.yaml"  # the trainer checkpoint's recipe (trainer/run/checkpoint.py)


def peft_adapter_config(lora: LoraConfig, targets: list[str], base_model: str | None) -> dict:
    """The ``adapter_config.json`` of PEFT's ``LoraConfig`` for these adapters (only the targets present)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def check_peft_exportable(table: LoraTable) -> None:
    """Refuse expert adapters in a PEFT folder (see the module docstring), in one line."""
    experts = [r.megatron for r in table._rows.values() if r.expert]
    if experts and table.arch.model_type != "qwen3_moe":
        raise LoraTableError(
            f"cannot write a PEFT folder with {table.arch.model_type}'s routed-expert adapters "
            f"({len(experts)}, e.g. {experts[0]}): "
            "transformers 5 fuses the experts into 3-D parameters that PEFT's target_modules cannot name "
            "(and its target_parameters share one A between gate and up); export merged weights instead "
            "(--out-dir), or train with lora.experts: false"
        )


# Qwen3-MoE experts through peft's target_parameters (one ParamWrapper per fused 3-D parameter, nested in
# this order: gate_up_proj is the inner one, its tensors named ``experts.base_layer.lora_*``).
_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def expert_target_parameters(lora: LoraConfig) -> dict:
    """The adapter_config.json keys for Qwen3-MoE expert adapters: gate_up_proj at rank 2r (gate's and up's
    A stacked, B block-diagonal) with alpha 2*alpha, so its scaling stays alpha/r; ParamWrapper takes no
    dropout (it is inactive at inference anyway)."""
    return {
        "target_parameters": [_GATE_UP, _DOWN],
        "rank_pattern": {"gate_up_proj": 2 * lora.rank},
        "alpha_pattern": {"gate_up_proj": 2 * lora.alpha},
        "lora_dropout": 0.0,
    }


def pack_experts(table: LoraTable, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert megatron adapters -> peft ParamWrapper tensors per MoE layer: ``lora_A`` ``[E*r', in]``
    (expert-major), ``lora_B`` ``[out, r'*E]`` (expert-minor: ``reshape(out, r', E)[:, :, e]`` is expert e's),
    as ``ParamWrapper.get_delta_weight`` reads them (peft 0.21, tuners/lora/layer.py)."""
    r, out = table.lora.rank, {}
    experts = range(table.arch.num_experts)
    for i in sorted({int(n.split(".")[2]) for n in adapters if table.row(n).expert}):

        def get(e: int, proj: str, f: str, i: int = i) -> torch.Tensor:
            lin = "linear_fc2" if proj == "down_proj" else "linear_fc1"
            return adapters[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{lin}.lora.{proj}.lora_{f}"]

        a_gu = torch.cat([torch.cat([get(e, "gate_proj", "A"), get(e, "up_proj", "A")]) for e in experts])
        blocks = [torch.block_diag(get(e, "gate_proj", "B"), get(e, "up_proj", "B")) for e in experts]
        b_gu = torch.stack(blocks, dim=-1).reshape(blocks[0].shape[0], 2 * r * len(blocks))  # [2F, 2r*E]
        b_d = torch.stack([get(e, "down_proj", "B") for e in experts], dim=-1)
        h = f"base_model.model.model.layers.{i}.mlp.experts."
        out[h + "base_layer.lora_A.weight"], out[h + "base_layer.lora_B.weight"] = a_gu, b_gu
        out[h + "lora_A.weight"] = torch.cat([get(e, "down_proj", "A") for e in experts])
        out[h + "lora_B.weight"] = b_d.reshape(b_d.shape[0], -1)
    return out


def unpack_experts(table: LoraTable, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_experts`: ``{megatron name: tensor}`` of the expert adapters in ``tensors``."""
    r, n_exp, out = table.lora.rank, table.arch.num_experts, {}
    for name, a_gu in tensors.items():
        if not name.endswith(".mlp.experts.base_layer.lora_A.weight"):
            continue
        h = name.removesuffix("base_layer.lora_A.weight")
        i = int(h.split(".layers.")[1].split(".")[0])
        b_gu = tensors[h + "base_layer.lora_B.weight"].reshape(-1, 2 * r, n_exp)
        a_d, b_d = tensors[h + "lora_A.weight"], tensors[h + "lora_B.weight"].reshape(-1, r, n_exp)
        f = b_gu.shape[0] // 2
        for e in range(n_exp):
            stem = f"decoder.layers.{i}.mlp.experts.local_experts.{e}."
            a = a_gu[e * 2 * r : (e + 1) * 2 * r]
            out[stem + "linear_fc1.lora.gate_proj.lora_A"] = a[:r].contiguous()
            out[stem + "linear_fc1.lora.up_proj.lora_A"] = a[r:].contiguous()
            out[stem + "linear_fc1.lora.gate_proj.lora_B"] = b_gu[:f, :r, e].contiguous()
            out[stem + "linear_fc1.lora.up_proj.lora_B"] = b_gu[f:, r:, e].contiguous()
            out[stem + "linear_fc2.lora.down_proj.lora_A"] = a_d[e * r : (e + 1) * r].contiguous()
            out[stem + "linear_fc2.lora.down_proj.lora_B"] = b_d[:, :, e].contiguous()
    return out


def _check_names(table: LoraTable, names: set[str], where: str) -> None:
    want = set(table.megatron_names())
    missing, extra = sorted(want - names), sorted(names - want)
    if missing or extra:
        raise LoraTableError(
            f"{where}: adapters do not match the LoRA table (target_modules={table.lora.target_modules}): "
            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)}), "
            f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''} ({len(extra)})"
        )


def write_peft_folder(
    out_dir: str | Path,
    table: LoraTable,
    adapters: Mapping[str, torch.Tensor],
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``adapters`` (``{megatron name: full tensor}``, every adapter of ``table``) as a PEFT folder."""
    from safetensors.torch import save_file

    check_peft_exportable(table)
    _check_names(table, {table.row(n).megatron for n in adapters}, "write_peft_folder")
    tensors = {}
    for name, full in adapters.items():
        if not table.row(name).expert:
            peft_name, t = table.to_peft(name, full)
            tensors[peft_name] = t
    tensors.update(pack_experts(table, adapters))
    tensors = {n: t.to(dtype or t.dtype).contiguous() for n, t in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({table.row(n).target for n in adapters if not table.row(n).expert})
    config = peft_adapter_config(table.lora, targets, base_model)
    if any(table.row(n).expert for n in adapters):
        config.update(expert_target_parameters(table.lora))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def read_peft_config(folder: str | Path) -> LoraConfig:
    """The trainer's ``LoraConfig`` of a PEFT LoRA folder (r, lora_alpha, lora_dropout, target_modules)."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConversionInputError(f"{path} does not exist: point at a PEFT adapter folder")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type") != "LORA" or cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ConversionInputError(
            f"{path}: peft_type={cfg.get('peft_type')!r}, use_rslora={cfg.get('use_rslora')}, "
            f"use_dora={cfg.get('use_dora')}; only plain LoRA (peft_type LORA, no rsLoRA/DoRA) is read"
        )
    experts = bool(cfg.get("target_parameters"))
    if experts and {k: cfg.get(k) for k in ("target_parameters", "rank_pattern", "alpha_pattern")} != {
        k: v for k, v in expert_target_parameters_for(cfg).items() if k != "lora_dropout"
    }:
        raise ConversionInputError(
            f"{path}: target_parameters/rank_pattern/alpha_pattern are not the expert layout this project "
            "writes (lora_export.expert_target_parameters); only such folders are read"
        )
    if not experts and (cfg.get("rank_pattern") or cfg.get("alpha_pattern")):
        raise ConversionInputError(f"{path}: rank_pattern/alpha_pattern are not supported; one r and alpha")
    targets = cfg["target_modules"]
    targets = sorted(targets) if isinstance(targets, list) else [targets]
    if experts:
        targets = sorted(set(targets) | {"gate_proj", "up_proj", "down_proj"})
    return LoraConfig(
        rank=cfg["r"],
        alpha=float(cfg["lora_alpha"]),
        dropout=float(cfg.get("lora_dropout", 0.0)),
        target_modules=targets,
        experts=experts,
    )


def expert_target_parameters_for(cfg: dict) -> dict:
    """:func:`expert_target_parameters` of a folder's own r and lora_alpha."""
    return expert_target_parameters(LoraConfig(rank=cfg["r"], alpha=float(cfg["lora_alpha"])))


def read_peft_folder(folder: str | Path, table: LoraTable) -> dict[str, torch.Tensor]:
    """``{megatron name: full tensor}`` of a PEFT LoRA folder written for ``table``'s model."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConversionInputError(f"{path} does not exist: point at a PEFT adapter folder")
    tensors = load_file(str(path))
    out = unpack_experts(table, tensors)
    out.update(table.to_megatron(n, t) for n, t in tensors.items() if ".mlp.experts." not in n)
    _check_names(table, set(out), str(path))
    return out


def merge_lora(
    hf_weights: Mapping[str, torch.Tensor], peft_tensors: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """``{hf name: W + scaling * B @ A}`` for the adapted modules' weights in ``hf_weights`` (the rest as
    given). ``peft_tensors`` are PEFT-named (``base_model.model.<module>.lora_{A,B}.weight``); every adapted
    module must be in ``hf_weights``."""
    out = dict(hf_weights)
    modules = {n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in peft_tensors}
    for module in sorted(modules):
        w_name = module + ".weight"
        if w_name not in hf_weights:
            raise LoraTableError(f"adapter of {module} has no base weight {w_name} to merge into")
        a = peft_tensors[f"base_model.model.{module}.lora_A.weight"]
        b = peft_tensors[f"base_model.model.{module}.lora_B.weight"]
        out[w_name] = merged_weight(hf_weights[w_name], a, b, scaling)
    return out


def merged_weight(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, cast: bool = True
) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32 (fp64 for fp64 W), cast to W's dtype (``cast``; else left in fp32
    for a writer that casts to the export's dtype)."""
    acc = torch.promote_types(w.dtype, torch.float32)
    out = w.to(acc) + scaling * (b.to(acc) @ a.to(acc))
    return out.to(w.dtype) if cast else out


def merge_hook(
    table: LoraTable, adapters: Mapping[str, torch.Tensor]
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """``hook(hf_name, W)``: W merged with its adapter (in fp32; the writer casts it to the export's dtype)
    when ``hf_name`` is an adapted module's weight, else W."""
    _check_names(table, {table.row(n).megatron for n in adapters}, "merge_hook")
    peft = dict(table.to_peft(n, t) for n, t in adapters.items())
    modules = set(table.hf_modules())

    def hook(hf_name: str, w: torch.Tensor) -> torch.Tensor:
        module = hf_name.removesuffix(".weight")
        if module not in modules:
            return w
        a = peft[f"base_model.model.{module}.lora_A.weight"]
        b = peft[f"base_model.model.{module}.lora_B.weight"]
        return merged_weight(w, a, b, table.lora.scaling, cast=False)

    return hook


def checkpoint_lora_config(ckpt_dir: str | Path) -> LoraConfig | None:
    """The ``lora`` section of a trainer checkpoint's ``recipe.yaml`` (None: no recipe or LoRA off)."""
    import yaml

    from srpo_megatron.config.loading import from_dict

    path = Path(ckpt_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    section = (yaml.safe_load(path.read_text()) or {}).get("lora") or {}
    lora = from_dict(LoraConfig, section, path=f"{path}: lora")
    return lora if lora.enabled else None


def read_checkpoint_lora(
    read: Callable[[str], torch.Tensor], table: LoraTable, prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """``{megatron name: full tensor}`` of ``table``'s adapters, each read as ``read(prefix + name)``
    (``TorchDistReader``: the whole stored tensor)."""
    return {name: read(prefix + name) for name in table.megatron_names()}


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "check_peft_exportable",
    "checkpoint_lora_config",
    "merge_hook",
    "merge_lora",
    "merged_weight",
    "peft_adapter_config",
    "read_checkpoint_lora",
    "read_peft_config",
    "read_peft_folder",
    "write_peft_folder",
]
