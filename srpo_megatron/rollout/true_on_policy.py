"""True on-policy log-probs for the CPU engine: the trainer's arithmetic on the engine's tokens.

``rollout.true_on_policy_mode`` (named after slime's ``--true-on-policy-mode``, which aligns SGLang's and
FSDP's kernels bit for bit): the engine still samples from its decode loop, unchanged, but the log-prob
it reports for each sampled token comes from a teacher-forced forward laid out as the trainer's scoring
pass lays out a rollout batch, scored by the trainer's own kernel:

- every ``prompt + response`` of the call right-padded to one width, the longest rounded up to a multiple
  of 8 (``trainer/microbatches/batches.padded_len``), no KV cache, no left padding. The width matters:
  torch's CPU flash attention reduces each query row's keys in vector lanes plus a scalar tail, and which
  keys fall in the tail depends on the padded width (measured on the tiny model: the same row's hidden
  state moves by ~5e-7 between an unpadded and a padded forward). The rows per forward do not matter.
- the last hidden states of the response rows, all rows of the call in one
  ``ops.fused_output.OutputShard`` over the output weight padded to the trainer's vocabulary
  (``padded_vocab_size(V, 1)``, padded ids masked as the trainer masks them: a softmax over 151669 or
  151680 columns sums in a different order, ~1e-6), scored by ``ops.vocab_parallel.token_stats`` at the
  sampling temperature.

HF's teacher-forced forward and megatron's local-spec forward are bitwise equal at TP1 on the same padded
ids, so in fp32 the reported log-probs equal the trainer's ``π_old`` exactly (``logprob/gap_max`` 0.0)
when the trainer scores the call's samples in right-padded micro-batches (``train.max_tokens_per_micro_batch``
0) at TP1, one generate call per step: a non-zero gap then means different weights (a stale or partial
sync). Multi-turn rollouts rescore their finished trajectories in one call (``HFEngine.rescore``), which
is the trainer's layout again. Other layouts (packed micro-batches, TP > 1, several calls per step) give
a float-level gap, not 0.
"""

from __future__ import annotations

import math

import torch

from srpo_megatron.models.architecture import padded_vocab_size
from srpo_megatron.ops.fused_output import OutputShard
from srpo_megatron.ops.vocab_parallel import token_stats

WIDTH_MULTIPLE = 8  # the trainer's right-padded micro-batch width multiple (batches.padded_len)


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    rows_per_forward: int = 64,
) -> list[list[float]]:
    """Per response, the fp32 log-prob of each of its tokens after its prompt at ``temperature``, computed
    as the module doc says; ``rows_per_forward`` bounds the sequences of one forward (memory only)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    if not any(responses):
        return [[] for _ in responses]
    device = next(model.parameters()).device
    width = math.ceil(max(len(s) for s in seqs) / WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    decoder = model.get_decoder()
    hidden, ids = [], []
    for a in range(0, len(seqs), rows_per_forward):
        group = seqs[a : a + rows_per_forward]
        batch = torch.zeros(len(group), width, dtype=torch.long, device=device)
        for r, seq in enumerate(group):
            batch[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        states = decoder(input_ids=batch, use_cache=False).last_hidden_state  # [b, width, H]
        for r, seq in enumerate(group):
            start = len(prompts[a + r])
            hidden.append(states[r, start - 1 : len(seq) - 1])
            ids.append(batch[r, start : len(seq)])
    flat_ids = torch.cat(ids)
    shard = _output_shard(model, torch.cat(hidden))
    flat = token_stats(shard, flat_ids[:, None], temperature=temperature).logp[:, 0].float().tolist()
    out, at = [], 0
    for response in responses:
        out.append(flat[at : at + len(response)])
        at += len(response)
    return out


def _output_shard(model: torch.nn.Module, hidden: torch.Tensor) -> OutputShard:
    """``hidden @ W.T`` unapplied, W the output weight padded with zero rows to the trainer's TP1 vocabulary
    and the padded ids masked (the trainer's ``Policy.vocab_pad``)."""
    weight = model.get_output_embeddings().weight
    vocab = int(weight.shape[0])
    padded = padded_vocab_size(vocab, 1)
    if padded == vocab:
        return OutputShard(hidden, weight)
    weight = torch.cat([weight, weight.new_zeros(padded - vocab, weight.shape[1])])
    return OutputShard(hidden, weight, torch.arange(padded, device=weight.device) >= vocab)


__all__ = ["trainer_logprobs"]
