"""OpenAI's HTTP API on the loaded models: `chat` (`/v1/models`, `/v1/chat/completions`) and
`audio` (`/v1/audio/...`); `errors` holds what their routes share (OpenAI's error shape, a
bounded JSON body, the bearer key check)."""
