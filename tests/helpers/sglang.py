"""SGLang-engine scaffolding without a server: ``SGLangMemoryRules``, an in-process transport that keeps
SGLang's memory rules, one full sync through the engine's manifest gate, and the planted in-memory manifest.

``SGLangMemoryRules`` models what SGLang's scheduler does with ``/release_memory_occupation`` and
``/resume_memory_occupation`` (``weight_updater.py`` in sglang 0.5.15.post1 and 0.5.23): ``tags`` None or
``[]`` means every type in ``GPU_MEMORY_ALL_TYPES``; resuming a tag that is not paused raises
(``offload_tags.remove``); a second pause of a paused tag is refused here (torch_memory_saver has nothing
left to pause). Any such error kills the server (SGLang kills its process tree), and so does generating
while any memory is paused (decode would replay CUDA graphs or write KV cache into unmapped memory) or
loading weights while the weights are paused.
"""

from __future__ import annotations

import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.sglang.engine import SGLangEngine

# GPU_MEMORY_ALL_TYPES as read in sglang/srt/constants.py of the sglang 0.5.15.post1 and 0.5.23 wheels.
SGLANG_ALL_TYPES = ["kv_cache", "weights", "cuda_graph"]


class SGLangMemoryRules:
    """In-process transport with SGLang's memory semantics (module docstring); records every call."""

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.calls: list[tuple[str, list[str] | None]] = []
        self.dead = ""
        self.version = "default"

    def _die(self, why: str) -> None:
        self.dead = why
        raise EngineError(f"SGLang died: {why}")

    def _tags(self, body: dict) -> list[str]:
        return list(body.get("tags") or SGLANG_ALL_TYPES)  # None and [] both mean every type

    def call(self, method: str, body: dict | None = None, http_method: str = "POST"):
        self.calls.append((method, (body or {}).get("tags")))
        if self.dead:
            raise EngineError(f"SGLang is dead ({self.dead})")
        if method == "release_memory_occupation":
            tags = self._tags(body)
            if twice := sorted(set(tags) & self.paused):
                self._die(f"pause of already paused {twice}")
            self.paused |= set(tags)
            return {}
        if method == "resume_memory_occupation":
            for tag in self._tags(body):
                if tag not in self.paused:
                    self._die(f"KeyError: resume of {tag!r}, which is not paused")
                self.paused.remove(tag)
            return {}
        if method == "update_weights_from_tensor":
            if "weights" in self.paused:
                self._die("weights loaded into paused memory")
            self.version = body.get("weight_version") or self.version
            return {"success": True, "message": ""}
        if method == "generate":
            if self.paused:
                self._die(f"generate with paused memory {sorted(self.paused)}")
            n = len(body["input_ids"])
            meta = {
                "output_token_logprobs": [[-0.5, 7, None]],
                "finish_reason": {"type": "length"},
                "completion_tokens": 1,
                "weight_version": self.version,
            }
            return [{"meta_info": dict(meta)} for _ in range(n)]
        if method in ("flush_cache", "health"):
            return {}
        raise AssertionError(f"unexpected call {method}")

    def health(self) -> bool:
        return not self.dead

    def close(self) -> None:
        pass


def in_memory_manifest(model_path: str) -> dict[str, tuple[int, ...]]:
    """The planted defect: transformers' in-memory parameter names (the old ``hf_manifest``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def sync_through_gate(model_path, stream, manifest=None) -> SGLangEngine:
    """One full sync of ``stream`` into an SGLang engine whose manifest is built as in production."""
    cfg = SGLangEngineConfig(mode="http", url="http://unused", model_path=str(model_path), bucket_bytes=2**20)
    engine = SGLangEngine(cfg, transport=SGLangMemoryRules(), manifest=manifest, serializer=lambda d: "p")
    engine.update_weights(stream, version=1)
    return engine
