"""The stand-in server's ``meta_info["routed_experts"]`` against SGLang's own code, and the client's reading.

SGLang (0.5.15.post1 and 0.5.23): the scheduler collects ``[P + R - 1, layers, top_k]`` int32 rows for a
request that finished or was aborted while running (``batch_result_processor._maybe_collect_routed_experts``),
the detokenizer base64-encodes their bytes (``DetokenizerManager._b64_encode_per_request``), and a reader
decodes them with ``state_capturer.routed_experts.extract_routed_experts_from_meta_info``. Here the stand-in
serves a tiny Qwen3-MoE through the project's HTTP client (``SGLangEngine``): SGLang's own reader decodes
what it sent to the same ids as the client's ``decode_sglang_routed_experts``, the request body passes
SGLang's ``GenerateReqInput``, the ids equal the HF model's routers' (a full forward,
``hf_routed_experts``), and a sample aborted at its 3rd decode step, the weights updated (per-expert
names, into the fused experts) and continued comes back stitched: the old weights' experts for the
positions its first segment forwarded, the new weights' after them. Planted (by hand, not kept): per-expert
names accepted but not loaded (the stand-in's old gap) fails the last check.
"""

from __future__ import annotations

import threading

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_moe_layout import file_format_params
from srpo_megatron.rollout.partial import continue_partial
from srpo_megatron.rollout.routed_experts import decode_sglang_routed_experts, hf_routed_experts
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.testing import sglang_import
from srpo_megatron.testing.sglang_standin import SGLangStandInServer, standin_serialize
from srpo_megatron.testing.tiny import TINY_MOE_TOP_K as TOP_K
from srpo_megatron.testing.tiny import tiny_moe_model

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

WAIT_S = 120
PROMPT = [5, 17, 42, 7]
PARAMS = SamplingParams(max_new_tokens=8, seed=11, return_routed_experts=True)


def _file_state(model) -> dict[str, torch.Tensor]:
    return {
        n: t.detach().clone() for n, t in file_format_params(dict(model.state_dict(keep_vars=True))).items()
    }


@pytest.fixture
def served(tmp_path):
    model = tiny_moe_model(seed=3)
    model.save_pretrained(tmp_path)
    server = SGLangStandInServer(model)
    manifest = {n: tuple(t.shape) for n, t in _file_state(model).items()}
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(tmp_path), bucket_bytes=1024**2)
    yield SGLangEngine(cfg, manifest=manifest, serializer=standin_serialize), server
    server.close()


def _sorted(ids: torch.Tensor, rows: int) -> torch.Tensor:
    return ids.reshape(rows, -1, TOP_K).long().sort(-1).values


def test_standin_routed_experts_decode_with_sglangs_own_reader_to_the_hf_routers_ids(served):
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    engine, server = served
    (c,) = engine.generate([PROMPT], PARAMS)[0]
    ((body, (out,)),) = server.outputs_log
    assert body["return_routed_experts"] is True and not server.rejected, "GenerateReqInput takes the body"
    theirs = torch.from_numpy(extract_routed_experts_from_meta_info(out).copy())
    assert torch.equal(theirs, decode_sglang_routed_experts(out["meta_info"]["routed_experts"]))
    assert torch.equal(theirs, c.routed_experts), "the client keeps SGLang's flat int32 ids"
    ids = PROMPT + c.token_ids
    rows = len(ids) - 1  # SGLang's P + R - 1: the last response token is never forwarded
    assert theirs.numel() == rows * 2 * TOP_K
    want = hf_routed_experts(tiny_moe_model(seed=3), torch.tensor([ids[:-1]]), TOP_K)
    assert torch.equal(_sorted(theirs, rows), want)


def test_standin_reports_no_routed_experts_unless_requested(served):
    engine, server = served
    (c,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=4, seed=11))[0]
    ((_, (out,)),) = server.outputs_log
    assert "routed_experts" not in out["meta_info"] and c.routed_experts is None


def test_standin_aborted_then_continued_sample_stitches_each_versions_experts(served):
    engine, server = served
    old, new = tiny_moe_model(seed=3), tiny_moe_model(seed=4)
    reached = server.hold_after_steps(3)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(first=engine.generate([PROMPT], PARAMS)), daemon=True)
    worker.start()
    assert reached.wait(WAIT_S), "the generation never reached decode step 3"
    engine.pause_generation()
    worker.join(WAIT_S)
    engine.update_weights(_file_state(new).items(), version=1)
    engine.continue_generation()
    first = out["first"][0][0]
    assert first.finish_reason == "abort" and len(first.token_ids) == 3
    kept = len(PROMPT) + 3 - 1
    assert first.routed_experts.numel() == kept * 2 * TOP_K, "an abort while running: P + R - 1 rows"
    sample = continue_partial(engine, [PROMPT], PARAMS, out["first"])[0][0]
    ids = PROMPT + sample.token_ids
    assert sample.meta["segments"] == 2 and sample.token_versions[:3] == [0, 0, 0]
    cont_out = server.outputs_log[-1][1][0]
    cont = decode_sglang_routed_experts(cont_out["meta_info"]["routed_experts"])
    assert cont.numel() == (len(ids) - 1) * 2 * TOP_K, "the continuation re-reports its prefill's rows"
    got = _sorted(sample.routed_experts, len(ids) - 1)
    want_old = hf_routed_experts(old, torch.tensor([ids[:kept]]), TOP_K)
    want_new = hf_routed_experts(new, torch.tensor([ids[:-1]]), TOP_K)
    assert torch.equal(got[:kept], want_old), "first segment's positions: the old weights' experts"
    assert torch.equal(got[kept:], want_new[kept:]), "after them: the new weights' experts"
    assert not torch.equal(want_old, want_new[:kept]), "the two versions route differently here"
    assert not server.dead


def test_standin_fallback_encoding_equals_sglangs_detokenizer(monkeypatch):
    """Without an sglang wheel (the plain venv's dist runs) the stand-in encodes as SGLang's detokenizer."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    from srpo_megatron.testing import sglang_standin

    ids = torch.randint(0, 4, (9, 2, TOP_K), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    theirs = DetokenizerManager._b64_encode_per_request([ids])[0]
    assert sglang_standin.encode_routed_experts(ids) == theirs
    monkeypatch.setattr(sglang_standin.sglang_import, "load", lambda: None)
    assert sglang_standin.encode_routed_experts(ids) == theirs
    assert sglang_standin.encode_routed_experts(ids.long()) == theirs, "int32 on the wire, whatever it held"
