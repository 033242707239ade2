"""The import rules between srpo_megatron's rooms: one layer table (``LAYERS``), checked on every module.

A *room* is a top-level package or module of ``srpo_megatron/`` (``trainer/``, ``parallel.py``). The rooms
are stacked in layers, lowest first; a module may import its own room and any room of a LOWER layer,
never one beside it or above it. Every ``import`` and ``from ... import`` is read with ``ast``: at module
level, inside functions, under ``if TYPE_CHECKING:`` alike (a lazy import is still a dependency; it only
moves the failure to run time). On top of the layers:

- ``LEAVES`` import no other room at all (``config/`` is the torch-free recipe every tool loads);
- ``THIRD_PARTY`` limits what some rooms may import from outside the standard library (``config/``: only
  ``yaml``; ``ops/`` and ``losses/``: only ``torch``, since the math takes tensors and explicit groups, and
  ``ops/`` apex's torch-extension wgrad kernel where it imports);
- the room graph has no cycle;
- inside ``trainer/`` the rooms (``TRAINER_ROOMS``: ``observe/`` ... ``run/``) are stacked the same way, with
  ``trainer/step_types.py`` the leaf they all import, and no folder holds more than ``MAX_MODULES`` modules.

``PENDING`` lists the edges that break the rules on this branch and the renovation that removes each
(issue 25); it is meant to be emptied, and an entry that no longer occurs fails the test too.

Not seen: imports by string (``importlib.import_module``, the reward registry's ``"module:function"``
names); those name rewards and entry points, not layers.

``python -m tests.unit.test_import_rules`` prints the table (``srpo_megatron/ARCHITECTURE.md``, "Layers and
rooms").
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "srpo_megatron"


@dataclass(frozen=True)
class Layer:
    name: str
    files: tuple[str, ...]  # the rooms as they lie in srpo_megatron/: "trainer/" (package), "ports.py"
    owns: str  # one line: what the layer's rooms own

    @property
    def rooms(self) -> tuple[str, ...]:
        return tuple(f.removesuffix("/").removesuffix(".py") for f in self.files)


# Lowest first. A room may import its own room and the rooms of lower layers only.
LAYERS: tuple[Layer, ...] = (
    Layer(
        "leaf utilities",
        ("compat/", "ports.py", "durable_io.py", "buckets.py", "children.py"),
        "the CPU layer and megatron shims, free rendezvous ports, fsync and durable writes, weight buckets, "
        "children that die with their parent",
    ),
    Layer(
        "recipe",
        ("config/",),
        "the typed recipe: dataclasses, YAML loading, overrides, load-time refusals (torch-free)",
    ),
    Layer(
        "math and process groups",
        ("ops/", "parallel.py", "local_ranks.py"),
        "vocab-parallel log-prob/entropy/top-k (pure tensor math); megatron's TP/PP/DP/CP/EP groups; a "
        "function run on N local ranks (benchmarks, tests)",
    ),
    Layer("losses", ("losses/",), "GRPO and SDPO token losses, sample routing, the routed loss"),
    Layer("rewards", ("rewards/",), "reward functions and the reward worker pool"),
    Layer(
        "data and models",
        ("data/", "models/"),
        "prompt rows, templates, datasets; architectures, megatron policy specs, MoE, speed choices",
    ),
    Layer(
        "conversion",
        ("conversion/",),
        "the HF <-> megatron table per architecture, safetensors and torch_dist I/O, checkpoint manifests",
    ),
    Layer(
        "rollout",
        ("rollout/",),
        "rollout engines (transformers, SGLang) behind one interface, placement, routed experts",
    ),
    Layer("weights", ("weights/",), "trainer -> engine weight export and sync transports"),
    Layer("evaluation", ("evaluation/",), "avg@k through any engine, the budget report, plots, srpo eval"),
    Layer(
        "trainer",
        ("trainer/",),
        "the SRPO step's rooms: observe, microbatches, state, passes, collect, run (TRAINER_ROOMS below)",
    ),
    Layer(
        "tools on the recipe",
        ("planner/", "doctor/"),
        "the memory planner (srpo plan); environment and input checks (srpo doctor)",
    ),
    Layer("launch", ("launch/",), "nemo-run experiments on Slurm or this machine, job control (srpo launch)"),
    Layer("driver", ("train.py",), "the RL loop, SPEC section 1 (srpo train)"),
    Layer("command line", ("cli.py",), "the srpo command: parses arguments, imports each command lazily"),
    Layer(
        "test support",
        ("testing/",),
        "tiny models, the SGLang stand-in server, strict-device mode: imported by tests and tools only",
    ),
)

# Rooms (or single modules) that import no other room of the package.
LEAVES: dict[str, str] = {
    PACKAGE: "the package root only holds the version",
    "compat": "a leaf utility",
    "ports": "a leaf utility",
    "durable_io": "a leaf utility",
    "buckets": "a leaf utility",
    "children": "a leaf utility",
    "config": "the recipe loads without the rest of the package (and without torch)",
}

# Modules that import no other module of their own room (and, like every module, lower layers only).
INNER_LEAVES: dict[str, str] = {
    f"{PACKAGE}.trainer.step_types": "what flows through a step: every trainer phase imports it",
}

# Rooms (or modules) whose imports from outside the standard library are limited to these names.
THIRD_PARTY: dict[str, frozenset[str]] = {
    f"{PACKAGE}.trainer.step_types": frozenset({"torch"}),
    "config": frozenset({"yaml"}),
    # apex's wgrad kernel is a torch extension (tensors in, tensors out), imported only where it exists
    "ops": frozenset({"torch", "fused_weight_gradient_mlp_cuda"}),
    "losses": frozenset({"torch"}),
}

# Edges that break the rules today, keyed (importing module, imported module), with who removes them.
PENDING: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. srpo_megatron.conversion.checkpoint
    target: str  # imported module (or the package an imported name lives in)
    where: str  # file:line, relative to the tree's root


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """``srpo_megatron.trainer.run.checkpoint`` -> ``trainer``; the root package is its own room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def read_imports(root: Path) -> tuple[list[Edge], list[tuple[str, str, str]]]:
    """Every import of every module under ``root/srpo_megatron``: (edges inside the package, and
    (module, top-level external name, file:line) for the rest)."""
    edges, external = [], []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        module = module_name(root, path)
        is_package = path.name == "__init__.py"
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, up level - 1
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from srpo_megatron import trainer` names a room; deeper, the module decides the room
                names = [f"{target}.{a.name}" for a in node.names] if target == PACKAGE else [target]
            else:
                continue
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    edges.append(Edge(module, name, where))
                else:
                    external.append((module, name.split(".")[0], where))
    return edges, external


# ---------------------------------------------------------------------------------------------- checking


def layer_of() -> dict[str, int]:
    return {r: i for i, layer in enumerate(LAYERS) for r in layer.rooms} | {PACKAGE: 0}


def _leaf_rule(module: str) -> str | None:
    if module in LEAVES:
        return module
    return room(module) if room(module) in LEAVES else None


def _inner_leaf(module: str) -> str | None:
    """The INNER_LEAVES entry ``module`` is (or lies in), if any."""
    return next((m for m in INNER_LEAVES if module == m or module.startswith(m + ".")), None)


def violations(root: Path, pending: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Every import under ``root`` that breaks the rules, as ``a → b (file:line): why``."""
    pending = PENDING if pending is None else pending
    edges, external = read_imports(root)
    index = layer_of()
    out = []
    for e in edges:
        a, b = room(e.source), room(e.target)
        head = f"{e.source} → {e.target} ({e.where})"
        inner = _inner_leaf(e.source)
        if a == b and inner and _inner_leaf(e.target) != inner and (e.source, e.target) not in pending:
            out.append(f"{head}: {inner} imports no other module of {a} ({INNER_LEAVES[inner]})")
        if a == b or (e.source, e.target) in pending:
            continue
        leaf = _leaf_rule(e.source)
        if a not in index:
            out.append(f"{head}: room {a!r} is not in the layer table; add it to LAYERS (and the README)")
        elif b not in index:
            out.append(f"{head}: room {b!r} is not in the layer table; add it to LAYERS (and the README)")
        elif leaf is not None:
            out.append(f"{head}: {leaf} is a leaf ({LEAVES[leaf]}) and imports no other room")
        elif index[b] >= index[a]:
            la, lb = LAYERS[index[a]], LAYERS[index[b]]
            side = "beside it" if index[a] == index[b] else "above it"
            out.append(
                f"{head}: {a} (layer {index[a]}, {la.name}) may not import {b} (layer {index[b]}, "
                f"{lb.name}, {side}); imports go down the layers: move what {a} needs into {a} or below"
            )
    stdlib = sys.stdlib_module_names | {"_typeshed"}  # typeshed: the standard library's typing-only names
    for module, name, where in external:
        key = _inner_leaf(module) if _inner_leaf(module) in THIRD_PARTY else room(module)
        allowed = THIRD_PARTY.get(key)
        if allowed is not None and name not in stdlib and name not in allowed:
            out.append(
                f"{module} → {name} ({where}): {key} may import only the standard library and "
                f"{sorted(allowed)}"
            )
    return out


def room_graph(root: Path, pending: dict[tuple[str, str], str] | None = None) -> dict[str, set[str]]:
    pending = PENDING if pending is None else pending
    graph: dict[str, set[str]] = defaultdict(set)
    for e in read_imports(root)[0]:
        if room(e.source) != room(e.target) and (e.source, e.target) not in pending:
            graph[room(e.source)].add(room(e.target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each back edge of a depth-first search (empty: the graph is a DAG)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def markdown_table() -> str:
    lines = ["| layer | rooms | owns |", "|---|---|---|"]
    for i, layer in reversed(list(enumerate(LAYERS))):
        rooms = ", ".join(f"`{f}`" for f in layer.files)
        lines.append(f"| {i} {layer.name} | {rooms} | {layer.owns} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the tests


def test_every_import_goes_down_the_layers():
    found = violations(REPO)
    assert not found, "imports that break the layer rules:\n" + "\n".join(found)


def test_rooms_import_each_other_without_cycles():
    found = cycles(room_graph(REPO))
    assert not found, "import cycles between rooms:\n" + "\n".join(" → ".join(c) for c in found)


def test_every_pending_edge_still_occurs():
    seen = {(e.source, e.target) for e in read_imports(REPO)[0]}
    stale = [f"{a} → {b} ({why})" for (a, b), why in PENDING.items() if (a, b) not in seen]
    assert not stale, "PENDING edges that no longer occur; remove them from PENDING:\n" + "\n".join(stale)


def test_every_room_is_in_the_table():
    rooms = {p.stem for p in (REPO / PACKAGE).iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    rooms.discard("__init__")
    assert rooms <= set(layer_of()), f"rooms missing from LAYERS: {sorted(rooms - set(layer_of()))}"


def test_the_table_names_each_room_once_and_the_rules_name_known_rooms():
    rooms = [r for layer in LAYERS for r in layer.rooms]
    assert len(rooms) == len(set(rooms)), (
        f"rooms in two layers: {sorted({r for r in rooms if rooms.count(r) > 1})}"
    )
    named = {room(k) if k.startswith(PACKAGE + ".") else k for k in [*LEAVES, *INNER_LEAVES, *THIRD_PARTY]}
    assert named <= set(layer_of()), f"rules for rooms not in LAYERS: {sorted(named - set(layer_of()))}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name in ["__init__.py", "ops/__init__.py", "trainer/__init__.py", "rollout/__init__.py"]:
        files.setdefault(name, "")
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_planted_back_arrow_is_reported(tmp_path):
    root = _tree(tmp_path, {"ops/x.py": "from srpo_megatron.trainer import y\n"})
    [found] = violations(root, pending={})
    assert found.startswith("srpo_megatron.ops.x → srpo_megatron.trainer (srpo_megatron/ops/x.py:1): ")
    assert "ops (layer 2, math and process groups) may not import trainer (layer 10" in found


@pytest.mark.parametrize(
    "text",
    [
        "def f():\n    from srpo_megatron.trainer.run.checkpoint import save_checkpoint\n",  # lazy
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from srpo_megatron.trainer import y\n",
        "from ..trainer import y\n",  # relative
        "import srpo_megatron.trainer.state.policy as p\n",
        "from srpo_megatron import trainer\n",
    ],
    ids=["function-level", "type-checking", "relative", "import-as", "from-root"],
)
def test_back_arrows_are_reported_in_every_import_form(tmp_path, text):
    found = violations(_tree(tmp_path, {"ops/x.py": text}), pending={})
    assert len(found) == 1 and "ops (layer 2" in found[0] and "may not import trainer" in found[0], found


def test_a_sibling_import_a_leaf_import_and_a_third_party_import_are_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            "ops/x.py": "import srpo_megatron.parallel\nimport numpy\n",
            "parallel.py": "",
            "config/__init__.py": "import torch\nfrom srpo_megatron.compat import cpu\n",
            "compat/__init__.py": "",
        },
    )
    found = "\n".join(violations(root, pending={}))
    assert "may not import parallel (layer 2, math and process groups, beside it)" in found
    assert "srpo_megatron.ops → numpy" not in found and "srpo_megatron.ops.x → numpy" in found
    assert "config is a leaf" in found and "srpo_megatron.config → torch" in found


def test_step_types_imports_no_other_trainer_module(tmp_path):
    text = "from srpo_megatron.losses import TokenBatch\nfrom srpo_megatron.trainer import batches\n"
    text += "import numpy\n"
    root = _tree(tmp_path, {"trainer/step_types.py": text, "losses/__init__.py": ""})
    found = violations(root, pending={})
    assert len(found) == 2, found  # losses is below the trainer: allowed
    assert "step_types → srpo_megatron.trainer (srpo_megatron/trainer/step_types.py:2)" in found[0]
    assert "srpo_megatron.trainer.step_types imports no other module of trainer" in found[0]
    assert (
        "step_types → numpy" in found[1] and "may import only the standard library and ['torch']" in found[1]
    )


def test_a_pending_edge_is_allowed_and_an_unknown_room_is_reported(tmp_path):
    root = _tree(tmp_path, {"ops/x.py": "from srpo_megatron.trainer import y\n", "newroom.py": "import os\n"})
    pending = {("srpo_megatron.ops.x", "srpo_megatron.trainer"): "test"}
    assert violations(root, pending=pending) == []
    root = _tree(tmp_path, {"trainer/z.py": "import srpo_megatron.newroom\n"})
    [found] = [v for v in violations(root, pending=pending) if "newroom" in v]
    assert "room 'newroom' is not in the layer table" in found


def test_a_cycle_between_rooms_is_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            "rollout/a.py": "from srpo_megatron.trainer import b\n",
            "trainer/b.py": "import srpo_megatron.rollout.a\n",
        },
    )
    assert cycles(room_graph(root, pending={})) == [["rollout", "trainer", "rollout"]]


# ------------------------------------------------------------------------------ rooms inside trainer/
#
# trainer/ is split into rooms of its own, stacked like the package's layers: a trainer module may import
# its own room, the rooms below it and ``trainer/step_types.py`` (the leaf every room imports), never a
# room beside or above it. The package ``trainer/__init__.py`` imports nothing of the trainer, and a
# trainer room is imported by its full path (``srpo_megatron.trainer.passes.scoring``), never through
# ``from srpo_megatron.trainer import x``. No folder of srpo_megatron/ holds more than ``MAX_MODULES``.

TRAINER = f"{PACKAGE}.trainer"
TRAINER_LEAF = f"{TRAINER}.step_types"

# Lowest first, as LAYERS.
TRAINER_ROOMS: tuple[Layer, ...] = (
    Layer(
        "observe",
        ("observe/",),
        "per-step metrics and logs, the StepStats reduction, step metrics, the teacher watch, evaluation",
    ),
    Layer(
        "microbatches",
        ("microbatches/",),
        "packing, batch tensors, the CP split, output rows, MoE replay, EP lockstep, megatron schedules",
    ),
    Layer(
        "state",
        ("state/",),
        "the policy (model, DDP, optimizer), the self-teacher, its sharded copy, offload",
    ),
    Layer("passes", ("passes/",), "the no-grad scoring pass (with parity) and the training pass"),
    Layer(
        "collect",
        ("collect/",),
        "the rollout service, off-policy workers, the sample pool, rewarding and sample routing, shipping",
    ),
    Layer(
        "run", ("run/",), "the run dir and its lock, start-up checks, checkpoints, RNG state, saves, resume"
    ),
)

MAX_MODULES = 20  # .py files (``__init__.py`` included) directly in one folder of srpo_megatron/


def trainer_room(module: str) -> str | None:
    """``srpo_megatron.trainer.passes.scoring`` -> ``passes``; ``step_types`` for the leaf, ``""`` for the
    package itself, None outside the trainer."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "trainer"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def trainer_violations(edges: list[Edge]) -> list[str]:
    """Every import between trainer modules that breaks the rooms' order, as ``a → b (where): why``."""
    index = {r: i for i, layer in enumerate(TRAINER_ROOMS) for r in layer.rooms}
    out = []
    for e in edges:
        a, b = trainer_room(e.source), trainer_room(e.target)
        if a is None or b is None or a == "step_types":  # step_types: INNER_LEAVES says it imports none
            continue
        head = f"{e.source} → {e.target} ({e.where})"
        if b == "":
            out.append(
                f"{head}: import a trainer module by its full path (srpo_megatron.trainer.<room>.<module>)"
            )
        elif a == "":
            out.append(f"{head}: the trainer package's __init__ imports no trainer module")
        elif a == b or b == "step_types":
            continue
        elif a not in index or b not in index:
            missing = a if a not in index else b
            out.append(
                f"{head}: trainer room {missing!r} is not in TRAINER_ROOMS; add it (and its __init__ note)"
            )
        elif index[b] >= index[a]:
            side = "beside it" if index[a] == index[b] else "above it"
            out.append(
                f"{head}: trainer/{a}/ (room {index[a]}) may not import trainer/{b}/ "
                f"(room {index[b]}, {side}); "
                f"imports go down the trainer's rooms: move what {a} needs into {a} or below"
            )
    return out


def trainer_strays(root: Path) -> list[str]:
    """Trainer modules outside the registered rooms (at the top lie ``__init__.py`` and ``step_types.py``)."""
    rooms = {r for layer in TRAINER_ROOMS for r in layer.rooms}
    out = []
    for path in sorted((root / PACKAGE / "trainer").rglob("*.py")):
        rel = path.relative_to(root / PACKAGE / "trainer")
        top = len(rel.parts) == 1 and rel.name in ("__init__.py", "step_types.py")
        if not top and (len(rel.parts) != 2 or rel.parts[0] not in rooms):
            out.append(
                f"srpo_megatron/trainer/{rel}: not in a trainer room; put it in one of {sorted(rooms)}"
            )
    return out


def crowded_folders(root: Path, limit: int = MAX_MODULES) -> list[str]:
    """Folders of ``root/srpo_megatron`` with more than ``limit`` modules, as ``folder: n modules``."""
    out = []
    for folder in sorted({p.parent for p in (root / PACKAGE).rglob("*.py")}):
        n = len(list(folder.glob("*.py")))
        if n > limit:
            out.append(f"{folder.relative_to(root)}/: {n} modules (at most {limit}); split it into rooms")
    return out


def trainer_markdown_table() -> str:
    lines = ["| trainer room | owns |", "|---|---|"]
    for i, layer in reversed(list(enumerate(TRAINER_ROOMS))):
        lines.append(f"| {i} `trainer/{layer.files[0]}` | {layer.owns} |")
    lines.append("| leaf `trainer/step_types.py` | what flows through one step, as types |")
    return "\n".join(lines)


def test_trainer_rooms_import_down():
    found = trainer_violations(read_imports(REPO)[0])
    assert not found, "imports that break the trainer's room order:\n" + "\n".join(found)


def test_every_trainer_module_lies_in_a_registered_room():
    found = trainer_strays(REPO)
    assert not found, "\n".join(found)
    on_disk = {p.parent.name for p in (REPO / PACKAGE / "trainer").glob("*/__init__.py")}
    assert on_disk == {r for layer in TRAINER_ROOMS for r in layer.rooms}, on_disk


def test_no_folder_holds_more_than_max_modules():
    found = crowded_folders(REPO)
    assert not found, "\n".join(found)


def test_a_planted_upward_import_between_trainer_rooms_is_reported(tmp_path):
    files = {f"trainer/{r}/__init__.py": "" for r in ("microbatches", "passes", "state")}
    files |= {
        "trainer/microbatches/batches.py": "from srpo_megatron.trainer.passes.scoring import scoring_pass\n",
        "trainer/passes/scoring.py": "from srpo_megatron.trainer.state import policy\n"  # down: allowed
        "from srpo_megatron.trainer.step_types import Sample\n",  # the leaf: allowed
        # its own room (allowed), then a room through the package (not its full path)
        "trainer/state/policy.py": "def f():\n    from srpo_megatron.trainer.state.teacher import T\n"
        "    from srpo_megatron.trainer import scoring\n",  # not by its full path
    }
    found = trainer_violations(read_imports(_tree(tmp_path, files))[0])
    assert len(found) == 2, found
    up, short = found
    assert up.startswith("srpo_megatron.trainer.microbatches.batches → srpo_megatron.trainer.passes.scoring")
    assert "trainer/microbatches/ (room 1) may not import trainer/passes/ (room 3, above it)" in up
    assert short.startswith("srpo_megatron.trainer.state.policy → srpo_megatron.trainer (")
    assert "by its full path" in short


def test_a_planted_stray_trainer_module_and_an_unknown_room_are_reported(tmp_path):
    files = {"trainer/loose.py": "", "trainer/attic/__init__.py": "", "trainer/attic/old.py": ""}
    files["trainer/passes/__init__.py"] = ""
    files["trainer/passes/x.py"] = "import srpo_megatron.trainer.attic.old\n"
    root = _tree(tmp_path, files)
    strays = trainer_strays(root)
    assert any("trainer/loose.py: not in a trainer room" in s for s in strays), strays
    assert any("trainer/attic/old.py: not in a trainer room" in s for s in strays), strays
    [found] = trainer_violations(read_imports(root)[0])
    assert "trainer room 'attic' is not in TRAINER_ROOMS" in found


def test_a_planted_crowded_folder_is_reported(tmp_path):
    root = _tree(tmp_path, {f"ops/m{i:02d}.py": "" for i in range(MAX_MODULES)})  # + __init__.py: 21
    [found] = crowded_folders(root)
    assert (
        found == f"srpo_megatron/ops/: {MAX_MODULES + 1} modules (at most {MAX_MODULES}); split it into rooms"
    )
    assert crowded_folders(root, limit=MAX_MODULES + 1) == []


# ---------------------------------------------------------------------------------------------- file circles
# Inside a room the layers say nothing; a circle of modules (a.py imports b.py imports a.py) still makes a
# reader hold both at once and, at run time, hands one of them a half-initialised module. Every module of
# the package is a node, ``__init__.py`` files included: ``from srpo_megatron.x import y`` is an edge to
# ``x/__init__.py`` and, where ``y`` is a submodule, to ``x/y.py`` as well; ``import srpo_megatron.x.y``
# is an edge to ``x/y.py``. Function-level and ``TYPE_CHECKING`` imports count, as for the layers.


def package_modules(root: Path) -> set[str]:
    return {module_name(root, path) for path in (root / PACKAGE).rglob("*.py")}


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """``{module: {imported module of the package: file:line of the first such import}}``."""
    known = package_modules(root)
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted((root / PACKAGE).rglob("*.py")):
        module = module_name(root, path)
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                if target in known and target != module:
                    graph[module].setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def module_cycles(root: Path) -> list[str]:
    """One line per circle of modules: ``a → b (where) → a (where)``."""
    graph = module_graph(root)
    out = []
    for cycle in cycles({m: set(targets) for m, targets in graph.items()}):
        hops = [f"{b} ({graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        out.append(" → ".join([cycle[0], *hops]))
    return out


def test_modules_import_each_other_without_circles():
    found = module_cycles(REPO)
    assert not found, (
        "modules that import each other in a circle; move the shared types or helpers both need into a "
        "leaf module that imports neither:\n" + "\n".join(found)
    )


def test_a_planted_file_circle_is_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            "losses/__init__.py": "from srpo_megatron.losses.routed import loss\n",
            "losses/routed.py": "from srpo_megatron.losses.aggregation import aggregate\n",
            # the circle back, hidden in a TYPE_CHECKING block
            "losses/aggregation.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from srpo_megatron.losses.routed import TokenBatch\n"
            ),
            # a package __init__ and its submodule: `from srpo_megatron.conversion import rows`
            "conversion/__init__.py": "from srpo_megatron.conversion.table import Table\n",
            "conversion/table.py": "from srpo_megatron.conversion import rows\n",
            "conversion/rows.py": "",
        },
    )
    found = module_cycles(root)
    assert len(found) == 2, found
    assert any(
        c.startswith("srpo_megatron.conversion → srpo_megatron.conversion.table (srpo_megatron/conversion/")
        and c.endswith("→ srpo_megatron.conversion (srpo_megatron/conversion/table.py:1)")
        for c in found
    ), found
    assert any("srpo_megatron.losses.aggregation (srpo_megatron/losses/routed.py:1)" in c for c in found)
    assert any("srpo_megatron.losses.routed (srpo_megatron/losses/aggregation.py:3)" in c for c in found)


def test_a_leaf_opens_the_circle(tmp_path):
    root = _tree(
        tmp_path,
        {
            "losses/__init__.py": "from srpo_megatron.losses.routed import loss\n",
            "losses/batch.py": "import torch\n",
            "losses/routed.py": "from srpo_megatron.losses import aggregation, batch\n",
            "losses/aggregation.py": "import srpo_megatron.losses.batch as batch\n",
            "conversion/__init__.py": "from srpo_megatron.conversion.table import Table\n",
            "conversion/table.py": "import srpo_megatron.conversion.rows as rows\n",
            "conversion/rows.py": "",
        },
    )
    # routed imports the package __init__ (which imports routed): still a circle
    [found] = module_cycles(root)
    assert (
        "srpo_megatron.losses.routed" in found
        and "srpo_megatron.losses (srpo_megatron/losses/routed.py:1)" in found
    )
    (root / PACKAGE / "losses/routed.py").write_text(
        "from srpo_megatron.losses.aggregation import f\nfrom srpo_megatron.losses.batch import TokenBatch\n"
    )
    assert module_cycles(root) == []


# ---------------------------------------------------------------------------------------------- testing/
# ``srpo_megatron/testing/`` (tiny models, the SGLang stand-in, strict-device mode) ships in the package
# for the test suite and the training-metric gate (``tools/dev gate`` runs ``srpo_megatron.testing.gate``).
# No production module and no tool imports it: what a benchmark or the demo needs lives in a public module
# of the package (``local_ranks.py``, ``data/assets.py``). A ``"srpo_megatron.testing.x:fn"`` string (an
# import by name, e.g. a reward target) counts as an import.

TESTING = f"{PACKAGE}.testing"
_TESTING_NAME = re.compile(rf"{re.escape(TESTING)}(\.\w+)*(:[\w.]+)?")


def _imports_testing(path: Path, module: str | None) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level and module is not None:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if _TESTING_NAME.fullmatch(node.value) else []
        if any(n == TESTING or n.startswith((TESTING + ".", TESTING + ":")) for n in names):
            lines.append(node.lineno)
    return lines


# Tool files that still import testing/ on this branch, with what they need; meant to be emptied (an entry
# whose file no longer imports testing/ fails ``test_every_pending_testing_import_still_occurs``).
TESTING_PENDING: dict[str, str] = {
    "tools/bench_batch_shipping.py": "tiny.write_tiny_run and the coin reward (a tiny random run's folder)",
    "tools/bench_off_policy.py": "standin_process.StandInProcess (SGLang stand-in), tiny.write_tiny_run",
    "tools/gpu_smoke_checks.py": "tiny.write_tiny_run",
    "tools/bench_weight_sync.py": "sync_transports (the in-process stage channel and receiver)",
}


def imports_of_testing(root: Path) -> list[str]:
    """``file:line`` of every import of ``srpo_megatron/testing/`` outside it and outside tests/: from
    the package's other modules and from ``tools/*.py``."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        module = module_name(root, path)
        if module == TESTING or module.startswith(TESTING + "."):
            continue
        found += [f"{path.relative_to(root)}:{n}" for n in _imports_testing(path, module)]
    for path in sorted((root / "tools").rglob("*.py")):
        found += [f"{path.relative_to(root)}:{n}" for n in _imports_testing(path, None)]
    return found


def test_only_tests_and_the_gate_import_testing():
    found = [f for f in imports_of_testing(REPO) if f.rsplit(":", 1)[0] not in TESTING_PENDING]
    assert not found, (
        f"imports of {TESTING} outside tests/ (it is test support; move what a tool needs to "
        "a public module of the package, as local_ranks.py and data/assets.py):\n" + "\n".join(found)
    )


def test_every_pending_testing_import_still_occurs():
    files = {f.rsplit(":", 1)[0] for f in imports_of_testing(REPO)}
    stale = sorted(set(TESTING_PENDING) - files)
    assert not stale, f"TESTING_PENDING files that no longer import testing/; remove them: {stale}"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("ops/x.py", "def f():\n    from srpo_megatron.testing.tiny import write_tiny_run\n"),
        ("ops/x.py", "from srpo_megatron import testing\n"),
        ("ops/x.py", "from ..testing import tiny\n"),
        ("ops/x.py", 'TARGET = "srpo_megatron.testing.tiny:coin_reward"\n'),
        ("../tools/bench_x.py", "import srpo_megatron.testing.distributed as d\n"),
    ],
    ids=["package-lazy", "package-from-root", "package-relative", "package-by-name", "tools"],
)
def test_a_planted_testing_import_is_reported(tmp_path, name, text):
    root = _tree(tmp_path, {name: text, "testing/__init__.py": "", "testing/tiny.py": "import os\n"})
    (root / "tools").mkdir(exist_ok=True)
    found = imports_of_testing(root)
    where = "tools/bench_x.py:1" if name.startswith("..") else f"{PACKAGE}/{name}:"
    assert len(found) == 1 and found[0].startswith(where), found
    # testing/ itself, tests/ and prose that names the module are not imports
    (root / PACKAGE / "testing/gate.py").write_text("from srpo_megatron.testing.tiny import f\n")
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests/test_x.py").write_text("from srpo_megatron.testing.tiny import f\n")
    (root / PACKAGE / "ops/y.py").write_text('"""Runs ``srpo_megatron.testing.tiny`` in the tests."""\n')
    assert imports_of_testing(root) == found


if __name__ == "__main__":
    print(markdown_table())
    print()
    print(trainer_markdown_table())
