"""Random weights of the reference fixture scripts' PyTorch models (run in their venvs)."""

from __future__ import annotations

import torch


def round_to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (seeded, float32) with its layer-scale `alpha`s drawn near 1 and every value a
    bf16 value, so the committed bf16 files lose nothing; in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".alpha"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model.eval()
