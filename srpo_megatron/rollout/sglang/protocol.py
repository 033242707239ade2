"""SGLang's wire contract, as pure functions: request bodies built, responses parsed, buckets serialized.

The offline ``sglang.Engine`` methods take the same keyword arguments as the HTTP server's JSON bodies
(``/generate``, ``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_disk``, ``/release_memory_occupation``,
``/resume_memory_occupation``), so one set of builders serves both; the CPU contract tests check them
against SGLang's documented shapes (``io_struct.UpdateWeightsFromTensorReqInput`` etc.).

Weight updates follow SGLang's (and slime's) convention: the *trainer* serializes each bucket as a
``FlattenedTensorBucket`` (one flat tensor + metadata) with ``MultiprocessingSerializer``, one entry per
engine TP rank, and sends ``load_format="flattened_bucket"``; scheduler TP rank i deserializes entry i,
which the trainer rank owning GPU i made from its own copy (``weights.tp_payloads``). The colocated sync
sends the trainer's flat bucket itself (``flat_bucket_data``: no second copy).
Serializing in the trainer matters: CUDA tensors received from another process cannot be re-shared, so
an intermediate process (our engine child, the HTTP server) must only ever see the serialized strings.
Every update request carries ``weight_version`` (SGLang stamps it on each generate's ``meta_info``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from srpo_megatron.buckets import FlatBucket
from srpo_megatron.rollout.base import Completion, EngineError, SamplingParams, sample_seed
from srpo_megatron.rollout.routed_experts import decode_sglang_routed_experts
from srpo_megatron.rollout.sglang import flat_wire

FLATTENED_BUCKET = "flattened_bucket"


def build_sampling_params(params: SamplingParams, prompt_index: int, sample_index: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one (prompt, sample) request."""
    sp: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "no_stop_trim": True,  # keep the stop token: the trainer scores it like any other token
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        sp["sampling_seed"] = sample_seed(params.seed, params.prompt_offset + prompt_index, sample_index)
    return sp


def build_generate_request(
    prompts: Sequence[Sequence[int]], params: SamplingParams
) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The ``/generate`` body (== ``Engine.generate`` kwargs) for all samples, and the (prompt, sample)
    pair of each request in order."""
    rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
    body = {
        "input_ids": [[int(t) for t in prompts[i]] for i, _ in rows],
        "sampling_params": [build_sampling_params(params, i, j) for i, j in rows],
        "return_logprob": True,
    }
    if params.return_routed_experts:  # MoE rollout routing replay: meta_info["routed_experts"] per output
        body["return_routed_experts"] = True
    if params.top_logprobs:  # parity diagnostic: meta_info["output_top_logprobs"] per output
        body["top_logprobs_num"] = int(params.top_logprobs)
    return body, rows


def build_requests_body(inputs: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> dict[str, Any]:
    """The ``/generate`` body for one request per input, each with its own sampling parameters (``n`` must
    be 1; the seed is ``sample_seed(seed, prompt_offset, 0)``): continuations of partial rollouts, whose
    inputs, budgets and seeds differ per request (``rollout/partial.py``)."""
    if len(inputs) != len(params):
        raise EngineError(f"{len(inputs)} inputs but {len(params)} sampling parameters; give one per input")
    if any(p.n != 1 for p in params):
        raise EngineError("generate_requests takes n=1 per request (one input, one completion)")
    body: dict[str, Any] = {
        "input_ids": [[int(t) for t in ids] for ids in inputs],
        "sampling_params": [build_sampling_params(p, 0, 0) for p in params],
        "return_logprob": True,
    }
    routed = {p.return_routed_experts for p in params}
    if len(routed) > 1:
        raise EngineError("return_routed_experts must be the same for every request of one call")
    if routed == {True}:
        body["return_routed_experts"] = True
    tops = {p.top_logprobs for p in params}
    if len(tops) > 1:
        raise EngineError("top_logprobs must be the same for every request of one call")
    if tops - {0}:  # parity diagnostic: meta_info["output_top_logprobs"] per output
        body["top_logprobs_num"] = int(params[0].top_logprobs)
    return body


# Fields of a ``/generate`` body that hold one entry per request (SGLang's batch form); the others
# (``return_logprob``, ``return_routed_experts``, ``top_logprobs_num`` as one int) apply to every request.
_PER_REQUEST_FIELDS = ("input_ids", "sampling_params")


def split_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``/generate`` body of N requests as N bodies of one request each, in order (SGLang's batch form
    with one entry, so each answer is a list of one output). Sent concurrently, SGLang batches them in
    its scheduler as it would the one body (slime's ``sglang_rollout`` sends one request per sample), and
    ``request_timeout_s`` then bounds one sample's generation, not a whole round's."""
    n = len(body["input_ids"])
    for key in _PER_REQUEST_FIELDS:
        if len(body[key]) != n:
            raise EngineError(f"/generate body: {len(body[key])} {key} for {n} input_ids")
    shared = {k: v for k, v in body.items() if k not in _PER_REQUEST_FIELDS}
    return [{**{k: [body[k][i]] for k in _PER_REQUEST_FIELDS}, **shared} for i in range(n)]


def join_outputs(answers: Sequence[Any], n: int) -> list[Any]:
    """The outputs of ``split_requests``'s bodies (one answer each: a list of one output, or the output)
    as the one body's list of ``n`` outputs."""
    outputs = []
    for k, answer in enumerate(answers):
        one = answer if isinstance(answer, list) else [answer]
        if len(one) != 1:
            raise EngineError(f"SGLang answered request {k} (one sample) with {len(one)} outputs")
        outputs.append(one[0])
    if len(outputs) != n:
        raise EngineError(f"SGLang answered {len(outputs)} of {n} requests")
    return outputs


# Partial rollouts (module doc of ``rollout/partial.py``): SGLang's ``PauseGenerationReqInput.mode`` is one of
# abort | retract | in_place; the project uses abort only.
PAUSE_MODE = "abort"


def build_pause_generation_request() -> dict[str, Any]:
    """``/pause_generation`` (``io_struct.PauseGenerationReqInput``) in mode abort: SGLang aborts every
    request it holds, answers once none is left (the running ones come back with ``finish_reason`` abort
    and the tokens so far), and holds every generate that arrives later until ``/continue_generation``."""
    return {"mode": PAUSE_MODE}


def build_continue_generation_request() -> dict[str, Any]:
    """``/continue_generation`` (``io_struct.ContinueGenerationReqInput``): the held requests run, on the
    weights installed meanwhile. ``torch_empty_cache`` is left at SGLang's default (true)."""
    return {}


def build_init_weights_update_group_request(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """``/init_weights_update_group``: the engine's TP ranks join a group whose rank 0 is the trainer."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def build_update_weights_from_distributed_request(
    tensors: Sequence[tuple[str, torch.Tensor]],
    group_name: str,
    flush_cache: bool,
    weight_version: int | None,
) -> dict[str, Any]:
    """``/update_weights_from_distributed``: names/dtypes/shapes the trainer then broadcasts, in order.
    ``weight_version`` goes with the last bucket only: SGLang stamps it once that bucket is loaded."""
    body = {
        "names": [n for n, _ in tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def build_update_weights_from_tensor_request(
    serialized_per_tp_rank: list[str], tp_size: int, flush_cache: bool, weight_version: int | None
) -> dict[str, Any]:
    """``update_weights_from_tensor``: exactly one serialized flattened bucket per engine TP rank (rank i
    of the scheduler reads entry i; fewer entries raise an IndexError on the other ranks inside SGLang)."""
    if len(serialized_per_tp_rank) != tp_size:
        raise EngineError(
            f"update_weights_from_tensor needs one payload per engine TP rank: got "
            f"{len(serialized_per_tp_rank)} for tp_size={tp_size}"
        )
    body: dict[str, Any] = {
        "serialized_named_tensors": list(serialized_per_tp_rank),
        "load_format": FLATTENED_BUCKET,
        "flush_cache": bool(flush_cache),
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def build_update_weights_from_disk_request(model_path: str, weight_version: int) -> dict[str, Any]:
    return {"model_path": model_path, "load_format": None, "weight_version": str(weight_version)}


def serialize_bucket_per_tp_rank(
    bucket: Sequence[tuple[str, torch.Tensor]], tp_size: int, serializer: Callable[[Any], str] | None = None
) -> tuple[list[str], torch.Tensor]:
    """One ``MultiprocessingSerializer`` string of a ``FlattenedTensorBucket`` per engine TP rank, and the
    flat tensor the strings point at: the caller keeps it alive until SGLang answered the update (the
    engine copies from it; freeing or reusing it earlier corrupts the weights).

    SGLang's own classes make it whenever they import; otherwise ``flat_wire`` writes the same payload
    (CPU machines). ``serializer`` replaces ``MultiprocessingSerializer.serialize`` (tests)."""
    offset = 0
    for name, t in bucket:  # SGLang packs without padding and views each tensor at its byte offset
        if offset % t.element_size():
            raise EngineError(
                f"bucket tensor {name} ({t.dtype}) would start at byte {offset}, not a multiple of its "
                f"element size {t.element_size()}: SGLang's FlattenedTensorBucket cannot view it there; "
                "keep one dtype per bucket or order the tensors by decreasing element size"
            )
        offset += t.numel() * t.element_size()
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:  # no SGLang here (CPU): the same wire format, written by the project
        flat_tensor, metadata = flat_wire.flatten(bucket)
        serialize = serializer or flat_wire.serialize
    else:
        flat = FlattenedTensorBucket(named_tensors=list(bucket))
        flat_tensor, metadata = flat.get_flattened_tensor(), flat.get_metadata()
        serialize = serializer or (lambda obj: MultiprocessingSerializer.serialize(obj, output_str=True))
    data = {"flattened_tensor": flat_tensor, "metadata": metadata}
    return [serialize(data) for _ in range(tp_size)], flat_tensor


def flat_bucket_data(bucket: FlatBucket) -> dict[str, Any]:
    """The ``{"flattened_tensor", "metadata"}`` object SGLang deserializes, made from a bucket the trainer
    already flattened: ``flattened_tensor`` IS ``bucket.flat`` (no copy; the alignment gaps between tensors
    stay, SGLang's ``reconstruct_tensors`` views each entry at its own ``start_idx:end_idx``). The metadata
    is SGLang's ``FlattenedTensorMetadata`` when it imports, ``flat_wire``'s stand-in otherwise."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        FlattenedTensorMetadata = flat_wire.FlattenedTensorMetadata
    metadata = []
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        if offset % spec.dtype.itemsize:
            raise EngineError(
                f"bucket tensor {spec.name} ({spec.dtype}) starts at byte {offset}, not a multiple of its "
                "element size: SGLang cannot view it there; build buckets with buckets.FlatBucket.empty"
            )
        shape = torch.Size(spec.shape)
        metadata.append(
            FlattenedTensorMetadata(spec.name, shape, spec.dtype, offset, offset + spec.nbytes, spec.nbytes)
        )
    return {"flattened_tensor": bucket.flat, "metadata": metadata}


def serialize_payload(data: dict[str, Any], serializer: Callable[[Any], str] | None = None) -> str:
    """One TP rank's string: ``MultiprocessingSerializer.serialize(data, output_str=True)`` where SGLang
    imports, ``flat_wire.serialize`` (the same bytes) otherwise; ``serializer`` replaces both (tests)."""
    if serializer is not None:
        return serializer(data)
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return flat_wire.serialize(data)
    return MultiprocessingSerializer.serialize(data, output_str=True)


# SGLang's ``GPU_MEMORY_ALL_TYPES`` (``sglang/srt/constants.py``; the same list in 0.5.15.post1 and 0.5.23),
# for machines where sglang does not import. tests/unit/test_sglang_engine_memory.py checks it against the
# real constant wherever sglang imports.
PINNED_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def memory_tags() -> tuple[str, ...]:
    """Every GPU memory type SGLang can release: its own constant when importable, else the pinned list."""
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    except ImportError:
        return PINNED_MEMORY_TAGS
    return tuple(GPU_MEMORY_ALL_TYPES)


def build_memory_occupation_request(tags: Sequence[str]) -> dict[str, Any]:
    """``/release_memory_occupation`` / ``/resume_memory_occupation`` for exactly ``tags``.

    SGLang reads ``tags=None`` *and* ``tags=[]`` as every type in ``GPU_MEMORY_ALL_TYPES``, so the engine
    always names its tags: what it releases is then exactly what it records and later resumes."""
    if not tags:
        raise EngineError(
            "a memory occupation request needs explicit tags: SGLang reads none as every memory type, "
            f"{list(memory_tags())}"
        )
    return {"tags": [str(t) for t in tags]}


# ------------------------------------------------------------------------------------ response parsing


def parse_finish_reason(meta: dict[str, Any]) -> str:
    """SGLang reports ``{"type": "stop"|"length"|"abort", ...}`` (or null while unfinished)."""
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length", "abort"):
        return kind
    raise EngineError(f"SGLang returned finish_reason={fr!r}; expected type stop, length or abort")


def _version_number(raw: Any, what: str) -> int:
    """SGLang's weight version string as the project's int (``"default"``: before any update = 0)."""
    if raw == "default":
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise EngineError(
            f"SGLang reported weight version {raw!r} for {what}; the project sends integer versions, so "
            "another client updated this server's weights"
        ) from None


def token_versions_from_meta(meta: dict[str, Any], n_tokens: int, dispatched: int, k: int) -> list[int]:
    """The weight version that produced each of an output's ``n_tokens`` tokens.

    SGLang 0.5.23 reports ``meta_info["weight_versions"]``: spans ``{"version", "start", "end"}`` over the
    output tokens (``utils/weight_versions.py``; more than one only when a pause in mode retract/in_place
    let a request run across an update) and sets ``weight_version`` to the last span's. Older releases
    (0.5.15.post1) report only ``weight_version``, the version when the output was produced, which in
    mode abort is the version of every token. No token may come from a version older than the one served
    at dispatch (``dispatched``): that is a server nobody resynced."""
    served = meta.get("weight_version")
    spans = meta.get("weight_versions")
    if spans:
        out: list[int] = []
        for span in spans:
            if int(span["start"]) != len(out) or int(span["end"]) < int(span["start"]):
                raise EngineError(
                    f"SGLang output {k}: weight_versions spans {spans} do not tile its {n_tokens} tokens"
                )
            out += [_version_number(span["version"], f"output {k}")] * (int(span["end"]) - int(span["start"]))
        if len(out) != n_tokens:
            raise EngineError(
                f"SGLang output {k}: weight_versions spans {spans} cover {len(out)} of {n_tokens} tokens"
            )
        if served is not None and str(spans[-1]["version"]) != str(served):
            raise EngineError(
                f"SGLang output {k}: weight_version {served!r} is not its last span's "
                f"{spans[-1]['version']!r}"
            )
        if any(b < a for a, b in itertools.pairwise(out)):
            raise EngineError(f"SGLang output {k}: weight_versions go backwards: {spans}")
    else:
        version = dispatched if served is None else _version_number(served, f"output {k}")
        out = [version] * n_tokens
    oldest = min(out) if out else (dispatched if served is None else _version_number(served, f"output {k}"))
    if oldest < dispatched:
        raise EngineError(
            f"SGLang output {k} was produced by weight version {served if not spans else oldest}, expected "
            f"{dispatched}; the engine serves other weights than the trainer synced"
        )
    return out


def parse_top_logprobs(
    meta: dict[str, Any], n_tokens: int, k: int, out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta_info["output_top_logprobs"]`` of one output as (ids ``[R, K]`` int64, log-probs ``[R, K]``).

    SGLang (``TokenizerManager.add_logprob_to_meta_info`` / ``detokenize_top_logprobs_tokens``) reports one
    entry per output token: a list of K ``[logprob, token_id, text|null]``, most likely first, from the
    same log-probs as ``output_token_logprobs``.
    """
    entries = meta.get("output_top_logprobs")
    if entries is None or len(entries) != n_tokens:
        got = "none" if entries is None else f"{len(entries)} positions"
        raise EngineError(
            f"SGLang output {out} asked for top_logprobs_num={k} but meta_info.output_top_logprobs has {got} "
            f"for {n_tokens} tokens; the server must return top logprobs for every output token"
        )
    if any(not e or len(e) != k for e in entries):
        raise EngineError(f"SGLang output {out}: output_top_logprobs rows do not all hold {k} entries")
    ids = torch.tensor([[int(x[1]) for x in e] for e in entries], dtype=torch.long).reshape(n_tokens, k)
    logp = torch.tensor([[float(x[0]) for x in e] for e in entries], dtype=torch.float32).reshape(n_tokens, k)
    return ids, logp


def parse_generate_response(
    outputs: Any, rows: list[tuple[int, int]], n_prompts: int, weight_version: int, top_logprobs: int = 0
) -> list[list[Completion]]:
    """Turn SGLang's per-request outputs into ``result[prompt][sample]`` Completions.

    Each output is ``{"output_ids"?, "meta_info": {"output_token_logprobs": [[logprob, token_id, text|null],
    ...], "finish_reason": {...}, "completion_tokens": int, "weight_version"?: str, "weight_versions"?:
    [{"version", "start", "end"}], "routed_experts"?: base64}}``. ``finish_reason`` abort (a pause in mode
    abort, ``/abort_request``) comes with the tokens and log-probs generated so far, and routed experts
    for the positions forwarded so far.

    ``weight_version`` is the version the engine served when the request was *dispatched* (read before
    the call): each Completion carries it; ``token_versions`` is filled only when some token came from a
    newer version (a request held by a pause ran after the sync). ``top_logprobs`` = K > 0: each output
    must carry ``output_top_logprobs`` (``parse_top_logprobs``), kept as ``top_ids`` / ``top_logprobs``.
    """
    if isinstance(outputs, dict):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != len(rows):
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise EngineError(f"SGLang returned {got} outputs for {len(rows)} requests")
    result: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for k, (out, (i, j)) in enumerate(zip(outputs, rows, strict=True)):
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if isinstance(meta, dict) and "output_token_logprobs" not in meta and not out.get("output_ids"):
            fr = meta.get("finish_reason")
            if isinstance(fr, dict) and fr.get("type") == "abort":  # aborted before its first token
                meta = {**meta, "output_token_logprobs": []}
        if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
            raise EngineError(
                f"SGLang output {k} has no meta_info.output_token_logprobs; the request must set "
                f"return_logprob=true (got {out!r:.300})"
            )
        entries = meta["output_token_logprobs"] or []
        logprobs = [float(e[0]) for e in entries]
        token_ids = [int(e[1]) for e in entries]
        if any(lp != lp for lp in logprobs):  # NaN: a broken model must not reach the loss
            raise EngineError(f"SGLang output {k} has NaN log-probs")
        n_tokens = meta.get("completion_tokens")
        if n_tokens is not None and int(n_tokens) != len(token_ids):
            raise EngineError(
                f"SGLang output {k}: completion_tokens={n_tokens} but {len(token_ids)} output_token_logprobs"
            )
        versions = token_versions_from_meta(meta, len(token_ids), weight_version, k)
        finish = parse_finish_reason(meta)
        routed = meta.get("routed_experts")  # base64 int32 [P + R - 1, layers, top_k], flat here
        top = parse_top_logprobs(meta, len(token_ids), top_logprobs, k) if top_logprobs else (None, None)
        result[i].append(
            Completion(
                prompt_index=i,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=finish,  # type: ignore[arg-type]
                weight_version=weight_version,
                token_versions=None if all(v == weight_version for v in versions) else versions,
                routed_experts=decode_sglang_routed_experts(routed) if routed else None,
                top_ids=top[0],
                top_logprobs=top[1],
                meta={"sample_index": j, "finish_reason": meta.get("finish_reason")},
            )
        )
    return result


def parse_update_response(resp: Any, what: str) -> None:
    """Weight/memory calls answer ``{"success": bool, "message": str}`` (HTTP) or ``(success, message, ...)``
    (offline Engine). Raise ``EngineError`` with SGLang's message when it failed."""
    if isinstance(resp, dict):
        ok, msg = resp.get("success", True), resp.get("message", "")
    elif isinstance(resp, tuple | list) and resp and isinstance(resp[0], bool):
        ok, msg = resp[0], resp[1] if len(resp) > 1 else ""
    elif resp is None:
        ok, msg = True, ""
    else:
        raise EngineError(f"SGLang {what} returned an unexpected response {resp!r}")
    if not ok:
        raise EngineError(f"SGLang {what} failed: {msg}")


def model_eos_token_ids(model_path: str) -> tuple[int, ...]:
    """The EOS ids SGLang stops at for the model in ``model_path``: ``eos_token_id`` of ``config.json``
    and of ``generation_config.json``, united (``ModelConfig._get_hf_eos_token_id``); missing files: none."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            with open(Path(model_path) / name) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for e in [] if eos is None else [eos] if isinstance(eos, int) else list(eos):
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


def server_tp_size(transport: Any, default: int) -> int:
    """A running server's TP size from ``/get_server_info`` (its launch flags decide it, not the recipe)."""
    info = transport.call("get_server_info", None, http_method="GET")
    return int(info["tp_size"]) if isinstance(info, dict) and "tp_size" in info else int(default)


def server_version(transport: Any) -> str:
    """A running server's sglang release from ``/get_server_info`` (its ``version``: ``__version__``)."""
    info = transport.call("get_server_info", None, http_method="GET")
    if not isinstance(info, dict) or not info.get("version"):
        raise EngineError(
            f"SGLang's /get_server_info answered no version ({info!r}); the adapter sync needs it to pick "
            "the payload field (serialized_tensors or serialized_named_tensors); upgrade the server"
        )
    return str(info["version"])
