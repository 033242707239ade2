"""Multi-turn rollouts over SGLang's HTTP API (``rollout/multi_turn.py`` through ``SGLangEngine``): every
``/generate`` body the driver makes (the first turn's, then each later turn's ``input_ids`` = prompt +
the trajectory so far) goes through SGLang's own ``GenerateReqInput`` (the stand-in server refuses a body
its class refuses, ``srpo_megatron/testing/sglang_standin.py``), and each later turn's ``input_ids`` are
exactly the prompt followed by the ids the trainer will score up to that turn.

An abort mid-turn (``rollout.partial``) and its continuation: ``test_multi_turn_abort_sglang.py``.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.rows import Row
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.multi_turn import MultiTurnRollout, Trajectory, TurnLimits, TurnRenderer
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.testing import sglang_import
from tests.helpers.multi_turn_envs import ThreeTurns

pytestmark = pytest.mark.sglang_real

# SGLang's modules load before anything here imports transformers (as tests/sglang_real/test_sglang_real.py)
REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev runs this file in its SGLang tiers)", allow_module_level=True
    )


def request_class(route: str):
    from srpo_megatron.testing.sglang_standin import request_class

    return request_class(route)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    if request_class("/generate") is None:
        pytest.skip(f"SGLang's io_struct does not import here: {REAL.errors}")
    folder = write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(folder))
    yield SGLangEngine(cfg, manifest={}, tied_aliases=()), server
    server.close()


def test_sglang_real_multi_turn_bodies_pass_generatereqinput_and_carry_the_scored_ids(served):
    engine, server = served
    tok = qwen3_tokenizer()
    rows = [Row(f"What is {i} * 6?", None, str(6 * i), "arithmetic", "arith", f"r:{i}") for i in range(2)]
    prompts = [encode_text(tok, template_text(tok, r.prompt, r.system)) for r in rows]
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(len(tok), generator=g)[: len(tok) // 16])
    params = SamplingParams(n=2, max_new_tokens=300, seed=3, stop_token_ids=stops)
    driver = MultiTurnRollout(TurnRenderer(tok), ThreeTurns, TurnLimits(max_turns=4))
    out = driver.generate(engine, prompts, rows, params)
    assert server.rejected == [], server.rejected  # SGLang's GenerateReqInput took every body
    bodies = [b for route, b in server.bodies if route == "/generate"]
    assert all("text" not in b for b in bodies)  # ids in, never the conversation's text
    sent = [ids for b in bodies for ids in b["input_ids"]]
    multi = 0
    for i, group in enumerate(out):
        for c in group:
            spans = Trajectory.of(c).turn_spans
            for start, _ in spans[1:]:  # each later turn was asked with prompt + the scored ids so far
                assert prompts[i] + c.token_ids[:start] in sent
            multi += len(spans) == 3 and c.finish_reason == "stop"
    assert multi >= 2, "most trajectories should reach their three turns"
    assert len(sent) >= 4 + 2 * multi


def test_sglang_real_a_body_with_text_is_tokenized_by_the_server_whatever_its_ids():
    """Why the bodies must carry ``input_ids`` only: SGLang's class takes ``text`` over ``input_ids`` when
    both are set (io_struct ``_determine_batch_size`` reads text first), so a later turn sent with the
    conversation's text would be re-tokenized by the server, the drift token-in-token-out prevents."""
    cls = request_class("/generate")
    if cls is None:
        pytest.skip("SGLang's io_struct does not import here")
    req = cls(text=["<|im_start|>user\nhi"], input_ids=[[1, 2]], sampling_params=[{"max_new_tokens": 1}])
    req.normalize_batch_and_arguments()
    assert req.text == ["<|im_start|>user\nhi"] and req.batch_size == 1
