"""Chat formatting of prompt text: what prepare writes and every decoding stage reads as the prompt."""

from __future__ import annotations


def format_prompt(tokenizer, text: str, apply_chat_template: bool = True, enable_thinking: bool = False) -> str:
    """The prompt as the target expects it: one user turn through the chat template, generation prompt on,
    thinking off where the template has that switch (extra template kwargs are ignored by other templates)."""
    if not apply_chat_template or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
