"""Token-in-token-out multi-turn rollouts: the engine generates every assistant turn from token ids, and
the tool/user turns between them are appended as the chat template's own rendering of those turns.

Per trajectory the response is ``e_1 t_1 e_2 t_2 ... e_n``: ``e_k`` the engine's ids of assistant turn
k exactly as sampled (never decoded and re-encoded), ``t_k`` the template's ids of the messages the
environment answered turn k with. ``response_mask`` is 1 on every ``e_k`` token and 0 on every ``t_k``
token; ``logprobs`` is the engine's log-prob on mask-1 tokens and 0.0 on mask-0 ones
(``trainer/step_types.Sample``). Turn k+1 is generated from ``prompt + e_1 t_1 ... e_k t_k``, so the
engine saw exactly the ids the trainer scores. With the CPU engine's ``rollout.true_on_policy_mode`` the
finished trajectories of the call are rescored together (``HFEngine.rescore``: the trainer's layout and
kernel over whole trajectories, ``rollout/true_on_policy.py``), so the mask-1 log-probs equal π_old.

``t_k`` is the template's rendering of the new messages ON THEIR OWN (``TurnRenderer.tool_turn_ids``):
after a fixed prefix conversation (``PREFIXES``), with the generation prompt, the prefix's own rendering
cut off, as verl does; earlier turns are never re-rendered (Qwen3's official template renders a
non-last assistant turn differently from a last one). The suffix must be the same after two different
prefixes, else ``TemplateDrift`` (one line naming the turn and the first differing text). ``t_k`` is
the encoded suffix, preceded by whatever the template closes an assistant turn with that the engine did
not generate (for Qwen3 the ``\\n`` after ``<|im_end|>``; all of ``<|im_end|>\\n`` when the turn stopped on
another stop token).

Bounds: ``rollout.max_new_tokens`` bounds the whole response (assistant and tool tokens: the trainer's
buffers are sized by it), each turn gets what is left; a turn cut by it, a tool turn that does not fit,
or ``rollout.max_turns`` assistant turns without the environment being done end the trajectory with
finish reason ``length`` (a truncation). Each ``step`` runs under ``rollout.tool_timeout_s``; a step
that raises or times out is a *fault*: ``rollout.on_tool_fault`` says whether the trajectory goes on
with an error message as the tool's answer (``continue``) or ends and scores 0 (``fail``). A tool
message longer than ``rollout.max_tool_output_tokens`` is clipped. Every fault, clip and truncation is
counted per trajectory (``Trajectory``) and per step (``multi_turn_metrics``); none fails the step.

**Partial rollouts** (``rollout.partial``; the single-turn rules are ``rollout/partial.py``'s). A weight
sync pauses the engine in mode abort: a turn in flight comes back ``abort`` with its tokens so far. The
driver then stops after that round and returns every unfinished trajectory as an ``abort`` completion
whose ``meta[STATE_KEY]`` holds its live state (messages, environment, ids, mask, log-probs, per-token
versions, turn index, and the aborted turn's tokens, log-probs and versions); the completion's ids are the
trajectory's so far with the open turn counted as a turn. :meth:`MultiTurnRollout.continue_partial`
(``GenerationWorker.continue_partial``, after the sync) resumes them: an aborted turn is continued, not
restarted and not closed, from ``prompt + e_1 t_1 ... t_{k-1} + its partial tokens`` (never re-rendered),
with ``max_new_tokens`` the response budget left and a segment seed of the turn's own
(``partial.segment_seed``); its tokens are the partial ones followed by the continuation's
(``partial.merge_segments``), as slime resumes a generation from ``sample.tokens`` with ``max_new_tokens``
less its response so far (THUDM/slime ``slime/rollout/sglang_rollout.py`` ``generate`` @ 0044b40). Only
then does the environment answer the turn, and later turns follow. An abort that landed on the step the
turn ended is settled as it ended (``partial.settle``). ``Completion.token_versions`` covers the whole
response: each engine token the version that generated it, each tool token its assistant turn's last
token's, so a trajectory across a sync counts in ``async/partial_share`` and its old tokens in the
staleness mask.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from srpo_megatron.rollout.base import Completion, EngineError, SamplingParams, sample_seed
from srpo_megatron.rollout.environments.base import EnvironmentFactory, EnvStep, resolve_environment
from srpo_megatron.rollout.partial import merge_segments, segment_seed, settle

ToolFault = Literal["continue", "fail"]
CLIPPED = " …[tool output clipped]"
# An aborted trajectory's live state (``_State``) in its ``Completion.meta``: in-process only, consumed by
# ``MultiTurnRollout.continue_partial``; a completion that finished never carries it.
STATE_KEY = "trajectory_state"
_SENTINEL = "\x00srpo-assistant-turn\x00"
# The fixed conversations a tool turn is rendered after (its ids = the rendering's suffix past the prefix's
# own rendering), as verl renders tool responses after its BASE_CHAT_HISTORY (volcengine/verl
# verl/workers/rollout/schemas.py @ a7661d0; its agent loop cuts the template's default system prompt the
# same way, verl/experimental/agent_loop/tool_agent_loop.py @ 1fc8e36). Never the trajectory's own
# earlier turns: a template may render those differently once they are no longer last (Qwen3's official
# one drops a non-last assistant turn's empty think block). Two prefixes: a suffix that depends on them
# is refused.
PREFIXES: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "I am a user."},
    ],
    [{"role": "user", "content": "What is 2 + 2?"}],
)


class TemplateDrift(ValueError):
    """The chat template's rendering of a tool turn is not well defined: it re-renders the messages before
    it, or it depends on them."""


@dataclass(frozen=True)
class TurnLimits:
    """The recipe's bounds on one trajectory (``rollout.*``)."""

    max_turns: int = 4  # assistant turns
    tool_timeout_s: float = 10.0  # one environment step
    max_tool_output_tokens: int = 512  # one tool message's content
    on_tool_fault: ToolFault = "continue"  # a step that raised or timed out: go on, or end with reward 0


@dataclass
class Trajectory:
    """One multi-turn sample's bookkeeping (``Completion.meta["multi_turn"]`` holds it as a dict:
    ``to_meta``; ``Trajectory.of(completion)`` reads it back)."""

    response_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # each assistant turn's [start, end)
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward part per turn
    assistant_text: str = ""  # the assistant turns' text, joined by newlines: what the verifier reads
    tool_calls: int = 0
    tool_errors: int = 0  # calls the tool answered with an error (the model's mistakes)
    tool_raised: int = 0  # environment steps that raised (faults)
    tool_timeouts: int = 0  # environment steps past rollout.tool_timeout_s (faults)
    tool_clipped: int = 0  # tool messages clipped to rollout.max_tool_output_tokens
    truncated: str = ""  # why the trajectory was cut: "" (not), "tokens", "turns"
    failed: bool = False  # a fault ended it under on_tool_fault=fail: it scores 0
    faults: list[str] = field(default_factory=list)  # one line per fault

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    def to_meta(self) -> dict[str, Any]:
        """Plain python (``Completion.meta["multi_turn"]``): the rollout pool's checkpoint loads it without
        unpickling (``torch.load(weights_only=True)``)."""
        out = dataclasses.asdict(self)
        out["turn_spans"] = [list(span) for span in self.turn_spans]
        return out

    @classmethod
    def of(cls, c: Completion) -> Trajectory | None:
        """The bookkeeping of a multi-turn ``Completion``; None for a single-turn one."""
        meta = c.meta.get("multi_turn")
        if meta is None:
            return None
        return cls(**{**meta, "turn_spans": [tuple(span) for span in meta["turn_spans"]]})


class TurnRenderer:
    """The chat template's incremental rendering of tool/user turns, as token ids."""

    def __init__(self, tokenizer: Any, enable_thinking: bool = False) -> None:
        self.tokenizer, self.enable_thinking = tokenizer, enable_thinking
        probe = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
        self.closer = probe.split(_SENTINEL)[-1]  # what the template ends an assistant turn with

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            enable_thinking=self.enable_thinking,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def tool_turn_ids(self, new: list[dict[str, str]], engine_ids: Sequence[int], turn: int) -> list[int]:
        """Ids of ``new`` (the tool/user messages answering the assistant turn whose engine ids are
        ``engine_ids``), up to and including the next assistant turn's opening: ``new`` rendered after each
        fixed prefix of ``PREFIXES`` (with the generation prompt), the prefix's own rendering cut off. The
        two suffixes must agree, else the template renders these messages depending on what precedes
        them (``TemplateDrift``). Earlier turns are never re-rendered."""
        suffixes = []
        for prefix in PREFIXES:
            before = self.render(prefix)
            after = self.render(prefix + new, generation_prompt=True)
            if not after.startswith(before):
                raise self._drift(turn, new, before, after, "re-renders the messages before them")
            suffixes.append(after[len(before) :])
        if len(set(suffixes)) > 1:
            raise self._drift(turn, new, *suffixes, "renders them differently after different conversations")
        rest = self.closer
        last = self.decode(engine_ids[-1:]) if engine_ids else ""
        if last and rest.startswith(last):
            rest = rest[len(last) :]  # the engine generated the template's end-of-turn token itself
        return self.encode(rest + suffixes[0])

    @staticmethod
    def _drift(turn: int, new: list[dict[str, str]], a: str, b: str, what: str) -> TemplateDrift:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        roles = "/".join(m["role"] for m in new)
        return TemplateDrift(
            f"the chat template {what} once turn {turn}'s {roles} message is added (at character {at}: "
            f"{a[at : at + 40]!r} vs {b[at : at + 40]!r}), so the turn's ids are not well defined; use a "
            "template that renders a tool turn on its own, or send the environment's messages as role 'tool'"
        )

    def assistant_text(self, engine_ids: Sequence[int], stopped: bool) -> str:
        """The turn's text as the conversation shows it (the end-of-turn token the template adds again
        is left out)."""
        ids = list(engine_ids)
        if stopped and ids and self.closer.startswith(self.decode(ids[-1:])):
            ids = ids[:-1]
        return self.decode(ids)


def guarded_step(env: Any, text: str, timeout_s: float) -> tuple[EnvStep | None, str, str]:
    """``env.step(text)`` on a daemon thread, waited for ``timeout_s``: (answer, fault kind, fault line).
    A step still running at the timeout is abandoned (its thread is left to finish or hang on its own;
    the environment object is not used again)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["step"] = env.step(text)
        except Exception as e:  # any failure of the environment's code is a fault, never a failed step
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, name="srpo-env-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, "timeout", f"the environment's step ran past rollout.tool_timeout_s={timeout_s}"
    if "error" in box:
        return None, "raised", f"the environment's step raised {box['error']}"
    step = box["step"]
    if not isinstance(step, EnvStep):
        return None, "raised", f"the environment's step returned a {type(step).__name__}, not an EnvStep"
    return step, "", ""


@dataclass
class _State:
    """One trajectory in flight."""

    index: int  # prompt index in the call
    member: int
    row: Any
    env: Any
    messages: list[dict[str, str]]
    traj: Trajectory = field(default_factory=Trajectory)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""  # set when the trajectory ends
    weight_version: int = 0
    versions: list[int] = field(default_factory=list)  # per response token: the version that produced it
    open_turn: Completion | None = None  # the assistant turn a sync aborted: its tokens so far
    segments: int = 0  # aborts of assistant turns so far (each continuation's seed differs)

    def open_ids(self) -> list[int]:
        return list(self.open_turn.token_ids) if self.open_turn is not None else []


class MultiTurnRollout:
    """Drives ``n`` trajectories per prompt through an engine and an environment (module docstring)."""

    def __init__(self, renderer: TurnRenderer, factory: EnvironmentFactory, limits: TurnLimits) -> None:
        self.renderer, self.factory, self.limits = renderer, factory, limits

    def generate(
        self, engine: Any, prompts: Sequence[Sequence[int]], rows: Sequence[Any], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` trajectories per prompt; ``rows[i]`` is prompt i's data row (its environment's
        ``reset`` argument and the conversation's first messages). A round a sync aborted ends the call:
        the unfinished trajectories come back ``abort`` (module doc; ``continue_partial`` resumes them)."""
        params = self._params(params)
        first = engine.generate(prompts, params)
        states = [self._start(i, j, rows[i], c) for i, group in enumerate(first) for j, c in enumerate(group)]
        eos = tuple(getattr(engine, "eos_token_ids", ()))
        for s, c in zip(states, (c for g in first for c in g), strict=True):
            self._turn(s, c, params, eos)
        if not any(s.open_turn is not None for s in states):
            self._drive(engine, prompts, params, states, eos)
        out: list[list[Completion]] = [[] for _ in prompts]
        for s in states:
            out[s.index].append(self.completion(s))
        if getattr(engine, "true_on_policy_mode", False):  # the CPU engine's rollout.true_on_policy_mode
            engine.rescore(prompts, out, params.temperature)  # whole trajectories, as the trainer scores them
            for s in states:  # tool tokens keep log-prob 0.0 (mask 0)
                c = out[s.index][s.member]
                c.logprobs = [
                    lp if m else 0.0 for lp, m in zip(c.logprobs, s.traj.response_mask, strict=True)
                ]
        return out

    def continue_partial(
        self,
        engine: Any,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        completions: list[list[Completion]],
    ) -> list[list[Completion]]:
        """Resume every aborted trajectory of ``generate(engine, prompts, rows, params)`` (``completions``,
        same nesting) with the engine's current weights: an open turn is continued where the abort left
        it, then the trajectory goes on (module doc). Finished ones pass through (the same objects); one
        that a later sync aborts again comes back ``abort`` (call again). ``GenerationWorker``'s
        ``continue_partial`` signature."""
        params = self._params(params)
        result = [list(group) for group in completions]
        todo: list[tuple[int, int, _State]] = []
        for i, group in enumerate(result):
            for j, c in enumerate(group):
                if c.finish_reason != "abort":
                    continue
                state = c.meta.get(STATE_KEY)
                if not isinstance(state, _State):
                    raise EngineError(
                        f"trajectory {i}/{j} came back aborted without its state (meta[{STATE_KEY!r}]): "
                        "only completions of MultiTurnRollout.generate can be resumed"
                    )
                state.weight_version = c.weight_version  # the dispatch version the worker stamped
                todo.append((i, j, state))
        if todo:
            self._drive(
                engine, prompts, params, [s for _, _, s in todo], tuple(getattr(engine, "eos_token_ids", ()))
            )
        for i, j, state in todo:
            result[i][j] = self.completion(state)
        return result

    @staticmethod
    def _params(params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, return_routed_experts=False, top_logprobs=0)

    def _drive(
        self,
        engine: Any,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        states: list[_State],
        eos: tuple[int, ...],
    ) -> None:
        """Later turns (or the open ones' continuations) of ``states`` until each ends, or until a round
        in which a sync aborted some turn."""
        while live := [s for s in states if not s.finish]:
            inputs = [list(prompts[s.index]) + s.ids + s.open_ids() for s in live]
            per = [self._turn_params(params, s) for s in live]
            outs = engine.generate_requests(inputs, per)
            if len(outs) != len(live):
                raise EngineError(
                    f"generate_requests returned {len(outs)} completions for {len(live)} inputs"
                )
            for s, c in zip(live, outs, strict=True):
                self._turn(s, c, params, eos)
            if any(s.open_turn is not None for s in live):
                return  # the weights change now: every unfinished trajectory waits for the sync

    def _start(self, i: int, j: int, row: Any, c: Completion) -> _State:
        env = self.factory()
        extra = env.reset(row)
        if extra:
            raise ValueError(
                f"environment {type(env).__name__}.reset returned {len(extra)} message(s) for {row.source}; "
                "messages before the first turn are not supported yet: put them in the row's prompt"
            )
        base = [{"role": "system", "content": row.system}] if row.system is not None else []
        base.append({"role": "user", "content": row.prompt})
        return _State(i, j, row, env, base, weight_version=c.weight_version)

    def _turn_params(self, params: SamplingParams, s: _State) -> SamplingParams:
        """The next request's parameters for ``s``: the response budget left (the open turn's tokens
        counted), a seed of its own (an open turn's continuation: a segment seed of it)."""
        seed = params.seed
        if seed is not None:
            seed = sample_seed(seed, params.prompt_offset + s.index, s.member)
            if s.open_turn is not None:
                seed = segment_seed(seed, s.segments)
        left = params.max_new_tokens - len(s.ids) - len(s.open_ids())
        return dataclasses.replace(params, n=1, max_new_tokens=left, seed=seed, prompt_offset=s.traj.turns)

    def _turn(self, s: _State, c: Completion, params: SamplingParams, eos: tuple[int, ...]) -> None:
        """Record one assistant turn (joined to its aborted start, if any), then the environment's answer
        (or end the trajectory). A turn aborted again stays open (``s.open_turn``)."""
        if s.open_turn is not None:  # the same turn, continued: its tokens so far, then the new ones
            c = merge_segments(dataclasses.replace(s.open_turn, meta={}), c, 0)
        s.open_turn = None
        if c.finish_reason == "abort":
            turn_params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(s.ids))
            settled = settle(c, turn_params, eos)
            if settled is None:
                s.open_turn, s.segments = c, s.segments + 1
                return
            c = settled
        t = s.traj
        start = len(s.ids)
        s.ids += list(c.token_ids)
        s.logprobs += list(c.logprobs)
        s.versions += list(c.token_versions or [c.weight_version] * len(c.token_ids))
        t.response_mask += [1] * len(c.token_ids)
        t.turn_spans.append((start, len(s.ids)))
        text = self.renderer.assistant_text(c.token_ids, c.finish_reason == "stop")
        t.assistant_text = text if start == 0 else f"{t.assistant_text}\n{text}"
        s.messages.append({"role": "assistant", "content": text})
        if c.finish_reason != "stop":
            s.finish, t.truncated = c.finish_reason, "tokens" if c.finish_reason == "length" else ""
            return
        self._answer(s, c, params.max_new_tokens)

    def _answer(self, s: _State, c: Completion, budget: int) -> None:
        """The environment's answer to the assistant turn ``c`` just recorded: its tool turn appended, or
        the trajectory ended (done, a fault under ``fail``, ``max_turns``, no room left)."""
        t = s.traj
        step = self._env_step(s, s.messages[-1]["content"])  # the turn's text as the conversation shows it
        if step is None:
            return
        t.turn_rewards.append(float(step.reward))
        t.tool_calls += step.tool_calls
        t.tool_errors += step.tool_errors
        if step.done:
            s.finish = "stop"
            return
        if t.turns >= self.limits.max_turns:
            s.finish, t.truncated = "length", "turns"
            return
        new = [self._clipped(s, m) for m in step.messages]
        tool_ids = self.renderer.tool_turn_ids(new, c.token_ids, t.turns)
        if len(s.ids) + len(tool_ids) >= budget:  # no room for the tool turn and one more token
            s.finish, t.truncated = "length", "tokens"
            return
        s.messages += new
        s.ids += tool_ids
        s.logprobs += [0.0] * len(tool_ids)
        s.versions += [s.versions[-1] if s.versions else s.weight_version] * len(tool_ids)
        t.response_mask += [0] * len(tool_ids)

    def _env_step(self, s: _State, text: str) -> EnvStep | None:
        """The environment's answer, or a fault handled per ``on_tool_fault`` (None: the trajectory ended)."""
        step, kind, line = guarded_step(s.env, text, self.limits.tool_timeout_s)
        if step is not None:
            return step
        t = s.traj
        t.faults.append(f"turn {t.turns}: {line}")
        t.tool_raised += kind == "raised"
        t.tool_timeouts += kind == "timeout"
        if self.limits.on_tool_fault == "fail":
            t.failed, s.finish = True, "stop"
            t.turn_rewards.append(0.0)
            return None
        if kind == "timeout":  # the hung environment is abandoned; a fresh one answers the next turns
            s.env = self.factory()
            s.env.reset(s.row)
        return EnvStep([{"role": "tool", "content": f"error: {line}"}])

    def _clipped(self, s: _State, message: dict[str, str]) -> dict[str, str]:
        """``message`` with its content cut to ``max_tool_output_tokens`` tokens (counted when cut)."""
        content = str(message.get("content", ""))
        ids = self.renderer.encode(content)
        cap = self.limits.max_tool_output_tokens
        if len(ids) <= cap:
            return {"role": str(message.get("role", "tool")), "content": content}
        s.traj.tool_clipped += 1
        clipped = self.renderer.decode(ids[:cap]) + CLIPPED
        return {"role": str(message.get("role", "tool")), "content": clipped}

    def completion(self, s: _State) -> Completion:
        """The trajectory as a ``Completion`` (its bookkeeping in ``meta["multi_turn"]``). An unfinished
        one (a sync aborted its round) is ``abort``, its open turn's tokens counted as a turn, and carries
        its live state in ``meta[STATE_KEY]`` for ``continue_partial``."""
        traj, ids, logprobs, versions = s.traj, list(s.ids), list(s.logprobs), list(s.versions)
        meta: dict[str, Any] = {"sample_index": s.member}
        if not s.finish:
            meta[STATE_KEY] = s
            if s.open_turn is not None:
                o = s.open_turn
                span = (len(ids), len(ids) + len(o.token_ids))
                traj = dataclasses.replace(
                    traj,
                    response_mask=traj.response_mask + [1] * len(o.token_ids),
                    turn_spans=[*traj.turn_spans, span],
                )
                ids += o.token_ids
                logprobs += o.logprobs
                versions += o.token_versions or [o.weight_version] * len(o.token_ids)
        meta["multi_turn"] = traj.to_meta()
        return Completion(
            prompt_index=s.index,
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=s.finish or "abort",  # type: ignore[arg-type]
            weight_version=s.weight_version,
            # None: every token is weight_version's (no sync inside the trajectory), as SGLang's client
            token_versions=versions if len(set(versions)) > 1 else None,
            meta=meta,
        )


def multi_turn_rollout(cfg: Any, tokenizer: Any) -> MultiTurnRollout | None:
    """The recipe's driver: ``rollout.environment`` resolved and checked (it builds an environment),
    ``rollout.*`` bounds, the chat template with ``data.enable_thinking`` (as the prompts were built);
    None for a single-turn recipe (no ``rollout.environment``)."""
    r = cfg.rollout
    if not r.environment:
        return None
    limits = TurnLimits(r.max_turns, r.tool_timeout_s, r.max_tool_output_tokens, r.on_tool_fault)
    renderer = TurnRenderer(tokenizer, enable_thinking=cfg.data.enable_thinking)
    return MultiTurnRollout(renderer, resolve_environment(r.environment), limits)


def multi_turn_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """The step's ``multiturn/*`` metrics over its multi-turn trajectories ({} when there are none):
    turns, tool calls and errors, faults (raised, timed out), clipped tool outputs, truncations, the
    trajectories a fault failed, the environment's reward parts and the tool tokens' share."""
    trajs = [t for t in map(Trajectory.of, completions) if t is not None]
    if not trajs:
        return {}
    n = len(trajs)
    tokens = sum(len(t.response_mask) for t in trajs)
    return {
        "multiturn/turns_mean": sum(t.turns for t in trajs) / n,
        "multiturn/turns_max": float(max(t.turns for t in trajs)),
        "multiturn/tool_calls": float(sum(t.tool_calls for t in trajs)),
        "multiturn/tool_errors": float(sum(t.tool_errors for t in trajs)),
        "multiturn/tool_raised": float(sum(t.tool_raised for t in trajs)),
        "multiturn/tool_timeouts": float(sum(t.tool_timeouts for t in trajs)),
        "multiturn/tool_clipped": float(sum(t.tool_clipped for t in trajs)),
        "multiturn/truncated_tokens": float(sum(t.truncated == "tokens" for t in trajs)),
        "multiturn/truncated_turns": float(sum(t.truncated == "turns" for t in trajs)),
        "multiturn/failed": float(sum(t.failed for t in trajs)),
        "multiturn/env_reward_mean": sum(sum(t.turn_rewards) for t in trajs) / n,
        "multiturn/tool_token_frac": (tokens - sum(sum(t.response_mask) for t in trajs)) / max(tokens, 1),
    }
