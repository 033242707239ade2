"""Every test names the megatron-core it ran on.

CI runs the megatron tiers twice (megatron-core 0.16.1 from the venv, 0.19.2 put first on PYTHONPATH by
``tools/dev test``): each test id carries ``mcore-<version>`` (e.g. ``test_x[mcore-0.19.2]``) and the
run ends with one line ``megatron-core <version>: N passed, ...`` in the log. With an sglang wheel on the
path (the sglang tier) a second line ``sglang <version>: N passed, ...`` counts the ``sglang_real`` tests.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import mcore_next
from tests.helpers.healthy import assert_healthy_runs

# Shared helpers (the rollout-engine contract's test methods, the parity asserts) keep pytest's assertion
# introspection: only test modules and conftest files are rewritten by default.
pytest.register_assert_rewrite("tests.helpers")


def _installed_mcore() -> str:
    try:
        from srpo_megatron.compat.mcore import mcore_version_str

        return mcore_version_str()
    except ImportError:  # megatron-core missing: the tests that need it fail on their own
        return "none"


MCORE = _installed_mcore()


def _installed_sglang() -> str | None:
    """The sglang wheel on the path (tools/dev test's sglang tier), read from its metadata, or None."""
    from srpo_megatron.testing.sglang_import import load, sglang_version

    version = sglang_version()
    if version is not None:
        load()  # SGLang's modules (and the torchvision stub they need on CPU) before any test imports them
    return version


@pytest.fixture(scope="module", autouse=True)
def _free_module_tmp(request, tmp_path_factory):
    """Removes the folders a module's fixtures made with ``tmp_path_factory`` once the module is done, unless
    one of its tests failed (then they stay for a look). pytest itself frees only a passed test's
    ``tmp_path`` (pyproject's ``tmp_path_retention_policy``); module fixtures' checkpoints and HF folders
    would otherwise pile up until the session ends. No session-scoped fixture writes files, so nothing a
    later module needs is removed."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        made = sorted(set(base.iterdir()) - before)
        if not request.node.get_closest_marker("engine_faults"):
            for path in made:  # the module fixtures' runs are healthy ones (tests/helpers/healthy.py)
                assert_healthy_runs(path)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _healthy_runs(request):
    """After a passed test: every run it left under its ``tmp_path`` restarted no engine
    (``tests/helpers/healthy.py``), unless the test is marked ``engine_faults``."""
    failed = request.session.testsfailed
    # asked for here, before the test, so that the folder is torn down after this check
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is None or request.session.testsfailed != failed:
        return
    if not request.node.get_closest_marker("engine_faults"):
        assert_healthy_runs(tmp)


@pytest.fixture(autouse=True)
def mcore_version() -> str:
    """The installed megatron-core version; parametrized below so that it lands in every test id."""
    return MCORE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mcore_version" in metafunc.fixturenames:
        metafunc.parametrize("mcore_version", [MCORE], ids=[f"mcore-{MCORE}"])


def _tier_id(item: pytest.Item) -> tuple[str, str]:
    """(file relative to tests/, test id without the mcore-<version> parameter)."""
    rel = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    name = item.name.replace(f"[mcore-{MCORE}]", "").replace(f"[mcore-{MCORE}-", "[")
    return rel, f"{rel}::{name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``mcore_next`` what ``tests/helpers/mcore_next.py`` lists (the 0.19.2 tier runs that mark)."""
    files = {rel for rel, _ in map(_tier_id, items)}
    used: set[str] = set()
    for item in items:
        rel, test_id = _tier_id(item)
        base = test_id.split("[", 1)[0]
        hit = next((e for e in (rel, test_id, base) if e in mcore_next.FILES or e in mcore_next.TESTS), None)
        if hit is not None:
            item.add_marker(pytest.mark.mcore_next)
            used.add(hit)
    # Checked where the tier runs (-m mcore_next over whole folders): a test picked by id leaves the rest of
    # its file uncollected, and their entries would look stale.
    tier = "mcore_next" in (config.getoption("markexpr", "") or "")
    stale = [e for e in (*mcore_next.FILES, *mcore_next.TESTS) if e.split("::")[0] in files and e not in used]
    if tier and stale:
        raise pytest.UsageError(
            f"tests/helpers/mcore_next.py lists tests that no longer exist: {stale}; rename or remove them"
        )


def pytest_report_header() -> str:
    return f"megatron-core {MCORE}"


def pytest_terminal_summary(terminalreporter) -> None:
    counts = {k: len(terminalreporter.stats.get(k, [])) for k in ("passed", "failed", "error", "skipped")}
    counts = {k: v for k, v in counts.items() if v or k == "passed"}
    terminalreporter.write_line(f"megatron-core {MCORE}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    sglang = _installed_sglang()
    if sglang is not None:  # the sglang tier: how the tests marked sglang_real went on this wheel
        terminalreporter.write_line(f"sglang {sglang}: " + _marked_counts(terminalreporter, "sglang_real"))
    torchrun = _marked_counts(terminalreporter, "torchrun")
    if not torchrun.startswith("0 passed") or "," in torchrun:  # the tier run through srpo launch's torchrun
        terminalreporter.write_line(f"torchrun: {torchrun}")


def _marked_counts(terminalreporter, marker: str) -> str:
    """``N passed, M failed, ...`` over the tests carrying ``marker``."""
    marked = {
        k: sum(1 for r in terminalreporter.stats.get(k, []) if marker in getattr(r, "keywords", {}))
        for k in ("passed", "failed", "error", "skipped")
    }
    return ", ".join(f"{v} {k}" for k, v in marked.items() if v or k == "passed")
