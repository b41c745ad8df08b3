"""The token ring every step shares: a (B, K, width) int32 buffer of the tokens each stream
is fed, written ahead by each stream's delay and read one column per step."""

from __future__ import annotations

from moshi_mlx.models.lm import LmConfig

UNGENERATED = -2  # a token slot not written yet


def token_ring_width(cfg: LmConfig) -> int:
    """Columns of a generator's token ring: from the oldest column a step reads (its output,
    `max_delay` back) to the furthest it writes (a user frame, lag and delay ahead)."""
    return cfg.max_delay + 2 + cfg.user_input_lag
