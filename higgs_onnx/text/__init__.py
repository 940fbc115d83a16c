"""The text path before the tokenizer: what a person or a chat app wrote, made into what the model reads.

Every step is off by default (the reference, sglang-omni, sends the text to the tokenizer unchanged); docs/text.md
says what each does and its limits.
"""
