"""A characters-as-ids tokenizer: enough of a HF tokenizer for routing and teacher prompts in unit tests."""

from __future__ import annotations


class CharTokenizer:
    """Characters as token ids; enough of a HF tokenizer for routing and teacher prompts."""

    chat_template = "plain"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids)
