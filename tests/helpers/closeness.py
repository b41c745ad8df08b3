"""How far our numbers are from a reference's, as the parity tests measure it."""

from __future__ import annotations

import numpy as np


def max_relative(ours: np.ndarray, reference: np.ndarray) -> float:
    """The largest difference over the largest reference magnitude."""
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def norm_relative(ours: np.ndarray, reference: np.ndarray) -> float:
    """The difference's norm over the reference's norm."""
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))
