"""OpenAI's Realtime API on `python -m moshi_mlx serve` (`/v1/realtime`): the websocket, its
framing and limits; the sessions are `moshi_mlx.realtime`'s."""
