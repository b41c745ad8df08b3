"""Kyutai's streaming text-to-speech: text schedule, device step, voices, API and command."""
