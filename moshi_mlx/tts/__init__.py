"""Kyutai's streaming text-to-speech."""
