"""Streaming parts every product shares: sampling, the token ring, the codec, the tokenizer and
the memory plan."""
