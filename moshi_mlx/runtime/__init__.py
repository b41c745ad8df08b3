"""Streaming parts every product shares: sampling, the delayed tokens, the step state that goes in
and out of every compiled step, the per-model cache of what steppers compile, the codec, the
tokenizer and the memory plan."""
