"""Mimi's split residual vector quantizer: one semantic codebook plus acoustic ones.

Both halves see the same latent, each through its own input projection; their decoded vectors
are summed. Codebooks are plain (num_codebooks, bins, dim) arrays, precomputed at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn


@dataclass(frozen=True)
class QuantizerConfig:
    dimension: int = 256  # codebook vector width
    bins: int = 2048  # entries per codebook
    total_codebooks: int = 32  # in the checkpoint: semantic + acoustic
    semantic_codebooks: int = 1


class ResidualVectorQuantizer(nn.Module):
    """Project, then quantize the residual codebook after codebook (nearest entry, L2)."""

    def __init__(self, latent_dim: int, config: QuantizerConfig, num_codebooks: int):
        super().__init__()
        self.input_proj = nn.Linear(latent_dim, config.dimension, bias=False)
        self.output_proj = nn.Linear(config.dimension, latent_dim, bias=False)
        self.codebooks = mx.zeros((num_codebooks, config.bins, config.dimension))

    @property
    def num_codebooks(self) -> int:
        return self.codebooks.shape[0]

    def search_tables(self) -> tuple[mx.array, mx.array]:
        """Codebooks as (K, dim, bins), contiguous for the distance matmul, and their squared
        norms (K, 1, bins); derived from `codebooks` once per set of weights (lazily: the
        loader evaluates them with the weights)."""
        cached = getattr(self, "_tables", None)
        if cached is None or cached[0] is not self.codebooks:
            columns = mx.contiguous(self.codebooks.transpose(0, 2, 1))
            norms = (self.codebooks * self.codebooks).sum(axis=-1)[:, None, :]
            self._tables = (self.codebooks, columns, norms)
        return self._tables[1], self._tables[2]

    def encode(self, latent: mx.array) -> mx.array:
        """(B, T, latent_dim) -> codes (B, T, num_codebooks) uint32."""
        columns, norms = self.search_tables()
        residual = self.input_proj(latent)
        codes = []
        for k in range(self.num_codebooks):
            # Squared distances to every entry, as in torch.cdist's matmul formulation.
            distances = (
                (residual * residual).sum(axis=-1, keepdims=True)
                - 2 * residual @ columns[k]
                + norms[k]
            )
            index = mx.argmin(distances, axis=-1)
            residual = residual - self.codebooks[k][index]
            codes.append(index)
        return mx.stack(codes, axis=-1)

    def decode(self, codes: mx.array) -> mx.array:
        """codes (B, T, num_codebooks) -> (B, T, latent_dim)."""
        quantized = self.codebooks[0][codes[..., 0]]
        for k in range(1, codes.shape[-1]):
            quantized = quantized + self.codebooks[k][codes[..., k]]
        return self.output_proj(quantized)


class SplitResidualVectorQuantizer(nn.Module):
    """`semantic` quantizes with the first codebook(s), `acoustic` with the next ones."""

    def __init__(self, latent_dim: int, config: QuantizerConfig, num_codebooks: int):
        super().__init__()
        self.num_semantic = config.semantic_codebooks
        self.semantic = ResidualVectorQuantizer(latent_dim, config, config.semantic_codebooks)
        self.num_acoustic = num_codebooks - config.semantic_codebooks
        if self.num_acoustic > 0:
            self.acoustic = ResidualVectorQuantizer(latent_dim, config, self.num_acoustic)

    def search_tables(self) -> list[mx.array]:
        """The derived arrays encoding searches with (see `ResidualVectorQuantizer`)."""
        quantizers = [self.semantic, *([self.acoustic] if self.num_acoustic > 0 else [])]
        return [table for q in quantizers for table in q.search_tables()]

    def encode(self, latent: mx.array) -> mx.array:
        """(B, T, latent_dim) -> codes (B, T, num_codebooks)."""
        codes = self.semantic.encode(latent)
        if self.num_acoustic > 0:
            codes = mx.concatenate([codes, self.acoustic.encode(latent)], axis=-1)
        return codes

    def decode(self, codes: mx.array) -> mx.array:
        """codes (B, T, num_codebooks) -> (B, T, latent_dim)."""
        latent = self.semantic.decode(codes[..., : self.num_semantic])
        if self.num_acoustic > 0:
            latent = latent + self.acoustic.decode(codes[..., self.num_semantic :])
        return latent
