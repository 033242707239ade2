"""The `srpo` command line: its surface is frozen here, and bad input ends in one clear message."""

import pytest

from srpo_megatron.cli import build_parser, main


def test_subcommands_are_exactly_these():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["doctor", "eval", "jobs", "launch", "plan", "plot", "train"]
    args = parser.parse_args(["train", "r.yaml", "-o", "train.steps=3", "--override", "loss.mode=grpo"])
    assert args.override == ["train.steps=3", "loss.mode=grpo"]


def test_missing_recipe_is_one_clear_error(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "srpo train: error:" in err and "nope.yaml does not exist" in err


def test_unknown_recipe_key_is_reported_with_valid_keys(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\nrollout: {group_sise: 4}\n")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "group_sise" in err and "group_size" in err


def test_bad_override_syntax(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\n")
    assert main(["train", str(recipe), "-o", "train.steps"]) == 2
    assert "must look like section.key=value" in capsys.readouterr().err


def test_plan_and_launch_flags():
    parser = build_parser()
    args = parser.parse_args(
        ["plan", "r.yaml", "--cluster", "h100", "--nodes", "2", "--json", "-o", "parallel.tp=8"]
    )
    assert (args.recipe, args.cluster, args.nodes, args.json, args.override) == (
        "r.yaml",
        "h100",
        2,
        True,
        ["parallel.tp=8"],
    )
    assert args.gpu_memory_gib is None
    assert parser.parse_args(["launch", "r.yaml", "--cluster", "h100", "--force"]).force is True
    assert parser.parse_args(["launch", "r.yaml", "--cluster", "h100"]).force is False


@pytest.mark.parametrize("cmd", [["plot"], ["eval", "r.yaml"], ["plan", "r.yaml"]])
def test_required_arguments(cmd):
    with pytest.raises(SystemExit):
        build_parser().parse_args(cmd)
