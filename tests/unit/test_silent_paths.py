"""The hostile probe's weak points (main at 95ddb5c), replayed at unit cost: each now gives one accurate
line where the probe saw silence, a line that suggested a refused value, or two commands disagreeing.

- a data file rewritten in place with as many rows: the resumed cursor is refused (its SHA-256 is saved);
- the full-disk refusal suggests only a ``run.keep_last`` the run accepts;
- ``srpo plan --nodes 0`` / ``--nodes 100000`` on a 64-node partition: refused as ``srpo launch`` refuses;
- an empty recipe or cluster file, a cluster file that is a list: one line naming the file and what it holds;
- a ``latest`` that is a directory, or random bytes: one accurate line, the bytes never echoed.
"""

from __future__ import annotations

import os
import re
import sys
from collections import namedtuple

import pytest
import yaml

from srpo_megatron import cli
from srpo_megatron.config import DataConfig, RunConfig
from srpo_megatron.conversion.checkpoint_files import (
    CheckpointError,
    digest_files,
    find_resume_checkpoint,
    list_files,
    newest_complete,
    write_manifest,
)
from srpo_megatron.data.dataset import EpochSampler, train_files_sha256
from srpo_megatron.data.rows import DataError
from srpo_megatron.trainer.run import save_guard
from tests.helpers.recipe import RECIPE


def _rows(path, answers: list[str]) -> None:
    path.write_text(
        "".join(f'{{"prompt": "p", "system": null, "answer": "{a}", "kind": "coin"}}\n' for a in answers)
    )


def test_a_data_file_rewritten_in_place_with_as_many_rows_is_refused_on_resume(tmp_path):
    data = tmp_path / "train.jsonl"
    _rows(data, ["1", "2", "3"])
    cfg = DataConfig(train_files=[str(data)])
    saved = EpochSampler(3, seed=1, files=train_files_sha256(cfg))
    saved.next_indices(2)
    state = saved.state_dict()
    same = EpochSampler(3, seed=1, files=train_files_sha256(cfg))
    same.load_state_dict(state)  # unchanged file: resumes
    assert same.cursor == 2
    _rows(data, ["1", "2", "4"])  # same row count, other content
    changed = EpochSampler(3, seed=1, files=train_files_sha256(cfg))
    with pytest.raises(DataError) as e:
        changed.load_state_dict(state)
    line = str(e.value)
    assert line.startswith(f"{data}: the data file changed since the checkpoint") and "\n" not in line
    assert "restore the file the run trained on, or start a new run.dir" in line
    old = {k: v for k, v in state.items() if k != "files_sha256"}  # a checkpoint from before: resumes
    changed.load_state_dict(old)
    # the digest is streamed: a chunk smaller than the file gives the same digest
    assert train_files_sha256(cfg, chunk=7) == train_files_sha256(cfg)


Usage = namedtuple("Usage", "total used free")


def _checkpoint(root, step: int) -> None:
    ckpt = root / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "shard").write_bytes(b"x" * 1000)
    write_manifest(ckpt, digest_files(ckpt, list_files(ckpt)))


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_the_full_disk_refusal_suggests_only_a_keep_last_the_run_accepts(tmp_path, monkeypatch, keep_last):
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        _checkpoint(root, step)
    monkeypatch.setattr(save_guard.shutil, "disk_usage", lambda _: Usage(10**12, 0, 10))
    why, _ = save_guard.space_problem(root, 3, keep_last)
    for value in re.findall(r"run\.keep_last\D{0,4}(-?\d+)?", why):
        assert value, f"suggests run.keep_last without a value: {why}"
        assert int(value) < keep_last, why  # a lower retention: a higher one frees nothing
        RunConfig(keep_last=int(value))  # accepted
    assert ("run.keep_last=1" in why) == (keep_last > 1), why
    assert "step_000001 may be deleted" in why and "a resume needs only step_000002" in why, why


@pytest.fixture
def tiny_hf(tmp_path):
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    return write_tiny_qwen3(tmp_path / "qwen3")


def _line(capsys, argv: list[str], command: str) -> str:
    capsys.readouterr()
    with open(os.devnull) as devnull:
        stdin, sys.stdin = sys.stdin, devnull
        try:
            rc = cli.main(argv)
        finally:
            sys.stdin = stdin
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"srpo {command}: error: ") and err.count("\n") == 1, (rc, err)
    return err.strip()


def test_plan_refuses_the_node_counts_launch_refuses(tmp_path, tiny_hf, capsys):
    cluster = tmp_path / "c64.yaml"
    body = {"name": "c64", "executor": "slurm", "partition": "p", "account": "a", "container_image": "i"}
    body |= {"gpus_per_node": 8, "gpu_memory_gib": 80}
    cluster.write_text(yaml.safe_dump({**body, "max_nodes": 64}))
    common = [str(RECIPE), "--cluster", str(cluster), "-o", f"model.hf_dir={tiny_hf}"]
    home = ["--home", str(tmp_path / "h"), "--dryrun"]
    for nodes, words in (("0", "--nodes 0: a job needs at least one training node"), ("100000", "max_nodes")):
        planned = _line(capsys, ["plan", *common, "--nodes", nodes], "plan")
        launched = _line(capsys, ["launch", *common, "--nodes", nodes, *home], "launch")
        assert words in planned, planned
        assert planned.removeprefix("srpo plan: ") == launched.removeprefix("srpo launch: "), (
            planned,
            launched,
        )
    assert not (tmp_path / "h").exists() or not list((tmp_path / "h").rglob("experiments/*"))


def test_empty_or_list_recipe_and_cluster_files_are_one_accurate_line(tmp_path, capsys):
    empty, comment, listed = tmp_path / "empty.yaml", tmp_path / "comment.yaml", tmp_path / "list.yaml"
    empty.write_text("")
    comment.write_text("# nothing yet\n")
    listed.write_text("- name: a\n- name: b\n")
    for f in (empty, comment):
        line = _line(capsys, ["train", str(f)], "train")
        assert f"recipe {f} is empty" in line and "TrainConfig" not in line, line
        line = _line(capsys, ["plan", str(RECIPE), "--cluster", str(f)], "plan")
        assert f"cluster file {f} is empty" in line and "ClusterConfig" not in line, line
    line = _line(capsys, ["plan", str(RECIPE), "--cluster", str(listed)], "plan")
    assert f"cluster file {listed} holds a list at the top level, not a mapping" in line, line
    assert not line.startswith("srpo plan: error: recipe"), line  # it is a cluster file, not a recipe
    line = _line(capsys, ["train", str(listed)], "train")
    assert f"recipe {listed} holds a list at the top level" in line, line


def test_a_latest_that_is_a_directory_or_random_bytes_is_one_accurate_line(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    _checkpoint(root, 1)
    latest = root / "latest"
    noise = bytes(range(256)) + b"\x1b[31mstep_000001\x1b[0m\n"
    latest.write_bytes(noise)
    lines: list[str] = []
    assert newest_complete(root, lines.append)[0] == root / "step_000001"
    assert lines == [
        f"{latest} holds {len(noise)} bytes that are not a checkpoint name (step_N; not shown); resuming "
        f"from {root / 'step_000001'}, the newest checkpoint that verifies"
    ]
    latest.unlink()
    latest.mkdir()
    with pytest.raises(CheckpointError) as e:
        find_resume_checkpoint(run, log=lines.append)
    assert str(e.value) == (
        f"{latest} is a directory, not the file naming the newest checkpoint; each save replaces it with "
        f"that file, so the run would fail at its first save: move it out of {root}"
    )
    lines.clear()
    assert newest_complete(root, lines.append)[0] == root / "step_000001"  # readers only log it
    assert lines[0].startswith(f"{latest} is a directory, not the file naming the newest checkpoint")
    (root / "step_000001" / "shard").write_bytes(b"y")  # no complete checkpoint: the refusal names it
    with pytest.raises(CheckpointError, match="is a directory, not the file naming"):
        find_resume_checkpoint(run, log=lines.append)


@pytest.fixture
def tiny_moe(tmp_path):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path / "qwen3_moe")


@pytest.mark.parametrize(
    ("model", "extra", "words"),
    [
        ("tiny_hf", ["rollout.routing_replay=true"], "is a dense model (no experts)"),
        ("tiny_moe", ["parallel.ep=3"], "do not divide by parallel.ep=3"),
    ],
)
def test_launch_runs_the_hf_config_start_up_checks_before_submitting(
    tmp_path, request, capsys, model, extra, words
):
    """Probe: a recipe refused by the start-up checks on 4 local tasks was submitted and ended FAILED, its
    refusal only in rank 0's stderr.log; now `srpo launch` refuses it first (replay needs an MoE model)."""
    cluster = tmp_path / "local4.yaml"
    cluster.write_text(yaml.safe_dump({"name": "l4", "executor": "local", "tasks_per_node": 4}))
    overrides = [f"model.hf_dir={request.getfixturevalue(model)}", *extra]
    argv = ["launch", str(RECIPE), "--cluster", str(cluster), "--home", str(tmp_path / "h"), "--dryrun"]
    line = _line(capsys, [*argv, *(a for o in overrides for a in ("-o", o))], "launch")
    assert words in line, line
    assert not (tmp_path / "h").exists() or not list((tmp_path / "h").rglob("experiments/*"))


def test_a_failed_job_names_its_first_failing_rank_error_line_and_log(tmp_path):
    """A fake nemo-run local job dir: 4 ranks' output interleaved, torchrun's traceback last; the line
    names torchrun's root-cause rank (2), its last error line and its own stderr.log."""
    from srpo_megatron.launch.jobs import first_failing_rank

    job = tmp_path / "job"
    logs = job / "nemo_run" / "app-1" / "torchelastic" / "app" / "id_x" / "attempt_0"
    for rank in range(4):
        (logs / str(rank)).mkdir(parents=True)
        (logs / str(rank) / "stderr.log").write_text("")
    refusal = "srpo train: error: rollout.routing_replay=true with performance.recompute=full would ..."
    lines = [f"[default{r}]:step 0 starting" for r in range(4)]
    lines += ["[default0]:RuntimeError: connection reset by peer", f"[default2]:{refusal}"]
    lines += [f"[default{r}]:Traceback (most recent call last):" for r in (1, 3)]
    lines += [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "Root Cause (first observed",
    ]
    lines[-1] += " failure):\n[2]:\n  time      : x\n  host      : localhost\n  rank      : 2 (local_rank: 2)"
    lines += ["  exitcode  : 2 (pid: 1)", "  error_file: <N/A>"]
    said = first_failing_rank("\n".join(lines), str(job))
    assert said == f"first failing rank 2: {refusal} (log: {logs / '2' / 'stderr.log'})"
    assert first_failing_rank("no torchrun summary here", str(job)) is None
