"""Kyutai's streaming text-to-speech websocket (moshi-server's `/api/tts_streaming`)."""
