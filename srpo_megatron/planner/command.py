"""`srpo plan RECIPE --cluster FILE --nodes N [--override KEY=VALUE ...] [--json]`: will the recipe fit?

Reads the recipe (with overrides) and the cluster file, prints per GPU the memory of the train and
rollout phases of the worst pipeline stage, the peak against the GPU's memory, what stays resident
across phases, and the layouts that fit on the same GPUs ranked by :func:`memory.rank_key`. Exit status
0 when the recipe fits, 3 when it does not (2 for bad input).

The recipe loads exactly as ``srpo train`` loads it (``srpo_megatron.config.load_recipe``: ``base:``,
overrides, every check), and the plan reads the typed sections, besides the model, rollout and batch sizes:
``parallel.tp/pp/cp/ep/etp``, ``parallel.distributed_optimizer``, ``parallel.sequence_parallel`` [on when TP
> 1], ``performance.recompute``, ``performance.overlap_comm`` [auto: on with the distributed optimizer],
``model.params_dtype`` [auto: bf16], ``parallel.offload_during_rollout``, ``parallel.teacher_offload``,
``parallel.teacher_fp32`` and ``performance.fused_output`` [auto: on] (see memory.py for which of these the
trainer implements today). "auto" resolves as on a GPU machine, which is what is planned. The model's HF
config is read from ``model.hf_dir``; when that folder is not on this machine (a cluster path) and its name
is one of the packaged configs (``planner/hf_configs/``: Qwen3, DeepSeek-V3, GLM-4.5, GLM-4.5-Air,
gpt-oss-20b/120b; the hub's config.json files), the packaged config is used and named in the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from srpo_megatron.config import ConfigError, TrainConfig, load_cluster, load_recipe
from srpo_megatron.conversion.output_guard import check_conversion_sizes
from srpo_megatron.models.performance import fused_output
from srpo_megatron.planner.memory import (
    SGLANG_SWA_FULL_TOKENS_RATIO,
    GiB,
    Plan,
    PlanSettings,
    fitting_layouts,
    plan_layout,
)
from srpo_megatron.planner.model import (
    Layout,
    ModelShape,
    PlanError,
    active_params,
    mtp_params,
    router_buffer_elements,
    stage_param_counts,
)

HF_CONFIG_DIR = Path(__file__).with_name("hf_configs")
EXIT_DOES_NOT_FIT = 3


def packaged_configs() -> list[str]:
    return sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))


def resolve_hf_config(hf_dir: str) -> tuple[dict, str]:
    """The HF config of ``model.hf_dir`` (or the packaged one of the same name) and where it came from."""
    path = Path(hf_dir) / "config.json"
    check_conversion_sizes(Path(hf_dir))  # a converter output whose files changed size: one line
    if path.is_file():
        return json.loads(path.read_text()), str(path)
    name = Path(hf_dir.rstrip("/")).name.lower()
    for stem in packaged_configs():
        if stem.lower() == name:
            packaged = HF_CONFIG_DIR / f"{stem}.json"
            return json.loads(
                packaged.read_text()
            ), f"packaged {stem} config ({hf_dir} is not on this machine)"
    raise ConfigError(
        f"model.hf_dir={hf_dir!r}: no config.json there and no packaged config named {name!r}; run the "
        f"planner where the model folder is readable, or name the folder like one of {packaged_configs()}"
    )


def settings_from_recipe(
    cfg: TrainConfig, gpus: int, gpus_per_node: int, gpu_bytes: int
) -> tuple[ModelShape, PlanSettings, str]:
    """(model shape, plan settings, config source) of a loaded recipe: every value is read from the
    typed ``TrainConfig`` the trainer runs, so the planner models no key the trainer would refuse."""
    par, perf, roll = cfg.parallel, cfg.performance, cfg.rollout
    hf_config, source = resolve_hf_config(cfg.model.hf_dir)
    shape = ModelShape.from_hf(hf_config)
    sizes = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep, "etp": par.etp}
    per_replica = par.tp * par.pp * par.cp
    if gpus % per_replica:
        raise ConfigError(
            f"parallel tp*pp*cp = {per_replica} does not divide the {gpus} GPUs of the request; "
            "change --nodes or the parallel sizes"
        )
    layout = Layout(dp=gpus // per_replica, **sizes)
    # The plan is for GPUs: "auto" choices resolve as on CUDA (models/performance.py of the trainer).
    sp = par.tp > 1 if par.sequence_parallel is None else par.sequence_parallel
    teacher = cfg.loss.mode != "grpo"
    kwargs = roll.sglang.engine_kwargs if roll.sglang is not None else {}
    settings = PlanSettings(
        layout=layout,
        gpu_bytes=gpu_bytes,
        gpus_per_node=gpus_per_node,
        params_bytes=4 if cfg.model.params_dtype == "fp32" else 2,
        distributed_optimizer=par.distributed_optimizer,
        overlap_grad_reduce=par.distributed_optimizer and perf.overlap_comm in ("auto", "on"),
        sequence_parallel=sp,
        recompute=perf.recompute,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.model.max_sequence_length,
        sequences_per_step=roll.prompts_per_step * roll.group_size // cfg.train.mini_batches,
        teacher=teacher,
        # no fp32 EMA copy without an EMA teacher (GRPO has no teacher; frozen / trust_region keep none)
        teacher_fp32=par.teacher_fp32 if (teacher and cfg.teacher.kind == "ema") else "none",
        teacher_offload=par.teacher_offload,
        offload_during_rollout=par.offload_during_rollout,
        engine="none" if roll.engine != "sglang" else roll.placement,
        engine_tp=int(kwargs.get("tp_size", 1)),
        engine_mem_fraction=float(kwargs.get("mem_fraction_static", 0.6)),
        rollout_seq_len=cfg.data.max_prompt_tokens + roll.max_new_tokens,
        engine_swa_ratio=(
            None
            if kwargs.get("disable_hybrid_swa_memory")
            else float(kwargs.get("swa_full_tokens_ratio", SGLANG_SWA_FULL_TOKENS_RATIO))
        ),
        fused_output=fused_output(perf),
        routing_replay=roll.routing_replay,
        lora=_lora_spec(cfg, hf_config),
    )
    return shape, settings, source


def _lora_spec(cfg: TrainConfig, hf_config: dict) -> tuple | None:
    """``PlanSettings.lora``: the architecture and the ``lora`` section, with ``lora.rank > 0``."""
    if cfg.lora.rank <= 0:  # a recipe key (``enabled`` is its property)
        return None
    from srpo_megatron.models.architecture import Architecture

    return Architecture.from_hf(hf_config), cfg.lora


def plan_recipe(
    recipe: str | Path, overrides: list[str], gpus: int, gpus_per_node: int, gpu_bytes: int
) -> tuple[Plan, list[Plan], str]:
    """(the recipe's plan, the fitting layouts ranked, the config source); the recipe loads as
    ``srpo train`` loads it (``load_recipe``), so a key the trainer refuses is refused here too."""
    cfg = load_recipe(recipe, list(overrides))
    shape, settings, source = settings_from_recipe(cfg, gpus, gpus_per_node, gpu_bytes)
    try:
        plan = plan_layout(shape, settings)
    except PlanError as e:
        raise ConfigError(f"{recipe}: {e}") from None
    return plan, fitting_layouts(shape, replace(settings), gpus), source


def model_notes(shape: ModelShape | None) -> list[str]:
    """What the parameter count includes and leaves out (MoE active share, buffers, MTP, hub dtype)."""
    notes: list[str] = []
    if shape is None:
        return notes
    if shape.is_moe:
        notes.append(f"  active per token: {active_params(shape) / 1e9:.2f} B (embeddings included)")
    if shape.router_expert_bias:
        notes.append(
            f"  not parameters: {router_buffer_elements(shape)} fp32 expert-bias buffer elements (no "
            "gradient or optimizer state; frozen unless moe.expert_bias_update_rate > 0)"
        )
    if shape.mtp_layers:
        notes.append(
            f"  not in the policy: {shape.mtp_layers} MTP layer(s), {mtp_params(shape) / 1e9:.2f} B params "
            "(skipped on import, re-emitted on export)"
        )
    if shape.hub_quantization:
        notes.append(
            f"  hub weights are {shape.hub_quantization}: planned as bf16 (the policy trains bf16 and the "
            "engine receives its bf16 weights)"
        )
    return notes


def lora_figures(cfg: TrainConfig, plan: Plan) -> dict[str, int] | None:
    """``lora.rank > 0``: the adapters' values and bytes on one GPU of the plan's worst stage
    (``planner/lora.py``), beside the plan, whose per-component table plans the frozen base
    (``memory._lora_rows``); ``teacher_full_bytes``: what a full-model EMA teacher would hold instead."""
    if not cfg.lora.enabled or plan.shape is None:
        return None
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.planner.lora import lora_plan

    hf_config, _ = resolve_hf_config(cfg.model.hf_dir)
    lay = plan.layout
    stage_params = sum(stage_param_counts(plan.shape, lay, plan.stage.stage))
    lp = lora_plan(
        Architecture.from_hf(hf_config), cfg.lora, lay.tp, lay.pp, lay.ep, lay.etp, lay.dp,
        plan.settings.distributed_optimizer, plan.settings.teacher_fp32 != "none", stage_params,
    )  # fmt: skip
    return {**dataclasses.asdict(lp), "teacher_saving_bytes": lp.teacher_saving}


def format_lora(fig: dict[str, int]) -> str:
    per_gpu = fig["adapter_params_per_gpu"] / 1e6
    return (
        f"LoRA: {fig['adapter_params'] / 1e6:.2f} M adapter params ({per_gpu:.2f} M per GPU): grads "
        f"{fig['grad_bytes'] / GiB:.3f} GiB + optimizer {fig['optimizer_bytes'] / GiB:.3f} GiB; "
        f"EMA teacher {fig['teacher_bytes'] / GiB:.3f} GiB (fp32 adapters) instead of "
        f"{fig['teacher_full_bytes'] / GiB:.2f} GiB; base weights frozen (no grads, no optimizer state)"
    )


def format_plan(plan: Plan, ranked: list[Plan], source: str) -> str:
    """The human-readable table."""
    m = plan.stage
    gib = lambda b: f"{b / GiB:8.2f}"  # noqa: E731
    lines = [
        f"model {plan.model}: {plan.policy_params / 1e9:.2f} B params ({source})",
        *model_notes(plan.shape),
        f"layout {plan.layout.label()}; worst pipeline stage {m.stage}; GiB per GPU:",
        f"  {'component':32s}{'train':>8s}{'rollout':>9s}",
    ]
    for name in dict.fromkeys([*m.train, *m.rollout]):
        train, rollout = m.train.get(name), m.rollout.get(name)
        lines.append(
            f"  {name:32s}{gib(train) if train is not None else '       -'} "
            f"{gib(rollout) if rollout is not None else '       -'}"
        )
    lines.append(f"  {'total':32s}{gib(sum(m.train.values()))} {gib(sum(m.rollout.values()))}")
    lines.append(f"resident across phases: {', '.join(m.resident) or 'nothing'}")
    if plan.fused_loss_logits is not None:
        before, after = plan.fused_loss_logits
        lines.append(
            f"fused output layer: loss logits {before / GiB:.2f} GiB -> {after / GiB:.2f} GiB on the last "
            "stage (performance.fused_output; off: materialised [T, V/TP] logits)"
        )
    if m.replay is not None:
        r = m.replay
        lines.append(
            f"routing replay: {r['bytes'] / 2**20:.2f} MiB of expert ids per GPU = "
            f"{r['router_tokens']} router tokens x {r['moe_layers']} MoE layers x top-{r['top_k']} x "
            f"{r['id_bytes']} B (int64) x {r['in_flight']} micro-batches in flight, freed by each "
            "micro-batch's backward"
        )
    if plan.settings.engine == "colocated":
        lines.append(f"engine KV cache: {m.kv_tokens} tokens per engine GPU")
    if plan.engine_gpu:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.engine_gpu.items())
        lines.append(f"separate engine, GiB per GPU: {parts}; KV cache {plan.engine_kv_tokens} tokens")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"peak {plan.peak_bytes / GiB:.2f} GiB ({m.peak_phase}) of {plan.gpu_bytes / GiB:.2f} GiB: {verdict}"
    )
    for p in plan.problems:
        lines.append(f"  - {p}")
    if plan.overflow:
        lines.append(f"  overflows at: {plan.overflow}")
    lines.append("layouts that fit (fewest PP stages, then least CP, TP, EP; TP stays within a node):")
    for p in ranked:
        lines.append(f"  {p.layout.label():32s} peak {p.peak_bytes / GiB:6.2f} GiB ({p.stage.peak_phase})")
    if not ranked:
        lines.append("  none: add nodes, recompute, offload or a smaller token budget")
    return "\n".join(lines)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="training recipe YAML (examples/*.yaml)")
    parser.add_argument("--cluster", required=True, help="cluster definition YAML or a name in cluster/")
    parser.add_argument("--nodes", type=int, default=1, help="training nodes")
    parser.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="default: the cluster's gpu_memory_gib"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--override", "-o", action="append", default=[], metavar="KEY=VALUE", help="e.g. parallel.tp=8"
    )


def cluster_plan(args: argparse.Namespace) -> tuple[Plan, list[Plan], str]:
    """Plan ``args.recipe`` on ``args.nodes`` nodes of ``args.cluster`` (shared by plan and launch)."""
    cluster = load_cluster(args.cluster)
    gib = getattr(args, "gpu_memory_gib", None) or cluster.gpu_memory_gib
    if cluster.gpus_per_node < 1 or gib <= 0:
        raise ConfigError(
            f"cluster {cluster.name!r} has gpus_per_node={cluster.gpus_per_node}, gpu_memory_gib={gib}: "
            "the planner needs GPU nodes; set both in the cluster file (or pass --gpu-memory-gib)"
        )
    # launch's rule (ClusterConfig.check_request): at least one node, within the partition's max_nodes,
    # engine nodes of a separate placement on Slurm included, so plan never "fits" what launch refuses
    cfg = load_recipe(args.recipe, list(args.override))
    engine_nodes = 0 if cluster.executor == "local" else cfg.rollout.engine_nodes
    cluster.check_request(args.nodes, engine_nodes=engine_nodes)
    gpus = args.nodes * cluster.gpus_per_node
    return plan_recipe(args.recipe, args.override, gpus, cluster.gpus_per_node, int(gib * GiB))


def plan_main(args: argparse.Namespace) -> int:
    """`srpo plan`: 0 when the recipe fits, 3 when it does not."""
    try:
        plan, ranked, source = cluster_plan(args)
    except (ConfigError, PlanError) as e:
        print(f"srpo plan: error: {e}", file=sys.stderr)
        return 2
    lora = lora_figures(load_recipe(args.recipe, list(args.override)), plan)
    if args.json:
        out = plan.to_json()
        if lora is not None:
            out["lora"] = lora
        out["config_source"] = source
        out["active_params"] = active_params(plan.shape)
        out["router_buffer_elements"] = router_buffer_elements(plan.shape)
        out["mtp_params_excluded"] = mtp_params(plan.shape)
        out["fitting_layouts"] = [{"layout": p.layout.label(), "peak_bytes": p.peak_bytes} for p in ranked]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, ranked, source))
        if lora is not None:
            print(format_lora(lora))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def refuse_unless_fits(args: argparse.Namespace, cluster: Any) -> None:
    """`srpo launch`'s hook: print the plan and raise ConfigError when it does not fit (unless --force).

    Clusters without GPUs or without ``gpu_memory_gib`` (CPU runs) and ``--probe`` jobs are not planned.
    """
    if getattr(args, "probe", False) or cluster.gpus_per_node < 1 or cluster.gpu_memory_gib <= 0:
        return
    plan, ranked, source = cluster_plan(args)
    if plan.fits:
        print(
            f"srpo plan: fits, peak {plan.peak_bytes / GiB:.2f} of {plan.gpu_bytes / GiB:.2f} GiB per GPU",
            file=sys.stderr,
        )
        return
    print(format_plan(plan, ranked, source), file=sys.stderr)
    if getattr(args, "force", False):
        print("srpo launch: --force: launching although the planner says it does not fit", file=sys.stderr)
        return
    raise ConfigError(
        f"the planner says {args.recipe} does not fit on {args.nodes} node(s) of {cluster.name!r} "
        f"(overflows at: {plan.overflow or plan.problems[0]}); change the layout (see the table above) "
        "or pass --force to launch anyway"
    )
