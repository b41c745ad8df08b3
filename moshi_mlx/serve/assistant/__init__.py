"""The assistant's browser page and its websocket (`/assistant/`, `/api/assistant`)."""
