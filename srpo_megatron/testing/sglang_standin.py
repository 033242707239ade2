"""A stand-in for an SGLang HTTP server on CPU, built on SGLang's own modules wherever they import.

SGLang's engine cannot start without a GPU (PLATFORM: it needs CUDA kernels), so this tiny local HTTP server
speaks the subset of SGLang's HTTP API the project uses (``/generate`` with ``return_logprob``, ``/health``,
``/get_server_info``, ``/flush_cache``, ``/update_weights_from_tensor``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, and the LoRA routes ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``, ``/update_weight_version``) on top of the CPU ``HFEngine``, loading weights
non-atomically like SGLang does. Real-engine checks live in tests/gpu/test_sglang_engine.py.

Where the pieces come from (``srpo_megatron.testing.sglang_import.load()``; the fallback is used when the
module does not import, e.g. in the plain venv without an sglang wheel on the path):

==================================  ==========================================  ============================
piece                               SGLang's own code                           fallback (own reading)
==================================  ==========================================  ============================
payload decode (tensor updates)     ``MultiprocessingSerializer`` +             ``flat_wire.decode``
                                    ``FlattenedTensorBucket``
memory tags                         ``constants.GPU_MEMORY_ALL_TYPES``          ``FALLBACK_MEMORY_TYPES``
request bodies (400 when refused)   ``io_struct`` request classes               not checked
release/resume bookkeeping          own code, modelled on SGLang's scheduler    (same)
                                    (``offload_tags``) and torch_memory_saver
generation, weight loading          own code (``HFEngine``, HF names and        (same)
                                    per-expert checkpoint names)
distributed update group            own code (gloo, SGLang's store prefixes)    (same)
per-token weight versions           ``utils.weight_versions`` (0.5.23: spans    none (as 0.5.15.post1)
(``meta_info["weight_versions"]``)  computed and added to meta_info)
pause / continue / abort            own code, modelled on SGLang's tokenizer    (same)
                                    manager (below)
top logprobs (``top_logprobs_num``) own code: ``HFEngine``'s top-K as SGLang's  (same)
                                    ``meta_info["output_top_logprobs"]``
LoRA adapters                       payload decode as above; the body format    (same, 0.5.23's body)
(``lora_path`` on ``/generate``)    of the wheel's own release (get_server_info
                                    ``version``); own code: ``peft`` on the HF
                                    model (``rollout.hf_lora``), below
routed experts                      the detokenizer's base64 (``Detokenizer-    base64 of the int32 bytes
(``return_routed_experts``)         Manager._b64_encode_per_request``) of
                                    ``HFEngine``'s int32 ``[P + R - 1, layers,
                                    top_k]`` (below)
==================================  ==========================================  ============================

Release/resume, as SGLang's scheduler does it: ``tags`` null or empty means every type of
``GPU_MEMORY_ALL_TYPES``; release adds each tag to the paused set and pauses it in torch_memory_saver
(pausing a paused tag is an error here: the saver would pause memory that is already unmapped); resume
removes each tag (``offload_tags.remove``: a KeyError for a tag that is not paused, after which
SGLang's process tree dies); a generate while any tag is paused fails (decode would touch unmapped
memory or replay a CUDA graph whose memory is gone).

Pause, as SGLang's tokenizer manager does it (``pause_generation``/``continue_generation``/
``abort_request``, 0.5.15.post1 and 0.5.23): ``/pause_generation`` in mode abort marks the server paused,
aborts every request it holds (the running ones come back with ``finish_reason`` abort and their tokens
and log-probs so far; the ones not started, SGLang's waiting queue, with none) and answers once no
generate is in flight; a ``/generate`` that arrives while paused waits until ``/continue_generation``;
``/abort_request`` with ``abort_all`` aborts without pausing. Modes retract and in_place are refused
with a 400 (the project does not use them: ``rollout/partial.py``). A test hook, ``hold_after_steps(k)``,
holds the next generation after its k-th decode step until an abort reaches it, so a pause lands
mid-generation deterministically.

LoRA, as SGLang's multi-LoRA serving does it (``tokenizer_control_mixin`` / ``lora_manager`` /
``lora_registry`` of 0.5.15.post1 and 0.5.23): an adapter is loaded under a name (loading a name that is
loaded fails: "already loaded"), unloaded by name (an unknown name fails), and a ``/generate`` runs on the
adapter its ``lora_path`` names (a name not loaded fails the request: "not loaded") or, without one, on the
base model alone. The stand-in wraps its HF model with ``peft`` at the first load and copies the named
adapter's tensors in before each generation (zero B for the base model); ``loras`` holds what is loaded.

Routed experts, as SGLang reports them (``--enable-return-routed-experts`` and ``return_routed_experts``
per request; 0.5.15.post1 and 0.5.23 alike): the scheduler collects, for a request that finished or was
aborted while running, the experts of positions ``[0, seqlen - 1)`` with seqlen = prompt + output tokens
(``batch_result_processor._maybe_collect_routed_experts``: an int32 ``[P + R - 1, layers, top_k]`` from
the capturer's host buffer), the detokenizer base64-encodes its bytes (``_b64_encode_per_request``) and
the tokenizer manager puts the string in ``meta_info["routed_experts"]``; a request aborted before it ran
(``TokenizerManager._handle_abort_req``) has no ``routed_experts``. The stand-in reports the ``HFEngine``'s
own record in that layout (None, so no key, for a row aborted before its prefill), so a continued
request reports its prefill's rows again (``routed_experts_start_len`` 0), which the client drops
(``rollout/partial.py``). ``outputs_log`` keeps every ``/generate`` request and its outputs, for tests.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import PrefixStore, rendezvous

from srpo_megatron.ops.fp8_blocks import dequantize
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.rollout.hf_lora import inject_lora
from srpo_megatron.rollout.hf_moe_layout import file_format_params
from srpo_megatron.rollout.sglang import flat_wire
from srpo_megatron.testing import sglang_import

# SGLang's GPU_MEMORY_ALL_TYPES as read from 0.5.15.post1 and 0.5.23 (used only without an sglang wheel).
FALLBACK_MEMORY_TYPES = ("kv_cache", "weights", "cuda_graph")

# Route -> SGLang's request class for its body (io_struct), where the project sends one.
REQUEST_CLASSES = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}
# The release whose API the stand-in speaks without an sglang wheel (get_server_info's ``version``).
FALLBACK_VERSION = "0.5.23"


class Refused(Exception):
    """A request the server answers with HTTP 400 and survives (SGLang's validation errors)."""


def weight_version_spans(version: str, n_tokens: int) -> list[dict] | None:
    """``meta_info["weight_versions"]`` of an output generated by ``version`` alone, computed by SGLang's
    own ``utils.weight_versions`` (0.5.23); None where that module does not exist (0.5.15.post1, or no
    sglang on the path), whose outputs carry no spans."""
    if sglang_import.load() is None:
        return None
    try:
        from sglang.srt.utils import weight_versions
    except ImportError:
        return None
    meta: dict = {}
    spans = weight_versions.compute_weight_version_spans(
        [], current_version=version, num_output_tokens=n_tokens
    )
    weight_versions.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n_tokens)
    return meta["weight_versions"]


def memory_types() -> tuple[str, ...]:
    """SGLang's ``GPU_MEMORY_ALL_TYPES`` (its own constant when it imports)."""
    real = sglang_import.load()
    if real is not None and real.constants is not None:
        return tuple(real.constants.GPU_MEMORY_ALL_TYPES)
    return FALLBACK_MEMORY_TYPES


def standin_version() -> str:
    """The sglang release the stand-in answers as: the wheel's on the path, else ``FALLBACK_VERSION``."""
    real = sglang_import.load()
    return real.version if real is not None else FALLBACK_VERSION


def request_class(route: str) -> Any | None:
    """SGLang's io_struct class for ``route``'s body, or None (no io_struct here, or no such class)."""
    real = sglang_import.load()
    if real is None or real.io_struct is None or route not in REQUEST_CLASSES:
        return None
    return getattr(real.io_struct, REQUEST_CLASSES[route], None)


def standin_serialize(obj: Any) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: SGLang's own when it imports."""
    real = sglang_import.load()
    if real is not None and real.utils is not None:
        return real.utils.MultiprocessingSerializer.serialize(obj, output_str=True)
    return flat_wire.serialize(obj)


def standin_deserialize(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's flattened-bucket payload as named tensors: SGLang's deserialize +
    ``FlattenedTensorBucket.reconstruct_tensors`` when they import, ``flat_wire.decode`` otherwise."""
    real = sglang_import.load()
    if real is None or real.utils is None or real.tensor_bucket is None:
        return flat_wire.decode(payload)
    data = real.utils.MultiprocessingSerializer.deserialize(payload)
    bucket = real.tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    )
    return bucket.reconstruct_tensors()


def encode_routed_experts(ids: torch.Tensor) -> str:
    """One request's routed experts as SGLang's ``meta_info["routed_experts"]``: base64 of the int32
    ``[P + R - 1, layers, top_k]`` tensor's bytes, by SGLang's own detokenizer when it imports."""
    ids = ids.to(torch.int32).contiguous()
    real = sglang_import.load()
    if real is not None:
        try:
            from sglang.srt.managers.detokenizer_manager import DetokenizerManager
        except ImportError:
            pass
        else:
            return DetokenizerManager._b64_encode_per_request([ids])[0]
    return base64.b64encode(ids.numpy().tobytes()).decode("utf-8")


def sglang_output(ids, lps, finish, version=None, spans=None, top=None, routed=None) -> dict:
    """One /generate output as SGLang documents it (meta_info.output_token_logprobs = [lp, id, text];
    ``spans``: 0.5.23's ``weight_versions``; ``top``: (ids [R, K], log-probs [R, K]) as
    ``output_top_logprobs``, per token K ``[lp, id, text]``, what ``top_logprobs_num`` = K returns)."""
    meta = {
        "id": "abc",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps, strict=True)],
    }
    if top is not None:
        meta["output_top_logprobs"] = [
            [[float(lp), int(t), None] for t, lp in zip(row_ids, row_lps, strict=True)]
            for row_ids, row_lps in zip(top[0].tolist(), top[1].tolist(), strict=True)
        ]
    if version is not None:
        meta["weight_version"] = version
    if spans is not None:
        meta["weight_versions"] = spans
    if routed is not None:  # SGLang's tokenizer manager: only when the scheduler collected them
        meta["routed_experts"] = encode_routed_experts(routed)
    return {"text": "", "output_ids": ids, "meta_info": meta}


def _per_request(value: Any, body: dict) -> list[int]:
    """``GenerateReqInput.top_logprobs_num`` per request: null = 0, an int for all, or one per request."""
    n = len(body["sampling_params"])
    if isinstance(value, list):
        return [int(v or 0) for v in value]
    return [int(value or 0)] * n


class _Server(ThreadingHTTPServer):
    """socketserver's listen backlog is 5: one ``/generate`` per sample, a round's requests at once, then
    overflow it and the client sees connection resets. SGLang's HTTP server (uvicorn) listens with a
    backlog of 2048."""

    request_queue_size = 2048


class SGLangStandInServer:
    """Stand-in for an SGLang HTTP server (see module docstring), backed by a CPU HFEngine.

    ``paused`` holds the memory tags released and not yet resumed (SGLang's ``offload_tags``);
    ``memory_log`` every release/resume as ``(route, tags)`` with SGLang's expansion of null."""

    def __init__(self, model: torch.nn.Module, tp_size: int = 1) -> None:
        self.model = model
        self.engine = HFEngine(model, max_batch_size=16)
        self.tp_size = tp_size  # as launched with --tp-size: one payload per scheduler TP rank expected
        self.memory_types = memory_types()
        self.paused: set[str] = set()
        self.memory_log: list[tuple[str, tuple[str, ...]]] = []
        self.tensor_updates: list[list[list[tuple[str, torch.Tensor]]]] = []  # [update][tp rank] tensors
        self.rejected: list[tuple[str, str]] = []  # (route, why) bodies SGLang's request class refused
        self.version = "default"  # SGLang's weight_version before any update
        self.dead = ""  # SGLang kills its process tree on some errors: every later call fails
        self.calls: list[str] = []
        self.bodies: list[tuple[str, dict]] = []
        self.outputs_log: list[tuple[dict, list[dict]]] = []  # every /generate: (body, outputs)
        self.weight_groups: dict[str, list] = {}  # group name -> one gloo group per scheduler TP rank
        self.generation_paused = False  # SGLang's tokenizer-manager is_pause
        self._pause_cond = threading.Condition()  # guards generation_paused and _in_flight
        self._in_flight = 0  # /generate calls past the pause gate (SGLang: holders of model_update_lock)
        self.loras: dict[str, dict[str, torch.Tensor]] = {}  # loaded adapters by lora_name
        self._lora_params: dict[str, torch.Tensor] | None = None  # the peft-wrapped model's adapters
        self._lora_lock = threading.Lock()  # one adapter in the model at a time
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, obj, code=200):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stand_in.calls.append(self.path)
                if stand_in.dead:
                    return self._reply({"error": stand_in.dead}, 500)
                if self.path == "/get_server_info":
                    info = {"tp_size": stand_in.tp_size, "weight_version": stand_in.version}
                    return self._reply({**info, "version": standin_version()})
                if self.path == "/v1/models":  # the base model, then each loaded adapter (parent: the base)
                    cards = [{"id": "base", "root": "base"}]
                    cards += [{"id": n, "root": None, "parent": "base"} for n in stand_in.loras]
                    return self._reply({"object": "list", "data": cards})
                self._reply({}) if self.path == "/health" else self._reply({"error": "no route"}, 404)

            def do_POST(self):
                stand_in.calls.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stand_in.bodies.append((self.path, body))
                route = getattr(stand_in, "route_" + self.path.strip("/"), None)
                if stand_in.dead:
                    return self._reply({"error": stand_in.dead}, 500)
                if route is None:
                    return self._reply({"error": f"no route {self.path}"}, 404)
                cls = request_class(self.path)
                if cls is not None:
                    try:  # SGLang's HTTP server builds this class from the JSON body
                        cls(**body)
                    except TypeError as e:
                        stand_in.rejected.append((self.path, str(e)))
                        return self._reply({"error": f"{cls.__name__} rejects the body: {e}"}, 400)
                try:
                    self._reply(route(body))
                except Refused as e:
                    self._reply({"error": str(e)}, 400)
                except Exception as e:  # SGLang's scheduler raising = the server's process tree dies
                    stand_in.dead = repr(e)
                    self._reply({"error": repr(e)}, 500)

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def route_generate(self, body):
        with self._pause_cond:  # SGLang: a request arriving while paused waits for continue_generation
            self._pause_cond.wait_for(lambda: not self.generation_paused)
            self._in_flight += 1
        try:
            return self._generate(body)
        finally:
            with self._pause_cond:
                self._in_flight -= 1
                self._pause_cond.notify_all()

    def _generate(self, body):
        if self.paused:
            raise RuntimeError(f"generate while memory tags {sorted(self.paused)} are released")
        params = [
            SamplingParams(
                temperature=sp["temperature"],
                top_p=sp["top_p"],
                top_k=sp["top_k"],
                max_new_tokens=sp["max_new_tokens"],
                stop_token_ids=tuple(sp["stop_token_ids"]),
                seed=sp.get("sampling_seed"),
                top_logprobs=k,
                return_routed_experts=bool(body.get("return_routed_experts")),
            )
            for sp, k in zip(
                body["sampling_params"], _per_request(body.get("top_logprobs_num"), body), strict=True
            )
        ]
        with self._serving_adapter(body.get("lora_path")):
            completions = self.engine.generate_requests(body["input_ids"], params)
        outs = []
        for c in completions:
            # SGLang's FINISH_ABORT().to_json() for an abort_all of a running request
            finish = {"type": c.finish_reason}
            if c.finish_reason == "abort":
                finish.update(message="Aborted", status_code=None, err_type=None)
            spans = weight_version_spans(self.version, len(c.token_ids))
            top = None if c.top_ids is None else (c.top_ids, c.top_logprobs)
            routed = c.routed_experts
            outs.append(sglang_output(c.token_ids, c.logprobs, finish, self.version, spans, top, routed))
        self.outputs_log.append((body, outs))
        return outs

    @contextlib.contextmanager
    def _serving_adapter(self, lora_path):
        """The model holds the adapter ``lora_path`` names (or, for None, none: B = 0) while inside."""
        if lora_path is None and self._lora_params is None:
            yield
            return
        if not isinstance(lora_path, str | None):
            raise Refused(f"the stand-in serves one adapter per body; got lora_path={lora_path!r}")
        if lora_path is not None and lora_path not in self.loras:
            raise Refused(
                f"The following requested LoRA adapters are not loaded: {lora_path}\n"
                f"Loaded adapters: {list(self.loras)}."
            )
        with self._lora_lock, torch.no_grad():
            for name, p in self._lora_params.items():
                if lora_path is not None:
                    p.copy_(self.loras[lora_path][name])
                elif "lora_B" in name:
                    p.zero_()
            yield

    def route_load_lora_adapter_from_tensors(self, body):
        name = body["lora_name"]
        if name in self.loras:  # LoRAManager.validate_new_adapter
            raise Refused(f"Failed to load LoRA adapter {name} because it is already loaded")
        if body.get("load_format") != "flattened_bucket":
            raise Refused(f"stand-in expects load_format=flattened_bucket, got {body.get('load_format')}")
        per_rank = body.get("serialized_named_tensors")  # 0.5.23: rank i reads entry i; before: one string
        payloads = per_rank if per_rank is not None else [body["serialized_tensors"]] * self.tp_size
        tensors = {n: t.clone() for n, t in standin_deserialize(payloads[self.tp_size - 1])}
        if self._lora_params is None:
            self._lora_params = inject_lora(self.model, body["config_dict"])
        want = {n: tuple(p.shape) for n, p in self._lora_params.items()}
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if want != got:
            wrong = sorted(set(want.items()) ^ set(got.items()))[:3]
            raise Refused(f"LoRA adapter {name} does not fit the model's LoRA layers: {wrong}")
        self.loras[name] = tensors
        return {"success": True, "error_message": None, "loaded_adapters": {n: n for n in self.loras}}

    def route_unload_lora_adapter(self, body):
        name = body["lora_name"]
        if name not in self.loras:
            raise Refused(f"LoRA adapter {name} is not loaded")
        with self._lora_lock:  # SGLang waits until no running request uses it
            del self.loras[name]
        return {"success": True, "error_message": None, "loaded_adapters": {n: n for n in self.loras}}

    def route_update_weight_version(self, body):
        self.version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {self.version}"}

    def route_pause_generation(self, body):
        mode = body.get("mode", "abort")
        if mode != "abort":
            raise Refused(
                f"the stand-in implements /pause_generation mode abort only, got mode={mode!r}: retract "
                "and in_place keep requests across the update (rollout/partial.py says why the project "
                "does not use them)"
            )
        with self._pause_cond:
            self.generation_paused = True
        # SGLang: abort_request(abort_all=True) again until no request holds the model_update_lock
        while True:
            self.engine.abort_running()
            with self._pause_cond:
                if self._pause_cond.wait_for(lambda: self._in_flight == 0, timeout=0.05):
                    break
        return {"message": "Generation paused successfully.", "status": "ok"}

    def route_continue_generation(self, body):
        with self._pause_cond:
            self.generation_paused = False
            self._pause_cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def route_abort_request(self, body):
        if not body.get("abort_all"):
            # SGLang ignores an empty rid without abort_all; the stand-in keeps no rids to abort one by
            raise Refused("the stand-in aborts all requests only: send abort_all=true")
        self.engine.abort_running()
        return {}

    def hold_after_steps(self, k: int) -> threading.Event:
        """Test hook: the next generation that reaches decode step ``k`` waits there until an abort (a
        pause, ``/abort_request``) reaches it; the returned event is set when it got there."""
        reached = threading.Event()

        def hook(step: int, aborted: threading.Event) -> None:
            if step == k and not reached.is_set():
                reached.set()
                aborted.wait(timeout=300)  # a safety net only: the test pauses at once

        self.engine.step_hook = hook
        return reached

    def route_update_weights_from_tensor(self, body):
        # like SGLang's tp_worker: scheduler TP rank i deserializes entry i (IndexError when missing)
        payloads = body["serialized_named_tensors"]
        if body.get("load_format") != "flattened_bucket":
            raise ValueError(f"stand-in expects load_format=flattened_bucket, got {body.get('load_format')}")
        # Each payload decodes once (its memory travels as a file descriptor), as in SGLang: what every
        # rank received is kept (copies) in ``tensor_updates`` for the tests.
        per_rank = [
            [(n, t.clone()) for n, t in standin_deserialize(payloads[r])] for r in range(self.tp_size)
        ]
        self.tensor_updates.append(per_rank)
        # every rank would load its shard; one copy suffices on CPU
        return self._install(per_rank[0], body, "Succeeded to update parameter online.")

    def _install(self, named, body, success: str):
        """Copy ``named`` tensors into the model, stopping at the first name or shape it lacks (no
        atomicity, as in SGLang), then serve ``body``'s ``weight_version``. Stricter than SGLang, whose
        ``load_weights`` skips a name its model lacks, silently. Per-expert checkpoint names go into the
        HF model's fused experts (``rollout.hf_moe_layout.file_format_params``). An FP8 sync's
        ``<name>_scale_inv`` + e4m3 ``<name>`` (``weights.fp8_sync``, scale first) is installed as the block
        dequantization an FP8 engine computes with (``ops.fp8_blocks.dequantize``); an FP8 weight without
        its scale is a bad tensor."""
        params = dict(self.model.named_parameters())
        # per-expert checkpoint names (what SGLang's load_weights consumes) as views of the fused experts
        params.update(file_format_params(params))
        # GLM-4.5 / DeepSeek-V3: the routers' e_score_correction_bias is a buffer in HF, a parameter in SGLang
        params.update({n: b for n, b in self.model.named_buffers() if n.endswith("e_score_correction_bias")})
        scales: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in named:
                if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in params:
                    scales[name.removesuffix("_scale_inv")] = t
                    continue
                if t.dtype == torch.float8_e4m3fn:
                    if name not in scales or name not in params:
                        return {"success": False, "message": f"bad tensor {name} (FP8 without its scale)"}
                    t = dequantize(t, scales.pop(name), dtype=params[name].dtype)
                if name not in params or params[name].shape != t.shape:
                    return {"success": False, "message": f"bad tensor {name}"}
                params[name].copy_(t)
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return {"success": True, "message": success}

    def route_flush_cache(self, body):
        return {}

    # weight_sync=distributed. Like SGLang's init_custom_process_group: scheduler TP rank i joins the
    # trainer's group as rank rank_offset + i (TCP rendezvous, store prefixed with the group name, then
    # torch's per-group and per-device prefixes), here as raw gloo groups (no torch registry: the stand-in
    # lives in the test process).
    def route_init_weights_update_group(self, body):
        timeout = datetime.timedelta(seconds=120)
        name, addr = body["group_name"], f"tcp://{body['master_address']}:{body['master_port']}"

        def join(i):
            store, rank, world = next(
                rendezvous(addr, body["rank_offset"] + i, body["world_size"], timeout=timeout)
            )
            store = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, store)))
            return torch.distributed.ProcessGroupGloo(store, rank, world, timeout)

        with ThreadPoolExecutor(self.tp_size) as pool:
            self.weight_groups[name] = list(pool.map(join, range(self.tp_size)))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def route_update_weights_from_distributed(self, body):
        ranks = self.weight_groups[body["group_name"]]  # KeyError (server dies) on an unknown group

        def receive(pg):
            out = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                # gloo has no float8: FP8 tensors travel as their bytes (weights.broadcast_sync.wire_tensor)
                pg.broadcast([t.view(torch.uint8) if t.element_size() == 1 else t], opts).wait()
                out.append((name, t))
            return out

        with ThreadPoolExecutor(len(ranks)) as pool:
            received = list(pool.map(receive, ranks))  # every TP rank receives every tensor
        return self._install(received[0], body, "Succeeded to update parameter online.")

    def route_destroy_weights_update_group(self, body):
        self.weight_groups.pop(body["group_name"], None)
        return {"success": True, "message": ""}

    def route_update_weights_from_disk(self, body):
        # like SGLang: load whatever the folder holds, tensor by tensor, no atomicity
        from pathlib import Path

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        named = (item for f in files for item in load_file(str(f)).items())
        return self._install(named, body, "Succeeded to update model weights.")

    def _tags(self, body) -> tuple[str, ...]:
        tags = body.get("tags")
        return tuple(self.memory_types) if not tags else tuple(tags)

    def route_release_memory_occupation(self, body):
        tags = self._tags(body)
        self.memory_log.append(("release", tags))
        twice = sorted(set(tags) & self.paused)
        if twice:  # torch_memory_saver would pause memory that is already unmapped
            raise RuntimeError(f"memory tags {twice} paused twice")
        unknown = sorted(set(tags) - set(self.memory_types))
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; SGLang has {list(self.memory_types)}")
        self.paused |= set(tags)
        return {}

    def route_resume_memory_occupation(self, body):
        tags = self._tags(body)
        self.memory_log.append(("resume", tags))
        for tag in tags:  # SGLang: offload_tags.remove(tag), a KeyError that kills the server
            if tag not in self.paused:
                raise KeyError(f"resume of memory tag {tag!r} that was not released")
            self.paused.remove(tag)
        return {}

    @property
    def released(self) -> set[str]:
        """The tags released and not yet resumed (older name of ``paused``)."""
        return self.paused

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
