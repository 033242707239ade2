"""An assistant turn aborted mid-generation by a weight sync, over SGLang's HTTP API
(``rollout/multi_turn.py`` ``MultiTurnRollout.continue_partial`` through ``SGLangEngine``, the stand-in
server of ``srpo_megatron/testing/sglang_standin.py``, which builds every body with SGLang's own request
class).

A trajectory's second turn is held at decode step K; the sync pauses the server in mode abort
(``/pause_generation``, SGLang's ``PauseGenerationReqInput``), so the turn comes back with finish reason
abort and its K tokens; the weights are updated (version 1) and generation continued. The driver then
continues THE SAME turn: the continuation's ``/generate`` body passes SGLang's ``GenerateReqInput`` and
its ``input_ids`` are the prompt + turn 1 + the tool turn + the K partial tokens; the resumed trajectory
keeps those K tokens as the start of turn 2 (versions 0, the continuation's 1), has 3 turns, and its
turn-3 body carries the whole trajectory so far. Planted (by hand, not kept): the aborted turn restarted
from scratch (``_State.open_ids`` returning nothing) fails the continuation body's check.
"""

from __future__ import annotations

import threading

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.rows import Row
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.multi_turn import STATE_KEY, MultiTurnRollout, Trajectory, TurnLimits, TurnRenderer
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

K = 3  # the decode step of turn 2 at which the sync's pause lands
WAIT_S = 120
ARMED = threading.Event()  # set when turn 1 is answered: the hold applies to turn 2


class ThreeTurnsArming(ThreeTurns):
    """``ThreeTurns``; answering turn 1 arms the hold."""

    def step(self, text):
        if self.turn == 0:
            ARMED.set()
        return super().step(text)


@pytest.fixture
def served(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer, request_class
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    if request_class("/generate") is None:
        pytest.skip(f"SGLang's io_struct does not import here: {REAL.errors}")
    folder = write_tiny_qwen3(tmp_path / "tiny_qwen3")
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    tensors = {n: t for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(folder), weight_sync="tensor")
    engine = SGLangEngine(cfg, manifest={n: tuple(t.shape) for n, t in tensors.items()}, tied_aliases=())
    yield engine, server, tensors
    server.close()


def test_sglang_real_a_turn_aborted_by_the_sync_resumes_the_same_turn(served):
    engine, server, tensors = served
    tok = qwen3_tokenizer()
    row = Row("What is 7 * 6?", None, "42", "arithmetic", "arith", "r:0")
    prompt = encode_text(tok, template_text(tok, row.prompt, row.system))
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(len(tok), generator=g)[: len(tok) // 64])
    params = SamplingParams(n=1, max_new_tokens=600, seed=5, stop_token_ids=stops)
    driver = MultiTurnRollout(TurnRenderer(tok), ThreeTurnsArming, TurnLimits(max_turns=4))
    reached = threading.Event()

    def hold(step: int, aborted: threading.Event) -> None:  # turn 2, decode step K: wait for the pause
        if ARMED.is_set() and step == K and not reached.is_set():
            reached.set()
            aborted.wait(timeout=300)

    ARMED.clear()
    server.engine.step_hook = hold
    out: dict = {}
    worker = threading.Thread(
        target=lambda: out.update(first=driver.generate(engine, [prompt], [row], params)), daemon=True
    )
    worker.start()
    assert reached.wait(WAIT_S), "turn 2 never reached decode step K (turn 1 or 2 stopped early: change seed)"
    engine.pause_generation()  # the sync: running requests come back aborted, new ones are held
    worker.join(WAIT_S)
    engine.update_weights({n: t + 0.01 for n, t in tensors.items()}.items(), version=1)
    engine.continue_generation()
    (aborted,) = out["first"][0]
    partial = Trajectory.of(aborted)
    assert aborted.finish_reason == "abort" and STATE_KEY in aborted.meta
    start, end = partial.turn_spans[1]
    assert partial.turns == 2 and end - start == K, "turn 2 aborted after its K tokens, kept open"
    sent_before = len([b for r, b in server.bodies if r == "/generate"])

    (done,) = driver.continue_partial(engine, [prompt], params, out["first"])[0]
    assert server.rejected == [], server.rejected  # SGLang's GenerateReqInput took every body
    bodies = [b for r, b in server.bodies if r == "/generate"][sent_before:]
    assert all("text" not in b for b in bodies)
    cont = bodies[0]["input_ids"]
    cont = cont[0] if isinstance(cont[0], list) else cont
    assert cont == prompt + aborted.token_ids, (
        "the continuation: prompt + turn 1 + tool turn + partial tokens"
    )
    sp = bodies[0]["sampling_params"]
    sp = sp[0] if isinstance(sp, list) else sp
    assert sp["max_new_tokens"] == params.max_new_tokens - len(aborted.token_ids)
    t = Trajectory.of(done)
    assert STATE_KEY not in done.meta and t.turns == 3, "the same turn continued, then turn 3"
    assert t.turn_spans[1][0] == start and t.turn_spans[1][1] > end, "turn 2 = its partial tokens + more"
    assert done.token_ids[:end] == aborted.token_ids and done.logprobs[:end] == aborted.logprobs
    assert done.token_versions == [0] * end + [1] * (len(done.token_ids) - end)
    turn3 = bodies[1]["input_ids"]
    turn3 = turn3[0] if isinstance(turn3[0], list) else turn3
    assert turn3 == prompt + done.token_ids[: t.turn_spans[2][0]], "turn 3 from the whole trajectory so far"
    assert not server.dead
