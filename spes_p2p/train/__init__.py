"""Data, tokenizer, the local trainer (trainable subset, 8-bit optimizer, schedule), checkpoints, memory.

No networking lives here.
"""
