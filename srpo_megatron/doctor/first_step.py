"""`srpo doctor` as a launched job's first step, once per node, before torchrun starts.

nemo-run writes the job's one ``srun <flags> torchrun ...`` line itself, with the container image,
mounts, working directory and log file of the cluster. :func:`slurm_setup_lines` goes into the sbatch
script before that line (nemo-run's ``setup_lines``) and defines a shell function ``srun`` that, when
called with ``torchrun``, first runs ``srun <the same flags> --ntasks-per-node=1 python -m
srpo_megatron.cli doctor ...``. So the doctor sees exactly the training's environment (on a pyxis
cluster: inside the job's container, with its mounts) and writes into the same job log. A failing
doctor ends the batch script with its exit status: the job is FAILED within seconds, not requeued (a
requeue would land on the same broken node), and `srpo jobs logs` shows the doctor's FAIL line.
"""

from __future__ import annotations

import shlex


def doctor_args(recipe: str | None, overrides: list[str]) -> list[str]:
    """``python -m srpo_megatron.cli`` arguments of the per-node check of ``recipe`` (None: node only)."""
    args = ["doctor"] + ([recipe] if recipe else [])
    for item in overrides:
        args += ["--override", item]
    return args


def slurm_setup_lines(recipe: str | None, overrides: list[str]) -> str:
    """Bash for nemo-run's ``setup_lines``: run the doctor on every node before the torchrun step."""
    cmd = " ".join(
        shlex.quote(a) for a in ["python", "-m", "srpo_megatron.cli", *doctor_args(recipe, overrides)]
    )
    return f"""
# srpo doctor: the job's first step, on every node, with the training step's own srun flags
# (container, mounts, log file); a failed check ends the job here (srpo launch --skip-doctor skips it).
srun() {{
    local n=0 a
    for a in "$@"; do [ "$a" = torchrun ] && break; n=$((n + 1)); done
    if [ "$n" -lt "$#" ]; then
        command srun "${{@:1:n}}" --ntasks-per-node=1 {cmd}
        local rc=$?
        if [ "$rc" -ne 0 ]; then
            echo "srpo doctor failed (exit $rc) in job $SLURM_JOB_ID: training not started (FAIL lines above)"
            exit "$rc"
        fi
    fi
    command srun "$@"
}}
"""


def doctor_first(executor: str, recipe: str | None, overrides: list[str], dryrun: bool) -> tuple[bool, str]:
    """Make `srpo doctor` the first step of a launched job on every node: ``(ok, setup_lines)``.

    Slurm: ``setup_lines`` (above) go into the job's sbatch script; ``ok`` is True. Local executor: this
    machine is the node, so the doctor runs now (not for a dry run), ``ok`` says whether it passed and
    ``setup_lines`` is empty. ``recipe`` None (the probe job, which has no model): the node checks only.
    """
    overrides = overrides if recipe else []
    if executor == "slurm":
        return True, slurm_setup_lines(recipe, overrides)
    if dryrun:
        return True, ""
    from srpo_megatron.doctor.command import collect
    from srpo_megatron.doctor.report import exit_code, render_text

    checks, where = collect(recipe, overrides, None)
    print(render_text(checks, where), flush=True)
    return exit_code(checks) == 0, ""
