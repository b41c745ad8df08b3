"""Moshi's depth transformer: samples one step's audio codebooks, one slice per codebook.

Slice k has its own weights (input projection, token embedding, transformer layers, output
head). It reads the temporal transformer's output plus the embedding of the previous token
(the text token for slice 0, codebook k-1 otherwise). All slices of one step attend to each
other through one small KV cache per layer, emptied at the start of every step.

With a weights-per-step schedule (the TTS: 32 slices over 11 sets of weights), slice k takes
its input projection and transformer layers from set `schedule[k]`: the slices of one set
share those modules (one copy in memory; each slice's name still lists them, as in Kyutai's
MLX files). Embeddings may be low-rank, and slice 0's text embedding two-stream
(`moshi_mlx.modules.embeddings`). Hibiki-Zero's slices norm their output (a LayerNorm each)
before their head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx import nn

from moshi_mlx.modules.embeddings import make_embedding
from moshi_mlx.modules.linear import Linear, StackedLinears
from moshi_mlx.modules.step_kv import StepKV
from moshi_mlx.modules.step_tricks import StepWeight, lookup_column, picked_rows, split_last
from moshi_mlx.modules.transformer import Transformer, TransformerConfig

if TYPE_CHECKING:
    from moshi_mlx.models.config import LmConfig

ZERO_TOKEN = -1  # "no input": embeds to a zero vector

# (logits (B, card), slice index) -> tokens (B, 1), a column (`sampling.sample_column`)
SampleFn = Callable[[mx.array, int], mx.array]


def zero_no_input(tokens: mx.array, embeddings: mx.array) -> mx.array:
    """Zero the embeddings (..., D) of the `ZERO_TOKEN` positions of tokens (...)."""
    return mx.where((tokens == ZERO_TOKEN)[..., None], 0, embeddings)


def embed(emb: nn.Module | mx.array, tokens: mx.array) -> mx.array:
    """Embedding lookup where `ZERO_TOKEN` gives a zero vector; tokens (...) -> (..., D).
    `emb`: a table module, or its rows as vectors (`DepformerSlice.step_table`)."""
    clamped = mx.maximum(tokens, 0)
    return zero_no_input(tokens, emb[clamped] if isinstance(emb, mx.array) else emb(clamped))


class DepformerSlice(nn.Module):
    def __init__(
        self,
        emb: nn.Module,
        lm_dim: int,
        card: int,
        config: TransformerConfig,
        norm: bool = False,
        dequantize_table: bool = False,
    ):
        super().__init__()
        self.emb = emb
        # Whether a step reads a quantized plain `emb` dequantized (`transpose_weight`).
        self.dequantize_table = dequantize_table
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.step_table: StepWeight | None = None
        self.linear_in = Linear(lm_dim, config.d_model, bias=False)
        self.transformer = Transformer(config)
        if norm:  # `depformer_norm` "layer_norm", as Kyutai's reference makes it
            self.norm = nn.LayerNorm(config.d_model, eps=1e-5)
        self.linear_out = Linear(config.d_model, card, bias=False)

    def transpose_weight(self) -> mx.array | None:
        """`transpose_weights`' hook: with `dequantize_table`, a quantized plain table (an
        `nn.QuantizedEmbedding`: Moshi's audio codebooks, 4 MB each in bf16 at 7B) is
        dequantized once for the step (`step_table`, the values its lookups give), so a
        lookup is one gather, not three and a dequantization; the table, for the caller to
        evaluate (None: other tables)."""
        if not self.dequantize_table or not isinstance(self.emb, nn.QuantizedEmbedding):
            return None
        self.step_table = StepWeight.kept(
            self.step_table, self.emb.weight, lambda _: picked_rows(self.emb, lambda part: part)
        )
        return self.step_table.view

    def _head(self, x: mx.array) -> mx.array:
        """The logits of the transformer's output x (..., d_model)."""
        return self.linear_out(self.norm(x) if "norm" in self else x)

    def step(
        self,
        temporal_out: mx.array,
        prev_token: mx.array,
        ring: StepKV,
        sampled: bool = False,
        projected: mx.array | None = None,
    ) -> mx.array:
        """This slice's logits, in `mx.compile`-able form: temporal_out (B, lm_dim),
        prev_token (B,) or a column (B, 1) -> logits (B, card), through the step's `StepKV`.
        `sampled`: the previous token was sampled, so never `ZERO_TOKEN` (its embedding needs
        no test; a sampled column is looked up as one, `lookup_column`). `projected`: the
        input projection of temporal_out, computed by the caller (the depformer's one product
        for every slice, `Depformer.stacked_inputs`)."""
        table = StepWeight.current(self.step_table, self.emb.get("weight"))
        emb = self.emb if table is None else table
        if prev_token.ndim == 2:
            if sampled:
                token = lookup_column(emb, prev_token)
            else:
                token = embed(emb, prev_token[:, 0])
        else:
            token = embed(emb, prev_token) if not sampled else self.emb(prev_token)
        if projected is None:
            projected = self.linear_in(temporal_out)
        x = projected + token
        return self._head(self.transformer(x, ring.layers()))


class Depformer(nn.Module):
    """The depformer's first `num_slices` slices (default: Moshi's codebooks, the ones sampled;
    PersonaPlex's `dep_q` also counts slices for the user's codebooks, never sampled)."""

    def __init__(self, config: LmConfig, num_slices: int | None = None):
        super().__init__()
        tcfg = config.depformer_config()
        rank = config.depformer_low_rank_embeddings
        self.slices = [
            DepformerSlice(
                make_embedding(config.text_card + 1, tcfg.d_model, rank, config.demux_second_stream)
                if k == 0
                else make_embedding(config.card + 1, tcfg.d_model, rank),
                config.dim,
                config.card,
                tcfg,
                config.depformer_norm is not None,
                dequantize_table=k > 0,  # the audio tables, not the text's (32k rows)
            )
            for k in range(config.moshi_codebooks if num_slices is None else num_slices)
        ]
        self.sampled_slices = config.moshi_codebooks
        self.share_scheduled_weights(config.depformer_weights_per_step_schedule)
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.stacked_inputs: StackedLinears | None = None

    def input_linears(self) -> list[nn.Module]:
        """The sampled slices' input projections, each once (slices of one weight set share
        theirs), in the slices' order."""
        linears = {id(s.linear_in): s.linear_in for s in self.slices[: self.sampled_slices]}
        return list(linears.values())

    def transpose_weight(self) -> list[mx.array]:
        """`transpose_weights`' hook for the depformer itself: stack the sampled slices' input
        projections (`stacked_inputs`, `StackedLinears`: a step projects the temporal output
        for every slice in one product) unless they still are; the stack's arrays, for the
        caller to evaluate (none: projections that do not stack, computed one by one)."""
        linears = self.input_linears()
        if self.stacked_inputs is None or not self.stacked_inputs.holds(linears):
            self.stacked_inputs = StackedLinears.of(linears)
        return [] if self.stacked_inputs is None else self.stacked_inputs.arrays

    def _projections(self, temporal_out: mx.array, sampled: int) -> dict[int, mx.array]:
        """The input projection of temporal_out per slice's projection (by its id) from the
        one product of `stacked_inputs` while it holds them, every sampled slice runs and
        the product is the projections' own (one row, `StackedLinears.exact_for`); else none
        (each slice projects its own)."""
        linears, stacked = self.input_linears(), self.stacked_inputs
        if stacked is None or sampled != self.sampled_slices or not stacked.holds(linears):
            return {}
        if not stacked.exact_for(temporal_out):
            return {}
        return {id(linear): out for linear, out in zip(linears, stacked(temporal_out))}

    def share_scheduled_weights(self, schedule: tuple[int, ...] | None) -> None:
        """Make each slice use the input projection and transformer of the first slice of its
        weight set (`schedule[k]`); again after quantizing, which copies shared modules."""
        if schedule is None:
            return
        first = {}
        for k, depformer_slice in enumerate(self.slices):
            leader = self.slices[first.setdefault(schedule[k], k)]
            depformer_slice.linear_in = leader.linear_in
            depformer_slice.transformer = leader.transformer

    def sample_step(
        self,
        temporal_out: mx.array,
        text_token: mx.array,
        sample_fn: SampleFn,
        given: tuple[mx.array, mx.array] | None = None,
        codebooks: int | None = None,
        text_sampled: bool = False,
        with_text: bool = False,
    ) -> mx.array:
        """Sample one step's codebooks, in `mx.compile`-able form: temporal_out (B, lm_dim),
        text_token (B,) or a column (B, 1) -> (B, codebooks) (default: moshi_codebooks; fewer:
        the later slices do not run), int32; `with_text`: (B, 1 + codebooks), the text token's
        column first (a column `text_token` only). Each token feeds the next slice in one
        graph; the slices share a `StepKV` made for the step (slice k at position k). `given`,
        tokens and a mask (B, slices), forces codebooks (a prompt's): a given token is
        returned, and fed to the next slice, in place of the sampled one. `text_sampled`: the
        text token was sampled, so never `ZERO_TOKEN` (slice 0's embedding of it needs no
        test either)."""
        ring = StepKV(len(self.slices[0].transformer.layers), temporal_out.dtype)
        prev = text_token
        # (B, 1) each: concatenated and cast once, not stacked
        columns = [text_token] if with_text else []
        sampled = self.sampled_slices if codebooks is None else codebooks
        projections = self._projections(temporal_out, sampled)
        if given is not None:  # each slice's given tokens and mask columns, split once
            parts = [part if part.shape[1] == sampled else part[:, :sampled] for part in given]
            starts = list(range(1, sampled))
            given_columns = list(zip(*(split_last(part, starts) for part in parts)))
        for k, depformer_slice in enumerate(self.slices[:sampled]):
            # Else a text token not sampled, or a given token: maybe -1.
            prev_sampled = (k > 0 or text_sampled) and given is None
            projected = projections.get(id(depformer_slice.linear_in))
            logits = depformer_slice.step(temporal_out, prev, ring, prev_sampled, projected)
            prev = sample_fn(logits, k)
            if given is not None:
                tokens, mask = given_columns[k]
                prev = mx.where(mask, tokens, prev)
            columns.append(prev)
            ring = ring.advanced()
        return mx.concatenate(columns, axis=1).astype(mx.int32)
