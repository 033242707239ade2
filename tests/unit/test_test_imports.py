"""No test module imports another test module: what tests share lives in ``tests/helpers/`` (or
``srpo_megatron/testing/``), so a test file can be moved, renamed or deleted without breaking another.

Every ``import``/``from ... import`` in ``tests/**/*.py`` (function-level and relative ones included) may
name a ``tests.*`` module only if it is ``tests.helpers`` or below, or a ``conftest``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _package(path: Path, root: Path) -> list[str]:
    """The dotted package of ``path`` (a file under ``root``), e.g. ``["tests", "unit"]``."""
    return list(path.relative_to(root).parent.parts)


def _imported(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The modules an import statement may load: ``from a.b import c`` may load ``a.b`` and ``a.b.c``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module.split(".") if node.module else []
    if node.level:  # relative: ``from . import x`` / ``from ..unit.test_x import y``
        base = package[: len(package) - (node.level - 1)] + base
    module = ".".join(base)
    return [module] + [f"{module}.{alias.name}" for alias in node.names if alias.name != "*"]


def _allowed(module: str) -> bool:
    parts = module.split(".")
    if parts[0] != "tests" or len(parts) == 1:
        return True  # not a test-tree module, or the bare ``tests`` package
    return parts[1] == "helpers" or parts[-1] == "conftest"


def _is_test_tree_module(module: str, root: Path) -> bool:
    """``module`` is a module file under ``root`` (not a package's empty ``__init__``): ``from tests.x import
    name`` of a function or class ``name`` must not count ``tests.x.name`` as a module."""
    return root.joinpath(*module.split(".")).with_suffix(".py").is_file()


def offenders(root: Path) -> list[str]:
    """``path:line: module`` for every import of a non-helper test module in ``root/tests/**/*.py``."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        package = _package(path, root)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for module in _imported(node, package):
                if not _allowed(module) and _is_test_tree_module(module, root):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {module}")
    return found


def test_no_test_module_imports_another_test_module():
    bad = offenders(REPO)
    assert not bad, (
        "test modules import other test modules (move the shared helper into tests/helpers/, or into "
        "srpo_megatron/testing/ if tools use it too, and import it from there):\n" + "\n".join(bad)
    )


def _plant(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for parent in path.relative_to(root).parents:
        if parent != Path("."):
            (root / parent / "__init__.py").touch()


def test_planted_test_module_imports_are_reported(tmp_path):
    """A copy of the rule's shapes in a synthetic tree: module-level, function-level and relative imports of
    test modules are reported; helpers, conftest and non-module names are not."""
    _plant(tmp_path, "tests/conftest.py", "MCORE = 'x'\n")
    _plant(tmp_path, "tests/helpers/megatron.py", "def lm_loss(): ...\n")
    _plant(tmp_path, "tests/dist/test_models.py", "def tiny_hf_model(): ...\n")
    _plant(tmp_path, "tests/unit/test_other.py", "def helper(): ...\n")
    _plant(
        tmp_path,
        "tests/unit/test_planted.py",
        "from tests.dist.test_models import tiny_hf_model\n"  # line 1: offender
        "from tests.helpers.megatron import lm_loss\n"
        "from tests.conftest import MCORE\n"
        "from tests import helpers\n"
        "import os\n"
        "from .test_other import helper\n"  # line 6: offender (relative)
        "def test_x():\n"
        "    import tests.unit.test_other\n"  # line 8: offender (function-level)
        "    from tests.dist import test_models\n",  # line 9: offender (a module as a name)
    )
    assert offenders(tmp_path) == [
        "tests/unit/test_planted.py:1: tests.dist.test_models",
        "tests/unit/test_planted.py:6: tests.unit.test_other",
        "tests/unit/test_planted.py:8: tests.unit.test_other",
        "tests/unit/test_planted.py:9: tests.dist.test_models",
    ]


def test_helpers_are_not_collected_as_tests():
    """pytest collects ``test_*.py`` / ``*_test.py``: a helper module named so would run twice (or its
    contract class would be collected without the fixtures its subclasses provide)."""
    named_like_tests = [
        p.name
        for p in (REPO / "tests" / "helpers").rglob("*.py")
        if p.name.startswith("test_") or p.stem.endswith("_test")
    ]
    assert not named_like_tests, f"tests/helpers/ modules named like test modules: {named_like_tests}"


def test_helper_asserts_keep_pytest_introspection():
    """tests/conftest.py registers tests.helpers for assertion rewriting (pytest rewrites only test modules
    and conftest files): a failing contract or parity assert in a helper shows its operands."""
    from tests.helpers import conversion

    names = conversion.assert_bit_exact.__code__.co_varnames
    assert any(n.startswith("@py_assert") for n in names), (
        "tests.helpers is not assertion-rewritten: keep pytest.register_assert_rewrite('tests.helpers') in "
        "tests/conftest.py, before any test module imports a helper"
    )
