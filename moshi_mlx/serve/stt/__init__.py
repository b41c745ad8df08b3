"""Kyutai's streaming speech-to-text protocol (moshi-server's `/api/asr-streaming`)."""
