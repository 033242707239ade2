"""Every override line a recipe's header documents parses with ``srpo``'s own argument parser and loads
through the real recipe loader to the config it promises.

A header line is documented when it names ``--override`` / ``-o``: a whole ``srpo ...`` command (lines
ending in ``\\`` continue on the next) or a fragment to add to the recipe's command (``Baselines ...: -o
...``). Each is parsed as ``srpo train RECIPE <fragment>`` (or as written, for whole commands), loaded with
``load_recipe``, and then:

- every ``KEY=VALUE`` it names holds in the loaded config, and nothing else differs from the recipe;
- a GRPO or SDPO baseline averages per sequence (``loss.aggregation: seq_mean_token_mean``, as the
  paper's baseline runs), and on ``qwen3_8b_srpo.yaml`` it is exactly ``qwen3_8b_grpo.yaml`` /
  ``qwen3_8b_sdpo.yaml`` (but for ``run.dir``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from srpo_megatron.cli import build_parser
from srpo_megatron.config import load_recipe, to_dict
from tests.helpers.flat_keys import flat

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASELINE_RECIPES = {"grpo": "qwen3_8b_grpo.yaml", "sdpo": "qwen3_8b_sdpo.yaml"}


def _header(path: Path) -> list[str]:
    """The recipe's leading comment lines, without ``#``, continuation lines joined."""
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        if not raw.startswith("#"):
            break
        text = raw[1:].strip()
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + text
        else:
            lines.append(text)
    return lines


def documented(path: Path) -> list[tuple[str, list[str]]]:
    """(the header line, the ``srpo`` argv it stands for) for every line naming an override."""
    out = []
    for line in _header(path):
        flag = re.search(r"(^|\s)(--override|-o)\s", line)
        if flag is None:
            continue
        command = re.search(r"(^|\s)srpo\s", line)
        if command is not None:
            argv = shlex.split(line[command.end() :])
        else:
            argv = ["train", str(path), *shlex.split(line[flag.start() :])]
        out.append((line, argv))
    return out


CASES = [(p, line, argv) for p in sorted(EXAMPLES.glob("*.yaml")) for line, argv in documented(p)]


def test_the_recipes_document_override_lines():
    documenting = {p.name for p, _, _ in CASES}
    assert {"qwen3_8b_srpo.yaml", "qwen3_8b_srpo_per_domain.yaml"} <= documenting
    assert len(CASES) >= 10


@pytest.mark.parametrize(
    ("path", "line", "argv"), CASES, ids=[f"{p.name}:{a[0]}:{i}" for i, (p, _, a) in enumerate(CASES)]
)
def test_a_documented_override_line_parses_and_gives_the_intended_config(path, line, argv):
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{path.name}: the documented line does not parse as an srpo command: {line}")
    recipe = Path(args.recipe)
    recipe = recipe if recipe.is_absolute() else EXAMPLES.parent / recipe
    assert recipe.resolve() == path.resolve(), f"{path.name} documents a command for another recipe: {line}"
    got = flat(to_dict(load_recipe(recipe, args.override)))
    plain = flat(to_dict(load_recipe(recipe)))
    named = dict(o.split("=", 1) for o in args.override)
    for key, value in named.items():
        assert got[key] == yaml.safe_load(value), f"{path.name}: {key} is {got[key]!r} after {line}"
    assert {k for k in got if got[k] != plain[k]} <= set(named), f"{path.name}: {line} changes more"
    mode = got["loss.mode"]
    if mode in BASELINE_RECIPES:
        assert got["loss.aggregation"] == "seq_mean_token_mean", (
            f"{path.name}: the {mode} baseline line lacks loss.aggregation=seq_mean_token_mean (the paper's "
            f"baselines average per sequence): {line}"
        )
        if path.name == "qwen3_8b_srpo.yaml":
            ref = flat(to_dict(load_recipe(EXAMPLES / BASELINE_RECIPES[mode])))
            assert {k for k in ref if ref[k] != got[k]} == {"run.dir"}, f"not {BASELINE_RECIPES[mode]}"
