"""Separate placement in the sbatch script: SGLang servers on the job's last ``rollout.engine_nodes`` nodes.

The job asks for ``nodes + engine_nodes`` nodes. :func:`slurm_engine_lines` goes into nemo-run's
``setup_lines`` (after the doctor's, if any) and wraps the one ``srun <flags> torchrun ...`` line nemo-run
writes:

1. the engine host names are the last ``engine_nodes`` entries of ``scontrol show hostnames``;
   ``SRPO_ENGINE_URLS`` (read by `srpo train`) lists one URL per server, numbered as
   ``rollout.sglang.servers.server_urls`` numbers them; an engine over several nodes (``tp_size`` >
   GPUs per node) takes ``span = tp_size / gpus_per_node`` consecutive engine nodes and only its first
   node serves HTTP, so the list has one URL per engine (every ``span``-th engine host);
   ``SRPO_ENGINE_HOSTS`` (all engine hosts) tells each node of such an engine its node rank and the
   engine's first host (SGLang's ``--dist-init-addr``);
2. a background step ``srun <the same flags> --nodes=E --relative=N --ntasks-per-node=1 python -m
   srpo_megatron.rollout.sglang.servers RECIPE ...`` starts (and keeps alive) the servers of each engine
   node, inside the job's container, logging next to the training log;
3. the training step runs on the first N nodes only (``--nodes=N --relative=0``, torchrun ``--nnodes N``).

The job ends when training ends; Slurm then stops the engine step with it.
"""

from __future__ import annotations

import shlex

from srpo_megatron.rollout.sglang.servers import BASE_PORT


def engine_server_args(recipe: str, overrides: list[str]) -> list[str]:
    """The engine step's command (after ``srun <flags>``)."""
    args = ["python", "-m", "srpo_megatron.rollout.sglang.servers", recipe]
    for item in overrides:
        args += ["--override", item]
    return args


def slurm_engine_lines(
    train_nodes: int, engine_nodes: int, per_node: int, recipe: str, overrides: list[str], span: int = 1
) -> str:
    """Bash for ``setup_lines``: start the engine step and confine the training step to its nodes.
    ``per_node``: servers per engine node; ``span``: nodes per engine (> 1 only with ``per_node`` 1)."""
    cmd = " ".join(shlex.quote(a) for a in engine_server_args(recipe, overrides))
    n, e, span = int(train_nodes), int(engine_nodes), int(span)
    if span > 1 and (per_node != 1 or e % span):
        raise ValueError(f"an engine over {span} nodes: one server per node, a multiple of {span} nodes")
    where = f"{per_node} per node" if span == 1 else f"one engine per {span} nodes, HTTP on its first"
    return f"""
# rollout.placement: separate -- SGLang servers on the last {e} node(s), {where} (ports from
# {BASE_PORT}); training on the first {n}. `srpo train` reads the servers from SRPO_ENGINE_URLS.
srpo_hosts=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )
SRPO_ENGINE_HOSTS=""
for h in "${{srpo_hosts[@]:{n}:{e}}}"; do SRPO_ENGINE_HOSTS+="${{SRPO_ENGINE_HOSTS:+,}}$h"; done
SRPO_ENGINE_URLS=""
for ((j = {n}; j < {n + e}; j += {span})); do
    for ((i = 0; i < {per_node}; i++)); do
        SRPO_ENGINE_URLS+="${{SRPO_ENGINE_URLS:+,}}http://${{srpo_hosts[j]}}:$(({BASE_PORT} + i))"
    done
done
export SRPO_ENGINE_HOSTS SRPO_ENGINE_URLS
echo "SGLang engine servers: $SRPO_ENGINE_URLS"
if declare -F srun >/dev/null; then
    eval "srpo_inner_srun() $(declare -f srun | tail -n +2)"
else
    srpo_inner_srun() {{ command srun "$@"; }}
fi
srun() {{
    local n=0 a flags=() out=engines_%j_%n.out  # out: next to the training log
    for a in "$@"; do [ "$a" = torchrun ] && break; n=$((n + 1)); done
    if [ "$n" -ge "$#" ]; then srpo_inner_srun "$@"; return; fi
    flags=( "${{@:1:n}}" )
    for ((a = 0; a < n; a++)); do [ "${{flags[a]}}" = --output ] && out="${{flags[a+1]%/*}}/$out"; done
    command srun "${{flags[@]}}" --output "$out" --nodes={e} --relative={n} \\
        --ntasks-per-node=1 {cmd} &
    local rest=( "${{@:n+1}}" )
    for ((a = 0; a < ${{#rest[@]}}; a++)); do [ "${{rest[a]}}" = --nnodes ] && rest[a+1]={n}; done
    srpo_inner_srun "${{flags[@]}}" --nodes={n} --relative=0 "${{rest[@]}}"
}}
"""
