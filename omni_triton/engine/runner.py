"""Tensors in, tokens out: builds the flat varlen batch for a scheduled step, runs the stage, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_triton.engine.sampling import sample
from omni_triton.engine.scheduler import ScheduledBatch
from omni_triton.engine.sequence import Sequence
from omni_triton.engine.stage import Chunk, StageModel
from omni_triton.models.layers.attention import AttentionBatch


@dataclass
class StepResult:
    chunks: list[Chunk]
    row_offsets: list[int]  # first row of each chunk in the flat batch
    captured: dict[str, torch.Tensor]  # per-row states the stage streams out
    sampled_seqs: list[Sequence]
    sampled_hidden: torch.Tensor | None  # [N, H] final hidden of the rows that sampled
    sampled_token_ids: torch.Tensor | None  # [N] long, on device


class ModelRunner:
    def __init__(self, stage: StageModel, num_blocks: int, block_size: int, *, device: torch.device | str,
                 kv_dtype: torch.dtype):
        self.stage = stage
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, stage.num_kv_heads, stage.head_dim,
                                      dtype=kv_dtype, device=self.device) for _ in range(stage.num_layers)]

    def attention_batch(self, chunks: list[Chunk]) -> AttentionBatch:
        bs = self.block_size
        slots = []
        for seq, start, end in chunks:
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        max_blocks = max(len(seq.block_table) for seq, _, _ in chunks)
        tables = [seq.block_table + [-1] * (max_blocks - len(seq.block_table)) for seq, _, _ in chunks]
        return AttentionBatch(
            query_lens=[end - start for _, start, end in chunks],
            context_lens=[end for _, _, end in chunks],
            slot_mapping=_to_device(torch.tensor(slots, dtype=torch.long), self.device),
            block_tables=_to_device(torch.tensor(tables, dtype=torch.int32), self.device),
            kv_caches=self.kv_caches,
            block_size=bs,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        chunks = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
                  for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        offsets, row = [], 0
        for _, start, end in chunks:
            offsets.append(row)
            row += end - start
        positions = _to_device(torch.cat([seq.positions(start, end) for seq, start, end in chunks], dim=1),
                               self.device)
        inputs_embeds = self.stage.embed_inputs(chunks)
        hidden, captured = self.stage.forward(inputs_embeds, positions, self.attention_batch(chunks))

        sampling = [(i, seq) for i, (seq, _, end) in enumerate(chunks) if seq.samples_after(end)]
        sampled_seqs = [seq for _, seq in sampling]
        sampled_hidden = sampled_ids = None
        if sampling:
            last_rows = _to_device(torch.tensor([offsets[i] + chunks[i][2] - chunks[i][1] - 1 for i, _ in sampling]),
                                   hidden.device)
            sampled_hidden = hidden[last_rows]
            logits = self.stage.compute_logits(sampled_hidden)
            sampled_ids = sample(logits, [seq.sample_row for seq in sampled_seqs])
        return StepResult(chunks, offsets, captured, sampled_seqs, sampled_hidden, sampled_ids)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
