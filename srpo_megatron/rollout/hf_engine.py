"""CPU rollout engine on transformers: batched, seeded sampling with the engine's per-token log-probs.

``HFEngine`` is the embedded default behind the ``RolloutEngine`` Protocol for CPU runs (tests, the demo,
evaluation). It runs its own decode loop over a transformers causal LM rather than ``model.generate`` so
that the log-prob semantics, seeding and stopping are ours to state and test:

- **Batching.** The ``len(prompts) * n`` sequences are decoded in chunks of ``max_batch_size`` rows:
  prompts left-padded into ``[B, L]`` with explicit position ids (``cumsum(mask) - 1``), then one token
  per step against the KV cache.
- **Log-probs (SGLang semantics).** For each sampled token we return ``log softmax(logits / T)`` at that
  token: the *unmodified* distribution at the sampling temperature, i.e. *before* top-k/top-p truncation
  and renormalisation. This is what SGLang's ``return_logprob`` reports by default, and what the TIS
  correction compares the trainer's ``π_old`` against (the trainer never sees the truncation either).
  Greedy decoding (``temperature == 0``) reports log-probs at temperature 1, as SGLang does. With
  ``params.top_logprobs`` = K the K most likely ids of the same distribution and their log-probs come
  back per position (``Completion.top_ids`` / ``top_logprobs``), as SGLang's ``output_top_logprobs``.
- **Seeding.** Every row draws from its own ``torch.Generator`` seeded from ``(seed, prompt index,
  sample index)``, so a seeded call gives the same tokens regardless of ``max_batch_size`` and of the
  prompts that follow in the call (up to float-level differences of batched vs. unbatched forwards).
  Without a seed, the row seeds come from torch's global RNG (``torch.manual_seed`` makes runs repeatable).
- **Stopping.** A row stops after emitting an EOS id (from the model's generation config, or given) or
  any of ``params.stop_token_ids``; the stop token *is* included in ``token_ids`` with its log-prob
  (finish reason ``"stop"``); otherwise it ends at ``max_new_tokens`` (``"length"``).
- **Weights.** ``update_weights`` takes HF-named tensors and is atomic: every name and shape is checked
  against the model before anything is copied; a missing, unexpected or mis-shaped tensor raises
  ``EngineError`` naming them and the old version keeps serving. Tied aliases (``lm_head.weight`` when
  tied to the embedding) are accepted but not required.
- **Routed experts (MoE).** With ``params.return_routed_experts`` each completion's
  ``routed_experts`` holds the experts the HF model's routers chose (their own choice: top-k of the
  logits for softmax routers, the biased, group-limited sigmoid choice of GLM-4.5 / DeepSeek-V3; dense
  first layers report zeros as SGLang does)
  at every forward the decode loop ran (prompt prefill, then one per fed-back token): int32
  ``[P + R - 1, layers, top_k]``, SGLang's layout (rollout routing replay, ``rollout/routed_experts.py``).
  They are read by forward hooks on the routers, not ``output_router_logits=True``, which makes the HF
  model also compute its load-balancing loss over the attention mask and fails on cached decode steps.
- **Abort.** ``abort_running()`` (thread-safe) makes every ``generate``/``generate_requests`` call that is
  running or waiting for the engine stop at the next decode step: its unfinished rows come back with
  finish reason ``"abort"`` and the tokens, log-probs and routed experts so far, rows not yet started with
  none (SGLang's abort of running and of waiting requests). Calls that start later are not affected.
  ``step_hook(step, aborted)`` runs after every decode step (tests: hold a generation at step k until an
  abort lands).
- **Memory.** On CPU there is no accelerator memory to free: ``release_memory`` only makes ``generate``
  refuse (as a released SGLang engine would), ``resume_memory`` lifts that.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from srpo_megatron.config import ConfigError
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.ops.fp8_blocks import fake_quantize
from srpo_megatron.rollout.base import Completion, EngineError, EngineHealth, SamplingParams, sample_seed
from srpo_megatron.rollout.gate import check_version, missing_names, tensor_problem
from srpo_megatron.rollout.hf_lora import inject_lora
from srpo_megatron.rollout.hf_moe_layout import file_format_params, gpt_oss_slice_params
from srpo_megatron.rollout.precision_audit import PrecisionAudit
from srpo_megatron.rollout.routed_experts import router_choice, router_layers
from srpo_megatron.rollout.true_on_policy import trainer_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFEngineConfig:
    """How to build the CPU transformers engine."""

    model_path: str = ""  # HF model directory (config.json + safetensors), or a directory holding gguf_file
    gguf_file: str | None = None  # a GGUF file name inside model_path (dequantized on load), else None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute/storage dtype of the weights
    max_batch_size: int = 64  # sequences decoded together in one batch (memory bound for the KV cache)
    eos_token_ids: tuple[int, ...] = ()  # stop ids always in force; empty = take them from the model
    initial_version: int = 0  # weight version reported for the weights loaded at construction
    precision: Literal["bf16", "fp8"] = "bf16"  # fp8: emulate an FP8 engine, dequantize(quantize(W))
    precision_audit: bool = False  # report Completion.precision_gap (rollout/precision_audit.py)
    # log-probs of a teacher-forced forward scored as the trainer scores (rollout/true_on_policy.py)
    true_on_policy_mode: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(
                f"rollout.max_batch_size={self.max_batch_size} must be >= 1: it is the number of sequences "
                "decoded together; use e.g. 64"
            )
        if self.initial_version < 0:
            raise ConfigError(f"rollout.initial_version={self.initial_version} must be >= 0")


def _model_eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is None:
            continue
        for e in [eos] if isinstance(eos, int) else list(eos):
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


def truncate_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside the top-k and the top-p nucleus (renormalised by the sampler).

    probs: [B, V] rows summing to 1. Returns [B, V]. The most likely token always survives; ties at the
    nucleus boundary are resolved by sort order. A token is kept by top-p if the mass strictly before it
    (in descending order) is < top_p, the usual nucleus definition (SGLang, vLLM).
    """
    if top_k is not None and 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs


class HFEngine:
    """Rollout engine over an in-memory transformers causal LM (CPU; also runs on one GPU)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 64,
        eos_token_ids: Sequence[int] | None = None,
        initial_version: int = 0,
        precision: str = "bf16",
        precision_audit: bool = False,
        true_on_policy_mode: bool = False,
    ) -> None:
        """Serve ``model`` (a ``*ForCausalLM``; put in eval mode, gradients off) as ``initial_version``.
        ``precision="fp8"`` emulates SGLang's blockwise-FP8 engine: every weight ``Fp8Layout`` keeps in FP8
        is replaced by ``dequantize(quantize(W))`` (128x128 blocks, ``ops.fp8_blocks``) at load and at
        every update, so rollouts see exactly the weights an FP8 engine computes with. ``precision_audit``
        keeps the as-sent layout weights and reports each completion's ``precision_gap`` (served vs sent
        weights, same arithmetic: ``rollout/precision_audit.py``). ``true_on_policy_mode`` reports each
        sampled token's log-prob from a teacher-forced forward scored with the trainer's own kernel
        (``rollout/true_on_policy.py``); the sampling is unchanged."""
        self._model = model.eval()
        for p in self._model.parameters():
            p.requires_grad_(False)
        self._device = next(model.parameters()).device
        self._max_batch_size = int(max_batch_size)
        self._eos_ids = tuple(eos_token_ids) if eos_token_ids else _model_eos_ids(model)
        self._version = int(initial_version)
        self._released = False
        self._inconsistent = ""  # non-empty: a copy failed half-way; generate refuses until a full update
        self._shut_down = False
        self._lock = threading.Lock()
        self._abort_lock = threading.Lock()  # guards _abort_events only (never held while decoding)
        self._abort_events: set[threading.Event] = set()  # one per generate call running or waiting
        # called after every decode step with (step number from 1, this call's abort event)
        self.step_hook: Callable[[int, threading.Event], None] | None = None
        forward_params = inspect.signature(type(model).forward).parameters
        # transformers 5 renamed the KV cache argument ``past_key_values`` -> ``cache``.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        # Names the engine accepts: every state_dict entry; required: one name per distinct parameter
        # (tied weights are listed once by named_parameters, the alias is optional).
        # Fused MoE experts are addressed by their per-expert file names (views into the fused tensors):
        # the shared gate checks file names and shapes, the update copies into the fused layout in place.
        state = dict(self._model.state_dict(keep_vars=True))
        # gpt-oss names its fused experts' slices x[e] (rollout.hf_moe_layout.gpt_oss_slice_params)
        views = gpt_oss_slice_params if _model_type(model) == "gpt_oss" else file_format_params
        self._params = views(state)
        required = {name for name, _ in self._model.named_parameters()}
        required |= {name for name, _ in self._model.named_buffers() if name in state}
        self._required = set(views({name: state[name] for name in required}))
        self._manifest = {name: tuple(t.shape) for name, t in self._params.items()}
        self._fp8 = Fp8Layout() if precision == "fp8" else None
        self._audit = PrecisionAudit(self._params) if precision_audit else None  # before the emulation
        self._lora: dict[str, torch.Tensor] | None = None  # PEFT adapters after the first update_lora
        self._true_on_policy = bool(true_on_policy_mode)
        self._emulate_fp8(self._params)

    @classmethod
    def from_config(cls, cfg: HFEngineConfig) -> HFEngine:
        """Load the model named by ``cfg`` (HF directory, or GGUF file inside it) and serve it."""
        from transformers import AutoModelForCausalLM

        if not cfg.model_path:
            raise ConfigError("rollout.model_path is empty: set it to an HF model directory")
        kwargs = {"dtype": _DTYPES[cfg.dtype]}
        if cfg.gguf_file:
            kwargs["gguf_file"] = cfg.gguf_file
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_path, **kwargs)
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot load an HF causal LM from {cfg.model_path!r}: {e}") from e
        model = model.to(_DTYPES[cfg.dtype])
        return cls(
            model,
            max_batch_size=cfg.max_batch_size,
            eos_token_ids=cfg.eos_token_ids or None,
            initial_version=cfg.initial_version,
            precision=cfg.precision,
            precision_audit=cfg.precision_audit,
            true_on_policy_mode=cfg.true_on_policy_mode,
        )

    # ------------------------------------------------------------------ state

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids every generation stops at besides ``stop_token_ids``."""
        return self._eos_ids

    @property
    def model(self) -> torch.nn.Module:
        """The served model (read-only use: scoring, evaluation)."""
        self._check_alive()
        return self._model

    def health(self) -> EngineHealth:
        if self._shut_down:
            return EngineHealth(ok=False, weight_version=self._version, detail="shut down")
        if self._inconsistent:
            return EngineHealth(ok=False, weight_version=self._version, detail=self._inconsistent)
        detail = "released (generate refused until resume_memory)" if self._released else "serving"
        return EngineHealth(ok=True, weight_version=self._version, detail=detail)

    def release_memory(self) -> None:
        self._check_alive()
        self._released = True

    def resume_memory(self) -> None:
        self._check_alive()
        self._released = False

    def shutdown(self) -> None:
        with self._lock:
            self._shut_down = True
            self._model = None  # type: ignore[assignment]
            self._params = {}

    def _check_alive(self) -> None:
        if self._shut_down:
            raise EngineError("the rollout engine was shut down; build a new one and resync its weights")

    # ---------------------------------------------------------------- weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Install a complete set of HF-named tensors as ``version`` — all or nothing.

        Every name and shape is validated before the first copy, so a bad update leaves the old version
        serving. ``version`` must be greater than the version served (versions only move forward).
        """
        with self._lock:
            self._check_alive()
            check_version(version, self._version, self._inconsistent, released=self._released)
            staged: dict[str, torch.Tensor] = {}
            duplicate, unexpected, misshaped, bad_dtype = [], [], [], []
            try:
                received = list(named_tensors)
            except Exception as e:  # the sender's stream broke: nothing was copied yet
                raise EngineError(
                    f"weight stream for version {version} failed before it was complete ({e!r}); nothing "
                    f"was installed, still serving version {self._version}"
                ) from e
            kinds = {"sent twice": duplicate, "unexpected": unexpected, "mis-shaped": misshaped}
            kinds["mis-typed"] = bad_dtype
            for name, tensor in received:
                problem = tensor_problem(name, tensor, self._manifest, set(staged))
                if problem:
                    kinds[problem[0]].append(problem[1])
                    continue
                target = self._params[name]
                if tensor.is_floating_point() != target.is_floating_point():
                    bad_dtype.append(f"{name}: got {tensor.dtype}, model has {target.dtype}")
                    continue
                staged[name] = tensor
            missing = missing_names(self._manifest, set(staged), self._required)
            problems = []
            if missing:
                problems.append(f"missing {len(missing)}: {_head(missing)}")
            if unexpected:
                problems.append(f"unexpected {len(unexpected)}: {_head(sorted(unexpected))}")
            if misshaped:
                problems.append(f"mis-shaped {len(misshaped)}: {_head(misshaped)}")
            if bad_dtype:
                problems.append(f"wrong dtype kind {len(bad_dtype)}: {_head(bad_dtype)}")
            if duplicate:
                problems.append(f"sent twice {len(duplicate)}: {_head(sorted(duplicate))}")
            problems += self._alias_conflicts(staged)
            if problems:
                raise EngineError(
                    f"weight update to version {version} rejected, still serving version {self._version}; "
                    "the sender's HF names/shapes do not match the engine's model (check the conversion "
                    "table and the model config): " + "; ".join(problems)
                )
            try:
                with torch.no_grad():
                    for name, tensor in staged.items():
                        self._params[name].copy_(tensor.to(self._device, non_blocking=False))
                    if self._audit is not None:
                        self._audit.record(staged)
                    self._emulate_fp8(staged)
            except Exception as e:  # a half-copied model must never serve
                self._inconsistent = (
                    f"weight update to version {version} failed half-way ({e}); the weights are a mixture "
                    "and generate is refused until a complete update succeeds"
                )
                raise EngineError(self._inconsistent) from e
            self._inconsistent = ""
            self._released = False  # a complete update makes the weights resident (as SGLang's does)
            self._version = int(version)

    def update_lora(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, config: dict
    ) -> None:
        """Install the policy's LoRA adapters (PEFT-named, full shapes; ``rollout.hf_lora``) as ``version``,
        all or nothing; the base weights stay as loaded. The model is wrapped with ``peft`` on the first
        call (``config``: the adapter_config dict); every adapter must come, with its PEFT shape."""
        with self._lock:
            self._check_alive()
            check_version(version, self._version, self._inconsistent, released=self._released)
            if self._lora is None:
                self._lora = inject_lora(self._model, config)
            received = dict(named_tensors)
            missing = sorted(set(self._lora) - set(received))
            unexpected = sorted(set(received) - set(self._lora))
            misshaped = [
                f"{n}: got {tuple(t.shape)}, engine has {tuple(self._lora[n].shape)}"
                for n, t in received.items()
                if n in self._lora and t.shape != self._lora[n].shape
            ]
            if missing or unexpected or misshaped:
                raise EngineError(
                    f"adapter update to version {version} rejected, still serving version {self._version}; "
                    f"missing {_head(missing)}, unexpected {_head(unexpected)}, mis-shaped {_head(misshaped)}"
                    ": the trainer's lora.rank/target_modules must match the engine's adapters"
                )
            with torch.no_grad():
                for name, tensor in received.items():
                    self._lora[name].copy_(tensor.to(self._device))
            self._released = False
            self._version = int(version)

    def _emulate_fp8(self, names: Iterable[str]) -> None:
        """``precision="fp8"``: the FP8-layout weights among ``names`` become dequantize(quantize(W))."""
        if self._fp8 is None:
            return
        with torch.no_grad():
            for name in names:
                if self._fp8.is_fp8(name):
                    p = self._params[name]
                    p.copy_(fake_quantize(p, self._fp8.block))

    def _alias_conflicts(self, staged: dict[str, torch.Tensor]) -> list[str]:
        """Tied names (same storage) sent with different values would make the result order-dependent."""
        problems = []
        by_storage: dict[int, str] = {}
        for name in staged:
            ptr = self._params[name].data_ptr()
            other = by_storage.setdefault(ptr, name)
            if other != name and not torch.equal(staged[other], staged[name]):
                problems.append(f"tied tensors {other} and {name} sent with different values")
        return problems

    # --------------------------------------------------------------- sampling

    def abort_running(self) -> int:
        """Abort every generate call running or waiting now (module doc); the number of calls told."""
        with self._abort_lock:
            for event in self._abort_events:
                event.set()
            return len(self._abort_events)

    @contextlib.contextmanager
    def _abortable(self):
        event = threading.Event()
        with self._abort_lock:
            self._abort_events.add(event)
        try:
            yield event
        finally:
            with self._abort_lock:
                self._abort_events.discard(event)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt; ``result[i][j]`` is prompt i's sample j."""
        with self._abortable() as aborted:
            return self._generate(prompts, params, aborted)

    def generate_requests(
        self, inputs: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per input with its own parameters (``n`` = 1; seed ``sample_seed(seed,
        prompt_offset, 0)``), as ``SGLangEngine.generate_requests``: continuations of partial rollouts.
        One abort reaches every request of the call."""
        if len(inputs) != len(params) or any(p.n != 1 for p in params):
            raise EngineError("generate_requests takes one SamplingParams with n=1 per input")
        with self._abortable() as aborted:
            return [self._generate([ids], p, aborted)[0][0] for ids, p in zip(inputs, params, strict=True)]

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, aborted: threading.Event
    ) -> list[list[Completion]]:
        with self._lock:
            self._check_alive()
            if self._released:
                raise EngineError("generate called while the engine's memory is released; call resume_memory")
            if self._inconsistent:
                raise EngineError(self._inconsistent)
            _validate(prompts, params, self._vocab_size())
            if params.seed is None:
                base_seed = int(torch.randint(0, 2**62, (1,)).item())
            else:
                base_seed = int(params.seed)
            rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
            out: list[list[Completion]] = [[] for _ in prompts]
            for start in range(0, len(rows), self._max_batch_size):
                chunk = rows[start : start + self._max_batch_size]
                for (i, _j), completion in zip(
                    chunk, self._decode(prompts, chunk, params, base_seed, aborted), strict=True
                ):
                    out[i].append(completion)
            if self._true_on_policy:  # the decode's log-probs give way to the trainer's arithmetic
                self._rescore(prompts, out, params.temperature)
            return out

    @property
    def true_on_policy_mode(self) -> bool:
        """Whether reported log-probs come from ``rollout.true_on_policy`` (constructor doc)."""
        return self._true_on_policy

    def rescore(
        self, prompts: Sequence[Sequence[int]], out: list[list[Completion]], temperature: float
    ) -> None:
        """Replace every completion's log-probs in ``out`` (``out[i]``: prompt i's) by the true on-policy
        ones, one padded width over all of them: multi-turn rollouts call it on finished trajectories."""
        with self._lock:
            self._check_alive()
            self._rescore(prompts, out, temperature)

    def _rescore(
        self, prompts: Sequence[Sequence[int]], out: list[list[Completion]], temperature: float
    ) -> None:
        """``true_on_policy_mode``: every completion's log-probs from ``rollout.true_on_policy`` (one padded
        width over the whole call, as the trainer pads the step's samples)."""
        done = [c for row in out for c in row]
        scored = trainer_logprobs(
            self._model,
            [list(prompts[c.prompt_index]) for c in done],
            [list(c.token_ids) for c in done],
            1.0 if temperature == 0.0 else temperature,  # greedy reports temperature-1 log-probs
            self._max_batch_size,
        )
        for completion, logprobs in zip(done, scored, strict=True):
            completion.logprobs = logprobs

    def _vocab_size(self) -> int:
        return int(self._model.get_output_embeddings().weight.shape[0])

    @torch.no_grad()
    def _decode(
        self,
        prompts: Sequence[Sequence[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        base_seed: int,
        aborted: threading.Event,
    ) -> list[Completion]:
        """Decode one batch of (prompt index, sample index) rows to completion (or to an abort)."""
        top_k = self._moe_top_k() if params.return_routed_experts else 0
        with _GateRecorder(self._model, top_k) if top_k else contextlib.nullcontext() as gates:
            return self._decode_rows(prompts, rows, params, base_seed, top_k, gates, aborted)

    def _decode_rows(
        self,
        prompts: Sequence[Sequence[int]],
        rows: list[tuple[int, int]],
        params: SamplingParams,
        base_seed: int,
        top_k: int,
        gates: _GateRecorder | None,
        aborted: threading.Event,
    ) -> list[Completion]:
        """``_decode``'s loop; ``gates`` records the routers' experts when ``top_k`` > 0."""
        dev = self._device
        bsz = len(rows)
        lengths = [len(prompts[i]) for i, _ in rows]
        width = max(lengths)
        input_ids, mask, positions = _left_padded([prompts[i] for i, _ in rows], width, dev)
        gens = [
            torch.Generator(device="cpu").manual_seed(sample_seed(base_seed, params.prompt_offset + i, j))
            for i, j in rows
        ]
        stop_ids = set(self._eos_ids) | {int(t) for t in params.stop_token_ids}
        greedy = params.temperature == 0.0
        temperature = 1.0 if greedy else params.temperature

        tokens = [[] for _ in rows]
        logprobs = [[] for _ in rows]
        k_top = params.top_logprobs
        tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]  # per row: (ids, logp)
        finished = [None] * bsz
        cache = None
        step_ids, step_pos = input_ids, positions
        routed: list[torch.Tensor] = []  # per forward: [B, positions, layers, top_k] expert ids (host)
        unfinished = "length"  # what a row that did not stop ends with
        for step in range(params.max_new_tokens):
            if aborted.is_set():  # checked between decode steps, as SGLang's scheduler does
                unfinished = "abort"
                break
            kwargs = {self._cache_kwarg: cache} if cache is not None else {}
            out = self._model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
            cache = getattr(out, "cache", None) or out.past_key_values
            if top_k:  # [B * positions, k] per layer -> [B, positions, layers, k]
                per_layer = [ids.reshape(bsz, -1, top_k) for ids in gates.take()]
                routed.append(torch.stack(per_layer, dim=2).to(torch.int32).cpu())
            # Log-probs in fp32 whatever the model dtype; the distribution the trainer re-scores.
            logp = torch.log_softmax(out.logits[:, -1, :].float() / temperature, dim=-1)  # [B, V]
            next_ids = logp.argmax(dim=-1) if greedy else _sample(logp, params, gens)
            chosen = logp.gather(-1, next_ids[:, None])[:, 0].tolist()
            top = logp.topk(min(k_top, logp.shape[-1]), dim=-1) if k_top else None  # SGLang's top logprobs
            ids_list = next_ids.tolist()
            for r in range(bsz):
                if finished[r] is not None:
                    continue
                tokens[r].append(ids_list[r])
                logprobs[r].append(chosen[r])
                if top is not None:
                    tops[r].append((top.indices[r].cpu(), top.values[r].cpu()))
                if ids_list[r] in stop_ids:
                    finished[r] = "stop"
            if self.step_hook is not None:
                self.step_hook(step + 1, aborted)
            if all(f is not None for f in finished):
                break
            step_ids = next_ids[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(bsz, 1)], dim=-1)
        experts = _routed_experts(routed, tokens, lengths, width) if top_k else [None] * bsz
        gaps = [None] * bsz
        if self._audit is not None:
            gaps = self._audit.gaps(self._model, [list(prompts[i]) for i, _ in rows], tokens, temperature)
        return [
            Completion(
                prompt_index=i,
                token_ids=tokens[r],
                logprobs=logprobs[r],
                finish_reason=finished[r] or unfinished,
                weight_version=self._version,
                routed_experts=experts[r],
                top_ids=_stack_rows([ids for ids, _ in tops[r]], k_top, torch.long) if k_top else None,
                top_logprobs=_stack_rows([lp for _, lp in tops[r]], k_top, torch.float32) if k_top else None,
                meta={"sample_index": j},
                precision_gap=gaps[r],
            )
            for r, (i, j) in enumerate(rows)
        ]

    def _moe_top_k(self) -> int:
        """Experts per token of an MoE model (0 for a dense one: nothing to report). Qwen3-MoE says
        ``num_experts``, GLM-4.5 and DeepSeek-V3 ``n_routed_experts``."""
        config = getattr(self._model, "config", None)
        if not (getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)):
            return 0
        return int(config.num_experts_per_tok)


def _left_padded(
    prompts: Sequence[Sequence[int]], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts left-padded to ``width``: (input ids, attention mask, position ids), each [B, width]."""
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for r, prompt in enumerate(prompts):
        input_ids[r, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[r, width - len(prompt) :] = 1
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _sample(logp: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row from log-probs [B, V] after top-k / top-p, each row with its own CPU generator."""
    probs = truncate_top_k_top_p(logp.exp(), params.top_k, params.top_p)
    picks = [torch.multinomial(probs[r].cpu(), 1, generator=gens[r])[0] for r in range(logp.shape[0])]
    return torch.stack(picks).to(logp.device)


def _routed_experts(
    routed: list[torch.Tensor], tokens: list[list[int]], lengths: list[int], width: int
) -> list[torch.Tensor | None]:
    """Each row's experts in SGLang's layout: the prompt positions, then every response token but the last
    (``routed``: per forward, [B, positions, layers, top_k]; None for a row aborted before its prefill)."""
    experts: list[torch.Tensor | None] = [None] * len(tokens)
    for r, row in enumerate(tokens):
        if not row:  # aborted before its prefill: nothing was forwarded
            continue
        decoded = [routed[t][r, 0] for t in range(1, len(row))]
        prompt = routed[0][r, width - lengths[r] :]
        experts[r] = torch.cat([prompt, *(d[None] for d in decoded)])
    return experts


def _stack_rows(rows: list[torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[R, K]`` from R per-token rows of K (``[0, K]`` for an empty response)."""
    return torch.stack(rows).to(dtype) if rows else torch.zeros(0, k, dtype=dtype)


def _model_type(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _validate(prompts: Sequence[Sequence[int]], params: SamplingParams, vocab: int) -> None:
    if params.n < 1:
        raise EngineError(f"SamplingParams.n={params.n} must be >= 1")
    if params.temperature < 0:
        raise EngineError(f"SamplingParams.temperature={params.temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < params.top_p <= 1.0:
        raise EngineError(f"SamplingParams.top_p={params.top_p} must be in (0, 1]")
    if params.max_new_tokens < 1:
        raise EngineError(f"SamplingParams.max_new_tokens={params.max_new_tokens} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise EngineError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise EngineError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def _head(items: list[str], k: int = 8) -> str:
    return ", ".join(items[:k]) + (f", … (+{len(items) - k})" if len(items) > k else "")


class _GateRecorder(contextlib.AbstractContextManager):
    """Forward hooks on every MoE router (``*.mlp.gate``) of an HF model, keeping the experts each forward
    used: transformers >= 5 routers return ``(logits, weights, indices)`` where ``indices`` is the router's
    own choice (for the GLM-4.5 / DeepSeek-V3 sigmoid router: top-k of the scores plus
    ``e_score_correction_bias`` within the chosen groups, not the top-k of the logits); older ones are a
    ``Linear`` whose logits' top-k is the choice (softmax keeps the order). Layers without a router (dense
    first layers) report expert 0 k times, as SGLang's capture buffer (zero-filled, never written there)."""

    def __init__(self, model: torch.nn.Module, top_k: int) -> None:
        self._layers, routers = router_layers(model)
        self._index = [i for i, _ in routers]
        self._gates = [m for _, m in routers]
        self._top_k, self._seen, self._hooks = top_k, [], []

    def __enter__(self) -> _GateRecorder:
        self._hooks = [g.register_forward_hook(self._hook) for g in self._gates]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    def _hook(self, module, args, output) -> None:
        self._seen.append(router_choice(output, self._top_k).detach())

    def take(self) -> list[torch.Tensor]:
        """The last forward's ``[tokens, top_k]`` expert ids per layer (and reset)."""
        out, self._seen = self._seen, []
        if len(out) != len(self._gates):
            raise EngineError(f"{len(out)} router outputs for {len(self._gates)} MoE layers in one forward")
        if len(out) == self._layers:
            return out
        full = [torch.zeros_like(out[0]) for _ in range(self._layers)]
        for i, ids in zip(self._index, out, strict=True):
            full[i] = ids
        return full
