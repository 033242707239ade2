"""The recipe's ``rollout`` section: which engine, where it runs, how weights reach it.

Placement and weight sync, and which pairs load (every other pair is refused here, naming the keys):

- colocated + tensor: the engine shares the trainer's GPUs; weights go over CUDA IPC (the default).
- colocated + disk: safetensors shards written to ``disk_sync_dir`` and loaded by the engine.
- separate + distributed: NCCL broadcast from the trainer's stage senders into every server.
- separate + disk: one folder per server under ``disk_sync_dir``.
- separate + tensor: refused (CUDA IPC needs the engine on the trainer's GPUs).
- colocated + distributed: refused (the broadcast group spans servers on other GPUs).
- the CPU engine (``engine: hf``) runs inside the trainer: colocated only (no ``sglang`` section needed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from srpo_megatron.config.loading import ConfigError, warn_config

WeightSyncKind = Literal["tensor", "distributed", "disk"]
SamplingCriterion = Literal["auto", "mixed", "std"]
SAMPLING_CRITERIA: tuple[str, ...] = ("auto", "mixed", "std")


@dataclass
class SGLangEngineConfig:
    """How to reach (or start) SGLang and how to push weights into it."""

    mode: Literal["offline", "http"] = "offline"  # offline Engine in a child process, or an HTTP server
    # (placement=separate always uses the HTTP servers the job started, whatever the mode)
    model_path: str = ""  # HF model directory the engine serves (also gives the weight manifest)
    url: str = ""  # http mode: base URL(s) of running servers, comma-separated (one per engine)
    weight_sync: WeightSyncKind = "tensor"  # tensor: colocated CUDA IPC; distributed: NCCL broadcast; disk
    bucket_bytes: int = 512 * 1024**2  # max bytes per weight-update request
    disk_sync_dir: str = ""  # weight_sync=disk: folder the safetensors shards are written to
    request_timeout_s: float = (
        1800.0  # one request (one sample's generate, one update); beyond it: dead engine
    )
    concurrent_requests: int = 512  # /generate requests in flight per engine, one per sample (SGLang batches)
    startup_timeout_s: float = 1200.0  # offline: model load + CUDA graph capture
    deterministic: bool = False  # enable_deterministic_inference: seeded samples repeat, but ~slower
    memory_saver: bool | None = None  # enable_memory_saver; None = on when colocated (release/resume)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # extra ServerArgs (tp_size, mem_fraction_…)

    def __post_init__(self) -> None:
        if self.mode == "http" and not self.url:
            raise ConfigError("rollout.sglang.url is empty but mode=http: give the server's base URL")
        if self.mode == "offline" and not self.model_path:
            raise ConfigError("rollout.sglang.model_path is empty: the offline Engine needs an HF model dir")
        if self.weight_sync == "disk" and not self.disk_sync_dir:
            raise ConfigError(
                "rollout.sglang.weight_sync=disk needs disk_sync_dir: a folder on storage both trainer "
                "and engine can read"
            )
        if self.concurrent_requests < 1:
            raise ConfigError(
                f"rollout.sglang.concurrent_requests={self.concurrent_requests} must be >= 1: the number of "
                "one-sample /generate requests each engine has in flight (SGLang batches them); e.g. 512"
            )
        if self.bucket_bytes < 1024**2:
            raise ConfigError(f"rollout.sglang.bucket_bytes={self.bucket_bytes} is below 1 MiB; use ≥ 64 MiB")

    @property
    def tp_size(self) -> int:
        """The engine's tensor-parallel size (SGLang's ``tp_size`` server argument)."""
        return int(self.engine_kwargs.get("tp_size", 1))


@dataclass
class RolloutConfig:
    """How rollouts are generated and by which engine."""

    engine: Literal["hf", "sglang"] = "hf"  # hf = transformers CPU engine (embedded); sglang = GPU clusters
    placement: Literal["colocated", "separate"] = "colocated"  # engines share the trainer's devices or not
    engine_nodes: int = 0  # nodes reserved for separate SGLang engines (placement=separate)
    gpus_per_engine: int = 0  # colocated: devices (trainer ranks) per engine; 0 = engine TP (hf: parallel.tp)
    sglang: SGLangEngineConfig | None = None  # engine=sglang: offline Engine / HTTP server and weight sync
    prompts_per_step: int = 32  # B: prompts per training step (paper: 32)
    group_size: int = 8  # G: rollouts per prompt (paper: 8)
    temperature: float = 1.0  # sampling temperature (paper: 1.0); the loss divides logits by it
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling (-1 = off)
    max_new_tokens: int = 8192  # response length limit (paper: 8192)
    max_batch_size: int = 64  # sequences the CPU engine decodes together
    reward_fns: dict[str, str] = field(default_factory=dict)  # extra verifiers: kind -> "module:function"
    reward_workers: int = 2  # processes scoring rewards (0 = threads in the trainer process)
    reward_timeout_s: float = 10.0  # per-sample reward timeout; a timeout gives reward 0 (counted)
    reward_import_timeout_s: float = 120.0  # a reward module whose import takes longer fails the start
    # A step whose every reward failed (raised or timed out) stops the run with one line; true trains on
    # (those rewards are 0). More than half failed: a warning with the first messages
    # (trainer/collect/reward_errors.py).
    allow_reward_errors: bool = False
    # MoE: the engine reports each token's experts and the policy's scoring and training passes replay them
    # (rollout routing replay, "R3"; the EMA teacher is not replayed). Needs an MoE model.
    routing_replay: bool = False
    # Off-policy rollouts (separate placement only): the engines generate the batches of up to N steps
    # ahead while the trainer trains (0 = on-policy, today's synchronous step). A sample whose weight
    # version is more than N behind the trainer's when it would be trained is dropped (async/dropped_stale).
    off_policy_steps: int = 0
    # Partial rollouts (needs off_policy_steps >= 1): a generation unfinished at a weight sync is aborted,
    # kept, and continued with the new weights; every token records the version that generated it.
    partial: bool = False
    # Dynamic sampling (DAPO): keep only groups that carry signal, drawing more prompts, up to
    # max_sampling_rounds rounds per step, until prompts_per_step such groups are complete
    # (trainer/collect/sample_pool.py).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # rounds of prompts per step before the batch is topped up
    # which groups carry signal: auto = those loss.mode trains with a nonzero term; mixed = some members
    # pass loss.success_threshold, some not; std = the group's reward std > dynamic_sampling_std_eps (DAPO)
    dynamic_sampling_criterion: SamplingCriterion = "auto"
    dynamic_sampling_std_eps: float = 1e-6  # rewards whose sample std is at most this count as constant
    # Parity diagnostic: the engine returns its top-K log-probs per response token (SGLang
    # ``top_logprobs_num``) and the scoring pass logs KL(engine‖trainer) over those ids
    # (logprob/topk_kl_mean, logprob/topk_kl_max); 0 = off. Off by default: on SGLang it adds a top-k per
    # decoded token and K [logprob, id, text] triples per token to every generate response.
    parity_top_k: int = 0
    # The engine's weight precision: bf16 = the trainer's weights as they are; fp8 = the engine serves
    # 128x128-block e4m3 weights (SGLang ``quantization=fp8``) and every sync quantizes them, the CPU
    # engine emulating it with dequantize(quantize(W)) (README "Low precision"). Pair fp8 with an IS
    # correction (loss.is_correction: icepop or mis) for the precision gap it opens.
    precision: Literal["bf16", "fp8"] = "bf16"
    # CPU engine: report each sampled token's log-prob from a teacher-forced forward scored by the
    # trainer's kernel (rollout/true_on_policy.py; slime's --true-on-policy-mode): fp32 gap exactly 0
    true_on_policy_mode: bool = False
    # Multi-turn, tool-calling rollouts (rollout/multi_turn.py): the environment that answers each
    # assistant turn, "package.module:Factory" (code that runs: the trust rule of reward_fns); "" =
    # single-turn. max_new_tokens then bounds the whole trajectory (assistant and tool tokens).
    environment: str = ""
    max_turns: int = 4  # assistant turns per trajectory; more without the environment done = truncated
    tool_timeout_s: float = 10.0  # one environment step; past it the step is a fault (counted)
    max_tool_output_tokens: int = 512  # a tool message's content is clipped to this many tokens (counted)
    # an environment step that raised or timed out: continue (the error is the tool's answer, the
    # trajectory goes on and is scored as usual) or fail (the trajectory ends and its reward is 0)
    on_tool_fault: Literal["continue", "fail"] = "continue"

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_rewards()
        self._check_engine()
        self._check_engine_resources()
        self._check_off_policy()
        self._check_dynamic_sampling()
        self._check_environment()

    def _check_sampling(self) -> None:
        """Sampling parameters and group shape."""
        if self.prompts_per_step < 1 or self.group_size < 2:
            raise ConfigError(
                f"rollout.prompts_per_step={self.prompts_per_step} must be >= 1 and rollout.group_size="
                f"{self.group_size} >= 2 (group-relative advantages and siblings need at least 2 rollouts)"
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ConfigError(
                f"rollout: temperature={self.temperature} must be > 0, top_p={self.top_p} in (0, 1], "
                f"max_new_tokens={self.max_new_tokens} >= 1"
            )
        if self.parity_top_k < 0:
            raise ConfigError(
                f"rollout.parity_top_k={self.parity_top_k} must be >= 0 (0 = off; e.g. 5 logs the "
                "trainer-vs-engine KL over the engine's top-5 tokens)"
            )
        if self.true_on_policy_mode and self.engine != "hf":
            raise ConfigError(
                f"rollout.true_on_policy_mode=true needs rollout.engine=hf (got {self.engine!r}): only the "
                "CPU engine rescores its tokens with the trainer's kernel; set it to false for SGLang"
            )
        if (self.top_k != -1 and self.top_k < 1) or self.max_batch_size < 1:
            raise ConfigError(
                f"rollout.top_k={self.top_k} must be -1 (off) or >= 1, rollout.max_batch_size="
                f"{self.max_batch_size} >= 1"
            )

    def _check_rewards(self) -> None:
        """Reward workers, timeouts and extra verifiers."""
        if self.reward_workers < 0 or self.reward_timeout_s <= 0 or self.reward_import_timeout_s <= 0:
            raise ConfigError(
                f"rollout.reward_workers={self.reward_workers} must be >= 0 (0 = threads), "
                f"rollout.reward_timeout_s={self.reward_timeout_s} and rollout.reward_import_timeout_s="
                f"{self.reward_import_timeout_s} > 0 (seconds)"
            )
        for kind, target in self.reward_fns.items():
            module, sep, name = target.partition(":")
            if not (sep and module and name):
                raise ConfigError(
                    f"rollout.reward_fns.{kind}: {target!r} must look like 'package.module:function'"
                )

    def _check_engine(self) -> None:
        """Engine and weight-sync pairs per placement (module docstring)."""
        if self.engine == "sglang" and self.sglang is None:
            raise ConfigError(
                "rollout.engine=sglang needs a rollout.sglang section (at least model_path, the HF folder "
                "the engine serves; see examples/qwen3_8b_srpo.yaml)"
            )
        if self.placement == "separate" and self.engine == "hf":
            raise ConfigError(
                "rollout.placement=separate needs rollout.engine=sglang; the CPU engine runs in the trainer"
            )
        if self.placement == "separate" and self.sglang is not None and self.sglang.weight_sync == "tensor":
            raise ConfigError(
                "rollout.placement=separate cannot use rollout.sglang.weight_sync=tensor (CUDA IPC needs the "
                "engine on the trainer's GPUs); use distributed (NCCL broadcast) or disk"
            )
        if (
            self.placement == "colocated"
            and self.sglang is not None
            and self.sglang.weight_sync == "distributed"
        ):
            raise ConfigError(
                "rollout.placement=colocated cannot use rollout.sglang.weight_sync=distributed: the NCCL "
                "broadcast streams weights from the trainer into servers on their own GPUs (separate "
                "placement), while a colocated engine shares the trainer's GPUs and takes them over CUDA "
                "IPC; use weight_sync: tensor (or disk), or rollout.placement: separate with engine_nodes"
            )

    def _check_engine_resources(self) -> None:
        """Engine nodes, devices per engine and routing replay."""
        if self.engine_nodes < 0:
            raise ConfigError(
                f"rollout.engine_nodes={self.engine_nodes} must be >= 0 (nodes for the engines)"
            )
        if self.placement == "separate" and self.engine_nodes < 1:
            raise ConfigError(
                "rollout.placement=separate needs rollout.engine_nodes >= 1: the job starts the SGLang "
                "servers on nodes of their own; set rollout.engine_nodes (e.g. 1) or use placement colocated"
            )
        if self.placement == "colocated" and self.engine_nodes:
            raise ConfigError(
                f"rollout.engine_nodes={self.engine_nodes} only applies to placement separate (colocated "
                "engines run on the training GPUs); set it to 0 or use rollout.placement: separate"
            )
        if (
            self.routing_replay
            and self.sglang is not None
            and self.sglang.engine_kwargs.get("enable_return_routed_experts", True) is not True
        ):
            raise ConfigError(
                "rollout.routing_replay=true needs the SGLang engine to report routed experts, but "
                "rollout.sglang.engine_kwargs.enable_return_routed_experts="
                f"{self.sglang.engine_kwargs['enable_return_routed_experts']!r}; drop that key (routing "
                "replay turns it on) or set rollout.routing_replay=false"
            )
        if self.gpus_per_engine < 0:
            raise ConfigError(f"rollout.gpus_per_engine={self.gpus_per_engine} must be >= 0 (0 = engine TP)")

    def _check_off_policy(self) -> None:
        """Off-policy and partial rollouts."""
        if self.off_policy_steps < 0:
            raise ConfigError(
                f"rollout.off_policy_steps={self.off_policy_steps} must be >= 0 (0 = on-policy, 1 = one "
                "step off, N = up to N steps off)"
            )
        if self.off_policy_steps and self.placement == "colocated":
            raise ConfigError(
                f"rollout.off_policy_steps={self.off_policy_steps} needs rollout.placement: separate: "
                "colocated engines share the trainer's GPUs, so generation and training cannot overlap; "
                "set rollout.off_policy_steps: 0, or use placement separate with rollout.engine_nodes"
            )
        if self.partial and not self.off_policy_steps:
            raise ConfigError(
                "rollout.partial=true needs rollout.off_policy_steps >= 1: only an off-policy run syncs "
                "weights while generations are unfinished; set off_policy_steps (e.g. 1) or partial: false"
            )

    def _check_dynamic_sampling(self) -> None:
        """Dynamic sampling's keys; a set key that does nothing without it gets a warning."""
        if self.max_sampling_rounds < 1:
            raise ConfigError(
                f"rollout.max_sampling_rounds={self.max_sampling_rounds} must be >= 1 (rounds of prompts "
                "drawn per step when rollout.dynamic_sampling is on)"
            )
        if self.dynamic_sampling_criterion not in SAMPLING_CRITERIA:
            raise ConfigError(
                f"rollout.dynamic_sampling_criterion={self.dynamic_sampling_criterion!r} is not a criterion; "
                f"choose one of {list(SAMPLING_CRITERIA)} (auto follows loss.mode)"
            )
        if not self.dynamic_sampling_std_eps >= 0:
            raise ConfigError(
                f"rollout.dynamic_sampling_std_eps={self.dynamic_sampling_std_eps} must be >= 0 (a reward "
                "standard deviation; 1e-6 as slime)"
            )
        if not self.dynamic_sampling:
            defaults = {f.name: f.default for f in fields(self)}
            unused = [
                f"rollout.{k}={getattr(self, k)!r}"
                for k in ("max_sampling_rounds", "dynamic_sampling_criterion", "dynamic_sampling_std_eps")
                if getattr(self, k) != defaults[k]
            ]
            if unused:
                warn_config(
                    f"{', '.join(unused)} does nothing while rollout.dynamic_sampling is false (every group "
                    "is trained); set rollout.dynamic_sampling=true or drop the key"
                )

    def _check_environment(self) -> None:
        """Multi-turn keys; what multi-turn rollouts do not support yet is refused by name."""
        if self.max_turns < 1 or self.tool_timeout_s <= 0 or self.max_tool_output_tokens < 1:
            raise ConfigError(
                f"rollout.max_turns={self.max_turns} must be >= 1, rollout.tool_timeout_s="
                f"{self.tool_timeout_s} > 0 (seconds) and rollout.max_tool_output_tokens="
                f"{self.max_tool_output_tokens} >= 1"
            )
        if self.on_tool_fault not in ("continue", "fail"):
            raise ConfigError(
                f"rollout.on_tool_fault={self.on_tool_fault!r} is not a choice; use continue (the error is "
                "the tool's answer) or fail (the trajectory ends with reward 0)"
            )
        if not self.environment:
            return
        module, sep, name = self.environment.partition(":")
        if not (sep and module and name):
            raise ConfigError(
                f"rollout.environment={self.environment!r} must look like 'package.module:Factory' (e.g. "
                "'srpo_megatron.rollout.environments.calculator:CalculatorEnv'), or be empty (single-turn)"
            )
        unsupported = [  # rollout.partial is supported: an aborted turn is continued (rollout/multi_turn.py)
            (self.routing_replay, "rollout.routing_replay"),
            (self.parity_top_k > 0, "rollout.parity_top_k"),
        ]
        for on, key in unsupported:
            if on:
                raise ConfigError(
                    f"{key} is not supported with rollout.environment={self.environment!r} yet (multi-turn "
                    f"rollouts report neither experts nor top-k per turn); turn "
                    f"{key} off or set rollout.environment to ''"
                )

    def engine_size(self) -> int:
        """Trainer ranks (devices) per colocated engine: ``gpus_per_engine`` or the engine's TP size."""
        if self.gpus_per_engine:
            return self.gpus_per_engine
        return self.sglang.tp_size if self.sglang is not None else 1

    def num_engines(self, world_size: int) -> int:
        """Colocated engines for a trainer world: world ÷ ranks per engine (must divide)."""
        size = self.engine_size()
        if world_size % size:
            raise ConfigError(
                f"rollout.gpus_per_engine={size} does not divide the {world_size} trainer ranks; pick a "
                "divisor so every engine owns whole devices"
            )
        return world_size // size
