"""CUDA graphs of the steps with prefill rows: fresh prompts, chunks over cached context, and mixed steps
(prefill chunks + decode rows), one graph per token bucket.

Why: such a step ran eagerly, ~900 launches for the thinker's 48 layers, and a short prefill's host time was several
times its GPU work (docs/performance.md); the same holds for the talker's prefill. Under a
graph the host cost is one replay, whatever the layer count.

What varies from step to step lives in static device buffers refilled before each replay, so one graph per
bucket of ``T`` token rows serves any mix of sequences up to ``max_seqs``:
- the input embeddings [T, H] and rope positions [3, T] (padding rows: zeros);
- each row's KV slot (padding: -1, no write), the sequences' block tables, and the prefill attention kernel's
  tile list (``kernels.paged_attention.prefill_tile_rows``) padded to its upper bound for ``T`` rows with tiles
  of an empty sequence (``VarlenGraphBatch``): the kernel's grid is fixed at capture.
The graph ends at the final hidden states and the stage's streamed states; the runner picks the rows that sample
and computes their logits as on the eager path (a few launches), so the sampling code is shared.

Padding rows are zero at the input and stay zero through every block (RMSNorm, attention output zeroed, the
MoE's experts of a zero row are zero), so they never produce NaNs that a later kernel could read. Numbers
match the eager fast path up to the kernels' choices that follow the row count (cuBLAS algorithms, the fused
MoE's block config of the bucket instead of the exact count): rounding-level differences, tested.
"""

from __future__ import annotations

import numpy as np
import torch

from omni_triton.engine.block_manager import kv_slots
from omni_triton.engine.stage import Chunk
from omni_triton.graph_buckets import bucket_for, capture_buckets
from omni_triton.kernels.paged_attention import max_prefill_tiles, prefill_tile_rows
from omni_triton.models.layers.attention import VarlenGraphBatch

BUCKET_STEPS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to ``max_tokens`` (the step's token budget): ~1.5x apart, so a step pads at most a third
    of its rows; the budget itself is the last bucket."""
    if max_tokens < 1:
        return []
    return [b for b in BUCKET_STEPS if b < max_tokens] + [max_tokens]


def fill_step(chunks: list[Chunk], block_size: int, slots: np.ndarray, tables: np.ndarray, tiles: np.ndarray,
              seqs: np.ndarray, num_tiles: int) -> int:
    """Writes a step's attention inputs into the host mirrors of the static buffers (numpy views):
    ``slots`` [>= T] (rows past the step: -1), ``tables`` [S+1, max_blocks] (the rows of the step's sequences),
    ``tiles`` [>= num_tiles, 2] (past the step's own: tiles of the empty sequence, index S), ``seqs`` [S+1, 3]
    (entry S: the empty sequence). Returns the step's row count. Pure host code (CPU-tested)."""
    empty = seqs.shape[0] - 1
    row, rows = 0, []
    for i, (seq, start, end) in enumerate(chunks):
        slots[row:row + end - start] = kv_slots(seq.block_table, start, end, block_size)
        tables[i, :len(seq.block_table)] = seq.block_table
        rows.append((i, row, end - start, end))
        row += end - start
    slots[row:] = -1
    step_tiles, step_seqs = prefill_tile_rows(rows)
    if len(step_tiles) > num_tiles:
        raise ValueError(f"{len(step_tiles)} attention tiles for a graph of {num_tiles}")
    seqs[:] = 0
    seqs[:len(step_seqs)] = step_seqs
    tiles[:len(step_tiles)] = step_tiles
    tiles[len(step_tiles):num_tiles] = (empty, 0)
    return row


class PrefillGraphs:
    """One CUDA graph of ``stage.forward`` per token bucket, for steps that are not pure decode (those replay the
    decode graphs). ``pool``: the decode graphs' memory pool (graphs of one runner never run at once)."""

    def __init__(self, runner, max_tokens: int, max_seqs: int, pool=None):
        self.runner = runner
        stage, device = runner.stage, runner.device
        self.buckets = prefill_buckets(max_tokens)
        self.max_seqs = max_seqs
        dtype = runner.model_dtype
        top = self.buckets[-1]
        self.num_tiles = {b: max_prefill_tiles(b, max_seqs) for b in self.buckets}
        self.inputs_embeds = torch.zeros(top, stage.hidden_size, dtype=dtype, device=device)
        # positions (3 rows) | slot, refilled with one copy per step; tables, tiles and sequences likewise
        self.host_ints = torch.zeros(4, top, dtype=torch.int64, pin_memory=True)
        self.ints = torch.zeros(4, top, dtype=torch.int64, device=device)
        self.host_tables = torch.zeros(max_seqs + 1, runner.num_blocks, dtype=torch.int32, pin_memory=True)
        self.block_tables = torch.zeros_like(self.host_tables, device=device)
        self.host_tiles = torch.zeros(self.num_tiles[top], 2, dtype=torch.int32, pin_memory=True)
        self.tiles = torch.zeros_like(self.host_tiles, device=device)
        self.host_seqs = torch.zeros(max_seqs + 1, 3, dtype=torch.int32, pin_memory=True)
        self.seqs = torch.zeros_like(self.host_seqs, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.replays = 0  # steps served by a graph (tests, diagnostics)
        # the pinned host mirrors are rewritten each step: wait until the previous step's copies have read them
        # (a chunk that samples nothing ends the step without a device->host read that would have waited)
        self.copied = torch.cuda.Event()
        self.pool = self._capture_all(pool)

    def serves(self, chunks: list[Chunk]) -> bool:
        return self.serves_step(len(chunks), sum(end - start for _, start, end in chunks))

    def serves_step(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs <= self.max_seqs and bucket_for(self.buckets, num_tokens) is not None

    def _batch(self, bucket: int) -> VarlenGraphBatch:
        return VarlenGraphBatch(self.ints[3, :bucket], self.block_tables, self.tiles[:self.num_tiles[bucket]],
                                self.seqs, self.runner.kv_caches)

    def _body(self, bucket: int):
        return self.runner.stage.forward(self.inputs_embeds[:bucket], self.ints[:3, :bucket], self._batch(bucket))

    def _capture_all(self, pool):
        # capture with every row padding: no KV write, every tile of the empty sequence
        self.ints[3].fill_(-1)
        self.tiles[:, 0].fill_(self.max_seqs)
        return capture_buckets(self.buckets, self._body, self.graphs, self.outputs, pool)

    def forward(self, chunks: list[Chunk], inputs_embeds: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``stage.forward`` of the step by replay: (hidden [T, H], streamed states [T, ...]), copies owned by the
        caller. ``positions`` [3, T] on the host."""
        num_rows = inputs_embeds.shape[0]
        bucket = bucket_for(self.buckets, num_rows)  # serves() checked that one holds them
        self.copied.synchronize()
        host = self.host_ints.numpy()
        host[:3, :num_rows] = positions.numpy()
        host[:3, num_rows:bucket] = 0
        fill_step(chunks, self.runner.block_size, host[3, :bucket], self.host_tables.numpy(), self.host_tiles.numpy(),
                  self.host_seqs.numpy(), self.num_tiles[bucket])
        max_blocks = max(len(seq.block_table) for seq, _, _ in chunks)
        self.ints[:, :bucket].copy_(self.host_ints[:, :bucket], non_blocking=True)
        self.block_tables[:len(chunks), :max_blocks].copy_(self.host_tables[:len(chunks), :max_blocks],
                                                            non_blocking=True)
        self.tiles[:self.num_tiles[bucket]].copy_(self.host_tiles[:self.num_tiles[bucket]], non_blocking=True)
        self.seqs.copy_(self.host_seqs, non_blocking=True)
        self.copied.record()
        self.inputs_embeds[:num_rows].copy_(inputs_embeds)
        self.inputs_embeds[num_rows:bucket].zero_()
        self.graphs[bucket].replay()
        self.replays += 1
        hidden, captured = self.outputs[bucket]
        return hidden[:num_rows].clone(), {name: t[:num_rows].clone() for name, t in captured.items()}
