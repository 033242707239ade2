"""Turn a row into prompt token ids through the tokenizer's own chat template.

Messages are ``[system?, user]``; the template is applied with the generation prompt and
``enable_thinking`` (Qwen3 reads it and, when False, opens the reply with an empty think block; templates
that do not know the flag ignore it). Rows without a system message (tool use) get none from us — a
template may still add its default one (SmolLM2 does).

Over-long prompts are truncated inside the user message, never through the template's markup, so the
result is still a well-formed chat prompt; ``side="left"`` keeps the end of the message (where the
question and the answer format usually are).
"""

from __future__ import annotations

from typing import Any, Literal

from srpo_megatron.data.rows import Row


def chat_messages(user: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    return messages


def template_text(tokenizer: Any, user: str, system: str | None, enable_thinking: bool = False) -> str:
    """The chat-templated prompt text, ending with the assistant turn's opening."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; set tokenizer.chat_template "
            "(the paper's models are chat models: Qwen3, Llama/SmolLM2 instruct)"
        )
    return tokenizer.apply_chat_template(
        chat_messages(user, system),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    # The template already carries BOS/markup tokens; adding specials again would double them.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(
    tokenizer: Any,
    row: Row,
    *,
    max_tokens: int | None = None,
    side: Literal["left", "right"] = "left",
    enable_thinking: bool = False,
) -> tuple[list[int], bool]:
    """Prompt ids of ``row`` and whether the user message had to be truncated to fit ``max_tokens``.

    Returns ids longer than ``max_tokens`` only if even an empty user message does not fit (the caller
    then drops the row).
    """
    ids = encode_text(tokenizer, template_text(tokenizer, row.prompt, row.system, enable_thinking))
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, False
    user_ids = encode_text(tokenizer, row.prompt)
    excess = len(ids) - max_tokens
    # Re-tokenising at the cut can merge or split a token, so shave a little more until it fits.
    for extra in (0, 1, 2, 4, 8, 16, 32):
        keep = len(user_ids) - excess - extra
        if keep <= 0:
            break
        kept = user_ids[-keep:] if side == "left" else user_ids[:keep]
        user = tokenizer.decode(kept, skip_special_tokens=False)
        ids = encode_text(tokenizer, template_text(tokenizer, user, row.system, enable_thinking))
        if len(ids) <= max_tokens:
            return ids, True
    return ids, True
