"""Issue 30's probe, replayed on a real tiny run: converters that cannot delete their input, exports and
``srpo eval`` that read only what ``srpo train`` would resume, and a ``run.restart`` that acts once.

One tiny run (2 steps, ``tests/integration/test_resume_safety.py``'s recipe) is trained once for the module;
the converter scripts run in-process through their ``main`` (the same argv the probe typed; the refusals
come before any tensor is read), ``srpo eval`` and ``srpo train`` through the real CLI in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron import cli
from tests.helpers.recipe import RECIPE, REPO, tiny_overrides

ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _srpo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "srpo_megatron.cli", *argv],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=900,
    )


def _overrides(tiny, run: Path, *extra: str) -> list[str]:
    return [a for o in tiny_overrides(tiny, run, ["run.tensorboard=false", *extra]) for a in ("-o", o)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=8)


ASIDE = "checkpoints.replaced-"
OLD_ASIDES = ("20200101-000000", "20200102-000000")  # moved aside by two earlier restarts


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> Path:
    """A finished 2-step run: checkpoints/step_000001, step_000002 (latest), metrics.jsonl, config.yaml.

    Trained with ``run.restart=true`` over an earlier run's checkpoint that verifies (step_000005, its
    manifest written by the trainer's own functions) and two older moved-aside folders: the first start
    with the flag moves it aside; ``test_restart_true_acts_once...`` then starts with the flag again."""
    from srpo_megatron.conversion.checkpoint_files import digest_files, list_files, write_manifest

    run = tmp_path_factory.mktemp("probe") / "R"
    earlier = run / "checkpoints" / "step_000005"
    earlier.mkdir(parents=True)
    (earlier / "__0_0.distcp").write_bytes(os.urandom(4096))
    (earlier / "trainer_state.json").write_text('{"step": 5}')
    write_manifest(earlier, digest_files(earlier, list_files(earlier)))
    (run / "checkpoints" / "latest").write_text("step_000005\n")
    for stamp in OLD_ASIDES:
        (run / f"{ASIDE}{stamp}").mkdir()
    done = _srpo("train", str(RECIPE), *_overrides(tiny, run, "train.steps=2", "run.restart=true"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run.restart=true: moved the existing checkpoints" in done.stdout, done.stdout
    return run


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _refused(capsys, tool: str, *argv: str) -> str:
    """Run a converter that must refuse: exit status 2 and one line (the last of stderr) naming why."""
    capsys.readouterr()
    rc = _tool(tool)(list(argv))
    err = capsys.readouterr().err
    mine = [line for line in err.splitlines() if line.startswith(f"{tool}.py: error: ")]
    assert rc == 2 and len(mine) == 1 and "Traceback" not in err, err
    return mine[0]


def _link_checkpoints(src: str, dst: str) -> None:
    """copytree's copy: checkpoint files hard-linked (a run never writes into a saved one), the rest
    copied (metrics.jsonl is appended to, config.yaml rewritten in place)."""
    if f"{os.sep}checkpoints{os.sep}" in src:
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def _tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def test_out_dir_equal_to_or_around_the_input_is_refused_with_force(run, tiny, tmp_path, capsys):
    # Probed on hard-linked copies: before the fix these commands deleted what they were given.
    _, hf, _ = tiny
    r = tmp_path / "R"
    shutil.copytree(run, r, copy_function=_link_checkpoints)
    model = tmp_path / "models" / "qwen3"
    shutil.copytree(hf, model, copy_function=os.link)
    step = r / "checkpoints" / "step_000002"
    before, weights = _tree(r), _tree(model.parent)
    # The probe: `--out-dir R --force` left R with config.json and model.safetensors only, and said `done`.
    for out in (r, r / "checkpoints"):  # the run, the input's parent
        line = _refused(
            capsys, "convert_megatron_to_hf", "--megatron-dir", str(step), "--out-dir", str(out), "--force"
        )
        assert f"--out-dir {out} contains the input {step}" in line
    for out in (model, model.parent):  # the HF model itself, its parent (and so its siblings)
        line = _refused(
            capsys, "convert_hf_to_megatron", "--hf-dir", str(model), "--out-dir", str(out), "--force"
        )
        assert f"the input {model}" in line
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    line = _refused(
        capsys, "convert_megatron_to_hf", "--megatron-dir", str(r), "--out-dir", str(other), "--force"
    )
    assert "is a run directory" in line
    assert _tree(r) == before and _tree(model.parent) == weights and (other / "metrics.jsonl").is_file()


def test_force_replaces_only_a_previous_conversion_and_prints_what(run, tmp_path, capsys):
    out = tmp_path / "hf_export"
    export = _tool("convert_megatron_to_hf")
    assert export(["--megatron-dir", str(run), "--out-dir", str(out)]) == 0  # a run: its newest checkpoint
    conversion = json.loads((out / "srpo_conversion.json").read_text())
    assert conversion["source"].endswith("step_000002")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(conversion["files"])  # the run's tokenizer
    capsys.readouterr()
    assert export(["--megatron-dir", str(run), "--out-dir", str(out), "--force"]) == 0
    err = capsys.readouterr().err
    assert f"--force: removing the previous conversion in {out}: " in err and "model.safetensors" in err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a conversion")
    line = _refused(
        capsys, "convert_megatron_to_hf", "--megatron-dir", str(run), "--out-dir", str(mine), "--force"
    )
    assert "holds no srpo_conversion.json" in line
    assert (mine / "notes.txt").read_text() == "not a conversion"


def test_corrupted_or_truncated_shards_are_refused_in_one_line(run, tmp_path, capsys):
    step = run / "checkpoints" / "step_000002"
    shard = step / "__0_0.distcp"
    data = shard.read_bytes()
    try:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF  # what `srpo train` refuses; export wrote an embedding of 3.4e38
        shard.write_bytes(bytes(flipped))
        line = _refused(
            capsys, "convert_megatron_to_hf", "--megatron-dir", str(step), "--out-dir", str(tmp_path / "a")
        )
        assert f"{shard} does not match its SHA-256 in manifest.json" in line
    finally:
        shard.write_bytes(data)
    # A copy without the trainer's manifest (an older converter's output) whose shards were truncated:
    # a bare EOFError before.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in step.iterdir():
        if f.is_file() and f.name not in ("manifest.json", "trainer_state.json"):
            (bare / f.name).write_bytes(f.read_bytes()[:2000] if f.suffix == ".distcp" else f.read_bytes())
    line = _refused(
        capsys, "convert_megatron_to_hf", "--megatron-dir", str(bare), "--out-dir", str(tmp_path / "b")
    )
    assert f"{bare}: reading" in line and "truncated or corrupted" in line
    broken = tmp_path / "broken_hf"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3",')
    line = _refused(
        capsys, "convert_hf_to_megatron", "--hf-dir", str(broken), "--out-dir", str(tmp_path / "c")
    )
    assert f"{broken / 'config.json'} is not valid JSON" in line
    line = _refused(capsys, "convert_hf_to_megatron", "--hf-dir", str(tmp_path / "nope"), "--out-dir", "x")
    assert "is not a folder" in line


def test_eval_falls_back_on_a_garbage_latest_like_train(run, tiny, tmp_path):
    _, _, data = tiny
    copy = tmp_path / "R"
    (copy / "checkpoints").mkdir(parents=True)
    for name in ("step_000001", "step_000002"):  # hard links: the test must not write into the shards
        shutil.copytree(run / "checkpoints" / name, copy / "checkpoints" / name, copy_function=os.link)
    (copy / "checkpoints" / "latest").write_bytes(b"\xff\xfe../../etc\x00")  # garbage, escaping
    extra = [f"data.eval_files=[{data}]", "eval.k=1", "eval.max_new_tokens=2", "eval.reward_workers=0"]
    extra += ["eval.max_prompts_per_benchmark=2", "train.eval_greedy=false"]
    done = _srpo(
        "eval",
        str(RECIPE),
        "--checkpoint",
        str(copy),
        "--out",
        str(tmp_path / "ev"),
        *_overrides(tiny, copy, *extra),
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        f"reading {copy / 'checkpoints' / 'step_000002'}, the newest checkpoint that verifies" in done.stderr
    )
    assert json.loads(done.stdout.strip().splitlines()[-1])["checkpoint"].endswith("step_000002")


def test_eval_checks_rewards_and_data_before_the_model(run, tiny, tmp_path, capsys):
    _, _, data = tiny
    ckpt = ["--checkpoint", str(run)]
    typo = "rollout.reward_fns={coin: srpo_megatron.testing.tiny:coin_rewrad}"
    cases = [
        ([f"data.eval_files=[{data}]", typo, "eval.reward_workers=0"], "coin_rewrad"),  # never registered
        (["data.eval_files=[]"], "has no held-out prompts"),  # found after the export before
    ]
    for extra, words in cases:
        argv = ["eval", str(RECIPE), *ckpt, *(a for o in tiny_overrides(tiny, run, extra) for a in ("-o", o))]
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("srpo eval: error: ") and err.count("\n") == 1, err
        assert words in err


def test_restart_true_acts_once_and_keeps_keep_last_moved_aside(run, tiny, tmp_path):
    """The probe: `srpo launch -o run.restart=true` puts the flag on the srun line, so every requeue started
    over (metrics steps [1,2,3,1,2,3,4,...]) and the moved-aside copies were never pruned."""
    assert len(list(run.glob(f"{ASIDE}*/step_000005"))) == 1  # the earlier run was moved, not deleted
    asides = sorted(p.name for p in run.glob(f"{ASIDE}*"))
    assert len(asides) == 2 and f"{ASIDE}{OLD_ASIDES[0]}" not in asides, asides  # run.keep_last=2
    copy = tmp_path / "R"
    shutil.copytree(run, copy, copy_function=_link_checkpoints)
    requeue = _srpo("train", str(RECIPE), *_overrides(tiny, copy, "train.steps=3", "run.restart=true"))
    assert requeue.returncode == 0, requeue.stderr[-3000:]
    assert "run.restart=true already acted on this run.dir" in requeue.stdout
    assert f"resuming from {copy / 'checkpoints' / 'step_000002'}" in requeue.stdout
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps  # continued, not started over
    assert sorted(p.name for p in copy.glob(f"{ASIDE}*")) == asides
