"""The last silent paths of the hostile probe (main at 95ddb5c), replayed through the real CLI: each now
ends in one line on stderr naming the file, key or value and the fix, exit status 2, where the probe saw
rc 0 with a wrong number, a traceback, or a check that passed what another command refuses.

In-process (``cli.main``) where the error comes before torch.distributed starts (eval runs on the CPU
engine); ``srpo train`` runs that train in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron import cli
from srpo_megatron.conversion.output_guard import write_conversion_manifest
from tests.helpers.recipe import RECIPE, REPO, tiny_overrides

EVAL = ["eval.k=1", "eval.max_new_tokens=2", "eval.reward_workers=0", "eval.max_prompts_per_benchmark=2"]
EVAL += ["train.eval_greedy=false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=4)


@pytest.fixture
def mods(tmp_path, monkeypatch) -> Path:
    """A reward module on the path: ``boom`` raises on every sample."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "probe_silent_rewards.py").write_text(
        "def boom(response, answer):\n    raise ValueError('gold answer unparsable')\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    return mods


def _srpo(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, command: str) -> str:
    """The error line: stderr's last, and its only one (transformers' loading bar may come before it)."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == lines[-1:] and lines[-1].startswith(f"srpo {command}: error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


def _eval(capsys, tiny, tmp_path: Path, checkpoint: Path, *extra: str) -> tuple[int, str, str]:
    _, _, data = tiny
    overrides = tiny_overrides(tiny, tmp_path / "run", [f"data.eval_files=[{data}]", *EVAL, *extra])
    argv = ["eval", str(RECIPE), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "ev")]
    return _srpo(capsys, *argv, *(a for o in overrides for a in ("-o", o)))


def test_eval_with_a_reward_failing_on_every_sample_is_refused_like_training(tiny, tmp_path, mods, capsys):
    """Probe: `srpo eval` with a reward raising on every sample printed `avg@1: 0.0` and exited 0."""
    _, hf, _ = tiny
    boom = "rollout.reward_fns={coin: probe_silent_rewards:boom}"
    rc, out, err = _eval(capsys, tiny, tmp_path, hf, boom)
    line = _one_line(err, "eval")
    assert rc == 2 and out == "", (rc, out)
    assert "every reward of the evaluation" in line and "(2 of 2;" in line, line
    assert "probe_silent_rewards:boom" in line and "gold answer unparsable" in line, line
    assert "rollout.allow_reward_errors: true" in line, line
    assert (tmp_path / "ev" / "avg_at_k" / "samples.jsonl").is_file()  # the evidence is kept
    assert not (tmp_path / "ev" / "avg_at_k" / "summary.json").exists()  # no 0.0 that looks measured
    # the recipe allows reward errors: the number is reported, with training's warning line
    rc, out, err = _eval(capsys, tiny, tmp_path, hf, boom, "rollout.allow_reward_errors=true")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["avg@1"] == 0.0, err
    assert "[srpo] warning: 2 of 2 rewards of the evaluation" in out + err


def _converted_copy(hf: Path, where: Path) -> tuple[Path, Path, int]:
    """A converter output (its ``srpo_conversion.json`` written by the converter's own function) whose
    shard a copy then truncated: (folder, shard, size the manifest records)."""
    out = shutil.copytree(hf, where)
    write_conversion_manifest(out, {"direction": "megatron_to_hf", "source": str(hf)})
    shard = out / "model.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])
    return out, shard, size


def test_every_reader_of_a_truncated_converter_output_names_the_file(tiny, tmp_path, capsys):
    """Probe: `srpo eval` of a converter output with a truncated shard gave a safetensors traceback."""
    _, hf, _ = tiny
    out, shard, size = _converted_copy(hf, tmp_path / "converted")
    words = f"{shard} has {size // 3} bytes, {out / 'srpo_conversion.json'} says {size} bytes"
    rc, _, err = _eval(capsys, tiny, tmp_path, out)
    assert rc == 2 and words in _one_line(err, "eval"), err
    assert "copy the folder again or convert again" in err
    # the policy's folder itself (tokenizer, config, engine, trainer's initial weights, planner)
    base = tiny_overrides(tiny, tmp_path / "run2", [f"model.hf_dir={out}"])
    rc, _, err = _srpo(capsys, "train", str(RECIPE), *(a for o in base for a in ("-o", o)))
    assert rc == 2 and words in _one_line(err, "train"), err
    cluster = tmp_path / "gpu.yaml"
    cluster.write_text("name: g\nexecutor: local\ngpus_per_node: 8\ngpu_memory_gib: 80\n")
    rc, _, err = _srpo(capsys, "plan", str(RECIPE), "--cluster", str(cluster), "-o", f"model.hf_dir={out}")
    assert rc == 2 and words in _one_line(err, "plan"), err


def test_each_hf_folder_reader_checks_the_size_manifest_first(tiny, tmp_path):
    from srpo_megatron.config import RolloutConfig
    from srpo_megatron.conversion.output_guard import ConversionInputError
    from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
    from srpo_megatron.rollout.factory import build_engine, load_tokenizer
    from srpo_megatron.trainer.run.preflight import read_model_config

    _, hf, _ = tiny
    out, _, _ = _converted_copy(hf, tmp_path / "converted")
    for read in (
        HFCheckpointReader,
        load_tokenizer,
        read_model_config,
        lambda d: build_engine(RolloutConfig(), d),
    ):
        with pytest.raises(ConversionInputError, match="truncated or changed"):
            read(str(out))


def _train(*argv: str) -> subprocess.CompletedProcess:
    """``srpo train`` in a subprocess (torch.distributed starts in it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)


def test_a_data_file_rewritten_in_place_is_refused_on_resume(tiny, tmp_path):
    """Probe: the train file rewritten with as many rows (other prompts) resumed silently, the cursor
    indexing rows the run never saw; the file's SHA-256 is now saved with the cursor."""
    _, _, data = tiny
    copy = tmp_path / "train.jsonl"
    shutil.copy(data, copy)
    base = tiny_overrides(tiny, tmp_path / "run", [f"data.train_files=[{copy}]", "run.tensorboard=false"])
    argv = [a for o in base for a in ("-o", o)]
    done = _train(*argv, "-o", "train.steps=1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = copy.read_text().splitlines()
    copy.write_text("\n".join(r.replace("fact", "story") for r in rows) + "\n")  # same row count
    done = _train(*argv, "-o", "train.steps=2")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith(f"srpo train: error: {copy}: the data file changed since the checkpoint"), last
