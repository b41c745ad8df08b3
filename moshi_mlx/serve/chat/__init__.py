"""Moshi in a browser: Kyutai's chat protocol over a websocket, and our page."""
