"""The colocated SGLang engine's release/resume cycle against a transport that keeps SGLang's memory rules.

``SGLangMemoryRules`` models what SGLang's scheduler does with ``/release_memory_occupation`` and
``/resume_memory_occupation`` (``weight_updater.py`` in sglang 0.5.15.post1 and 0.5.23): ``tags`` None or
``[]`` means every type in ``GPU_MEMORY_ALL_TYPES``; resuming a tag that is not paused raises
(``offload_tags.remove``); a second pause of a paused tag is refused here (torch_memory_saver has nothing
left to pause). Any such error kills the server (SGLang kills its process tree), and so does generating
while any memory is paused (decode would replay CUDA graphs or write KV cache into unmapped memory) or
loading weights while the weights are paused.

Independent of the stand-in HTTP server: the rules are a plain in-process transport.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.protocol import (
    PINNED_MEMORY_TAGS,
    build_memory_occupation_request,
    memory_tags,
)
from tests.helpers.sglang import SGLANG_ALL_TYPES, SGLangMemoryRules

WEIGHTS = {"w": torch.ones(4, 4), "b": torch.zeros(4)}


def _engine(cls=SGLangEngine) -> tuple[SGLangEngine, SGLangMemoryRules]:
    rules = SGLangMemoryRules()
    cfg = SGLangEngineConfig(mode="http", url="http://unused", model_path="/m", weight_sync="tensor")
    manifest = {n: tuple(t.shape) for n, t in WEIGHTS.items()}
    return cls(cfg, transport=rules, manifest=manifest, serializer=lambda data: "payload"), rules


def _training_steps(engine: SGLangEngine, steps: int) -> None:
    """What the trainer does with a colocated engine: sync, generate, release for training, repeat."""
    for version in range(1, steps + 1):
        engine.update_weights(WEIGHTS.items(), version=version)
        out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
        assert out[0][0].weight_version == version
        engine.release_memory()


def test_engine_releases_every_sglang_type_and_resumes_all_before_generating():
    engine, rules = _engine()
    _training_steps(engine, 3)
    assert not rules.dead
    assert rules.paused == set(SGLANG_ALL_TYPES), "training runs with all of SGLang's memory released"
    mem = [(m, tags) for m, tags in rules.calls if m.endswith("memory_occupation")]
    assert None not in [tags for _, tags in mem], "tags are always named (None means every type)"
    cycle = [
        ("release_memory_occupation", ["kv_cache", "weights", "cuda_graph"]),
        ("resume_memory_occupation", ["weights"]),  # before the first bucket ...
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),  # ... the rest after the last one
    ]
    assert mem == [*cycle, *cycle, cycle[0]]
    # order within one update: weights resumed -> buckets -> KV cache and CUDA graphs -> generate
    calls = [m for m, _ in rules.calls]
    second = calls.index("release_memory_occupation") + 1
    step2 = calls[second : calls.index("generate", second) + 1]
    assert step2[0] == "resume_memory_occupation" and step2[-1] == "generate"
    last_bucket = max(i for i, m in enumerate(step2) if m == "update_weights_from_tensor")
    assert step2.index("update_weights_from_tensor") > 0
    assert step2.index("resume_memory_occupation", 1) > last_bucket


def test_release_is_idempotent_and_resume_skips_what_is_resident():
    engine, rules = _engine()
    engine.update_weights(WEIGHTS.items(), version=1)
    engine.release_memory()
    engine.release_memory()  # nothing paused twice
    engine.resume_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])  # already resident: no call (SGLang would raise)
    engine.release_memory()  # only what is resident again
    assert [t for m, t in rules.calls if m.endswith("memory_occupation")] == [
        ["kv_cache", "weights", "cuda_graph"],
        ["kv_cache"],
        ["kv_cache"],
    ]
    engine.resume_memory()
    assert not rules.paused and not rules.dead
    with pytest.raises(EngineError, match="weights were released"):  # resumed weights are garbage
        engine.generate([[1]], SamplingParams(max_new_tokens=1))


def test_a_failed_update_leaves_nothing_paused_twice():
    """An update that fails after the weights came back leaves KV cache and CUDA graphs paused; the next
    release pauses only the weights, and the next update resumes everything."""
    engine, rules = _engine()
    engine.update_weights(WEIGHTS.items(), version=1)
    engine.release_memory()
    with pytest.raises(EngineError, match="missing"):
        engine.update_weights([("w", WEIGHTS["w"])], version=2)
    assert rules.paused == {"kv_cache", "cuda_graph"}
    engine.release_memory()
    assert rules.calls[-1] == ("release_memory_occupation", ["weights"])
    engine.update_weights(WEIGHTS.items(), version=2)
    assert not rules.paused and not rules.dead
    engine.generate([[1]], SamplingParams(max_new_tokens=1))


def test_a_released_engine_takes_its_served_version_again():
    """A checkpoint save releases the engines and re-pushes the same version (trainer/state/offload.py)."""
    engine, rules = _engine()
    engine.update_weights(WEIGHTS.items(), version=3)
    with pytest.raises(EngineError, match="not newer"):
        engine.update_weights(WEIGHTS.items(), version=3)  # serving: the same version is a trainer bug
    engine.release_memory()
    with pytest.raises(EngineError, match="not newer"):
        engine.update_weights(WEIGHTS.items(), version=2)  # released: still never backwards
    engine.update_weights(WEIGHTS.items(), version=3)
    assert not rules.paused and not rules.dead
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0][0].weight_version == 3


class _PlantedOldRelease(SGLangEngine):
    """The defect (issue 24, D2): release with tags=None (every type inside SGLang) while the engine
    records only weights and KV cache, so the CUDA graphs stay paused."""

    def release_memory(self) -> None:
        if self._released:
            return
        self._transport.call("release_memory_occupation", {"tags": None})
        self._released = {"weights", "kv_cache"}


class _PlantedPausesTwice(SGLangEngine):
    """The engine forgets what it released: a second release pauses paused tags."""

    def release_memory(self) -> None:
        self._released = set()
        super().release_memory()


def test_planted_old_release_dies_at_the_second_step():
    engine, rules = _engine(_PlantedOldRelease)
    with pytest.raises(EngineError, match=r"generate with paused memory \['cuda_graph'\]"):
        _training_steps(engine, 2)
    assert rules.dead


def test_planted_double_pause_dies():
    engine, _ = _engine(_PlantedPausesTwice)
    engine.update_weights(WEIGHTS.items(), version=1)
    engine.release_memory()
    with pytest.raises(EngineError, match="already paused"):
        engine.release_memory()


def test_memory_requests_always_name_their_tags():
    assert build_memory_occupation_request(["kv_cache"]) == {"tags": ["kv_cache"]}
    for nothing in (None, []):
        with pytest.raises(EngineError, match="explicit tags"):
            build_memory_occupation_request(nothing)


def test_the_engine_knows_every_sglang_memory_type():
    assert list(PINNED_MEMORY_TAGS) == SGLANG_ALL_TYPES
    assert set(memory_tags()) >= {"kv_cache", "weights"}


def test_pinned_memory_tags_equal_sglang_constant():
    """Wherever sglang imports (GPU image, the sglang side directory), the pin must equal the real list."""
    constants = pytest.importorskip("sglang.srt.constants")
    assert tuple(constants.GPU_MEMORY_ALL_TYPES) == PINNED_MEMORY_TAGS
    assert memory_tags() == tuple(constants.GPU_MEMORY_ALL_TYPES)
