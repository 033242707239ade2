"""SGLang's LoRA serving API, as the adapter sync (``lora.sync: adapter``) uses it: the server flags and the
request bodies.

SGLang's LoRA API (read in the real packages, ``sglang/srt/managers/io_struct.py`` and
``entrypoints/http_server.py`` of 0.5.15.post1 and 0.5.23; the offline ``Engine`` has a method per route):

- ``POST /load_lora_adapter_from_tensors`` (``LoadLoRAAdapterFromTensorsReqInput``): ``lora_name``,
  ``config_dict`` (PEFT's ``adapter_config.json`` as a dict), the PEFT-named tensors serialized with
  ``MultiprocessingSerializer`` (``load_format="flattened_bucket"``: one ``FlattenedTensorBucket``, as the
  full-weight sync sends). The field changed between the two releases: 0.5.15.post1 takes ONE string
  ``serialized_tensors`` that every TP rank deserializes; 0.5.23 takes ``serialized_named_tensors``, one
  entry per TP rank (rank i reads entry i, base64 over HTTP) and an optional ``expected_checksums``
  (sha256 per tensor). Each TP rank slices the full A/B itself (``slice_lora_a_weights`` /
  ``slice_lora_b_weights``), so every rank gets the whole adapter.
- ``POST /load_lora_adapter`` (``LoadLoRAAdapterReqInput``): ``lora_name``, ``lora_path`` (a PEFT folder the
  engine can read, e.g. ``tools/convert_megatron_to_hf.py --lora-adapter-out``), ``pinned``: the sync for
  engines on another machine, through a shared filesystem (the same-host tensors above are IPC handles).
- ``POST /unload_lora_adapter`` (``UnloadLoRAAdapterReqInput``): ``lora_name``.
- ``POST /update_weight_version`` (``UpdateWeightVersionReqInput``): ``new_version``; a load stamps no
  version, and every generate checks the version stamped on its outputs (``SGLangEngine``).
- ``GET /v1/models`` lists each loaded adapter as a model card whose ``parent`` is the base model.
- ``/generate`` names the adapter in ``lora_path`` (the loaded ``lora_name``; a string or one per prompt).
  Without it SGLang serves the base model alone; a name it has not loaded fails the request
  (``LoRARegistry.acquire``: "not loaded").

Both releases need the server started with ``--enable-lora --max-lora-rank R --lora-target-modules ...``
when no adapter is given at launch (``check_lora_server_args``), plus ``--max-loras-per-batch`` (the GPU
pool's slots) and ``--max-loaded-loras`` (adapters held at once). A sync loads the new version under a new
name, then unloads the previous one: two adapters are loaded for that moment, one is used per batch.
Loading a name that is loaded fails (``LoRAManager.validate_new_adapter``: "already loaded"); 0.5.23
evicts the least recently used adapter past ``--max-loaded-loras`` instead of refusing the load.
"""

from __future__ import annotations

from typing import Any

from srpo_megatron.config.lora import LoraConfig

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FROM_TENSORS = "/load_lora_adapter_from_tensors"
LOAD_FROM_DISK = "/load_lora_adapter"
UNLOAD = "/unload_lora_adapter"
# 0.5.23's LoadLoRAAdapterFromTensorsReqInput takes one payload per TP rank (serialized_named_tensors),
# 0.5.15.post1's one string for all ranks (serialized_tensors). The releases between were not read: they are
# taken as 0.5.15.post1's; a wrong guess fails SGLang's request parsing, loudly.
PER_RANK_PAYLOADS_SINCE = (0, 5, 23)


class LoraSyncError(ValueError):
    """A LoRA sync that SGLang would refuse (one line naming what and the fix)."""


ADAPTER_PREFIX = "srpo-policy-v"  # every policy adapter's lora_name starts so (the server may hold others)


def adapter_name(weight_version: int) -> str:
    """The ``lora_name`` of the policy's adapter at ``weight_version`` (what ``/generate`` names)."""
    return f"{ADAPTER_PREFIX}{int(weight_version)}"


def policy_adapters(models: Any) -> list[str]:
    """The policy adapters a server holds, from its ``GET /v1/models`` answer (SGLang lists each loaded
    adapter as a model card with a ``parent``, the base model)."""
    cards = models.get("data", []) if isinstance(models, dict) else []
    return [c["id"] for c in cards if c.get("parent") and str(c.get("id", "")).startswith(ADAPTER_PREFIX)]


def lora_server_args(lora: LoraConfig, targets: list[str]) -> dict[str, Any]:
    """The ``ServerArgs`` keywords (``--enable-lora`` ... as flags) an engine needs for adapter syncs:
    ``targets`` are the PEFT names the adapters cover (``LoraTable``), ``max_lora_rank`` the recipe's rank;
    one adapter per batch, two loaded while a sync swaps versions."""
    if not lora.enabled:
        raise LoraSyncError(
            "lora.rank is 0: the engine needs no LoRA flags; set lora.rank > 0 for adapter syncs"
        )
    return {
        "enable_lora": True,
        "max_lora_rank": lora.rank,
        "lora_target_modules": sorted(targets),
        "max_loras_per_batch": 1,
        "max_loaded_loras": 2,
    }


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def per_rank_payloads(sglang_version: str) -> bool:
    """Whether this SGLang release takes one serialized payload per TP rank (``serialized_named_tensors``)."""
    return _version_tuple(sglang_version) >= PER_RANK_PAYLOADS_SINCE


def payloads_needed(sglang_version: str, tp_size: int) -> int:
    """How many serialized payloads a load-from-tensors request carries: one per engine TP rank (0.5.23+),
    or the one string every rank reads (0.5.15.post1)."""
    return tp_size if per_rank_payloads(sglang_version) else 1


def build_load_from_tensors_request(
    lora_name: str,
    config_dict: dict[str, Any],
    payloads: list[str],
    tp_size: int,
    sglang_version: str,
    checksums: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``/load_lora_adapter_from_tensors`` body (== ``Engine.load_lora_adapter_from_tensors`` request) with
    ``payloads_needed`` ``flattened_bucket`` payloads (``protocol.serialize_bucket_per_tp_rank`` of the
    PEFT-named tensors)."""
    if config_dict.get("peft_type") != "LORA" or not config_dict.get("r"):
        raise LoraSyncError(
            f"config_dict for {lora_name} is not a PEFT LoRA config (peft_type="
            f"{config_dict.get('peft_type')!r}, r={config_dict.get('r')!r}); build it with "
            "lora_export.peft_adapter_config"
        )
    need = payloads_needed(sglang_version, tp_size)
    if len(payloads) != need:
        raise LoraSyncError(
            f"sglang {sglang_version} with tp_size={tp_size} reads {need} adapter payload(s) "
            f"({'one per TP rank' if per_rank_payloads(sglang_version) else 'one string for every rank'}), "
            f"got {len(payloads)}; serialize payloads_needed(version, tp_size) of them"
        )
    body: dict[str, Any] = {"lora_name": lora_name, "config_dict": config_dict}
    body["load_format"] = FLATTENED_BUCKET
    if per_rank_payloads(sglang_version):
        body["serialized_named_tensors"] = list(payloads)
        if checksums is not None:
            body["expected_checksums"] = dict(checksums)
        return body
    if checksums is not None:
        raise LoraSyncError(
            f"sglang {sglang_version} has no expected_checksums; drop them (or use sglang >= 0.5.23)"
        )
    body["serialized_tensors"] = payloads[0]
    return body


def build_load_from_disk_request(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    """``/load_lora_adapter`` body: a PEFT folder the engine reads (shared filesystem)."""
    return {"lora_name": lora_name, "lora_path": str(lora_path), "pinned": bool(pinned)}


def build_unload_request(lora_name: str) -> dict[str, Any]:
    """``/unload_lora_adapter`` body."""
    return {"lora_name": lora_name}


def sync_requests(
    load_body: dict[str, Any], loaded: list[str], from_disk: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    """The ordered ``(route, body)`` of one adapter sync, given the policy adapters the server holds
    (``loaded``): load the new version, then unload the others, so a generate never finds no adapter. A
    resync of a version the server holds (a retry after a failed sync) unloads it first: SGLang refuses to
    load a name that is loaded."""
    name = load_body["lora_name"]
    out = [(UNLOAD, build_unload_request(name))] if name in loaded else []
    out.append((LOAD_FROM_DISK if from_disk else LOAD_FROM_TENSORS, load_body))
    return out + [(UNLOAD, build_unload_request(n)) for n in loaded if n != name]


def with_adapter(generate_body: dict[str, Any], weight_version: int) -> dict[str, Any]:
    """A ``/generate`` body that runs every prompt through the policy adapter of ``weight_version``."""
    return {**generate_body, "lora_path": adapter_name(weight_version)}


def build_weight_version_request(weight_version: int) -> dict[str, Any]:
    """``/update_weight_version`` body (``UpdateWeightVersionReqInput``): an adapter load stamps no version,
    so the sync stamps it after the load; no abort (the sync runs between rounds)."""
    return {"new_version": str(int(weight_version)), "abort_all_requests": False}
