"""Tensors in, tokens out: builds the flat varlen batch for a scheduled step, runs the stage, samples.

The fast path (``fast_path`` on a CUDA device) is a switch around the same modules:
- the layers' Triton kernels (``models.layers.fast_kernels``; off, the plain torch path runs on the GPU too);
- sampling on the GPU (``DeviceSampler``): the step's only device->host copy is the sampled ids;
- decode under CUDA graphs: a step where every row computes one token and samples replays a graph captured for
  the smallest batch bucket that holds it (1, 2, 4, 8, 16, 32, 48, 64, ... max_num_seqs) over static input
  buffers; rows past the batch are padding (no KV write, zero context). A stage whose step completion samples
  (the talker: its code predictor's 15 draws) has sampling and completion inside the graph, so one frame is one
  replay; otherwise (the thinker) the graph ends at the logits and sampling runs after it on the device.
- steps with prefill rows (fresh, chunked, mixed with decode rows) under CUDA graphs too, with the fused steps
  on (``engine.prefill_graphs``: one graph of ``stage.forward`` per token bucket up to ``prefill_graph_tokens``,
  the step's token budget; larger steps run eagerly); their sampled rows' logits and sampling run after the
  replay as on the eager path. For a stage whose completion samples, the completion of those rows
  (``complete_step``: the code predictor's ~1,000 launches) replays a graph of its own (``CompletionGraphs``,
  one per batch bucket, in the decode graphs' pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_triton.graph_buckets import bucket_for, capture_buckets, fill_padded
from omni_triton.engine.block_manager import kv_slots
from omni_triton.engine.decode_inputs import DecodeRows
from omni_triton.engine.handoff import to_device_async
from omni_triton.engine.host_copies import StagingGuard
from omni_triton.engine.prefill_graphs import PrefillGraphs
from omni_triton.engine.sampling import DeviceSampler, TokenHistory, sample
from omni_triton.engine.scheduler import ScheduledBatch
from omni_triton.engine.sequence import Sequence, chunk_positions
from omni_triton.engine.stage import Chunk, StageModel
from omni_triton.models.layers.attention import AttentionBatch, DecodeBatch
from omni_triton.models.layers.fast_kernels import fused_steps_on, set_fast_kernels, set_linear_launch
from omni_triton.models.layers.fp8 import activation_dtype

MAIN_STREAM = ""  # the sampled token of each row; stages may name more streams (talker: "predictor")


@dataclass
class StepResult:
    chunks: list[Chunk]
    row_offsets: list[int]  # first row of each chunk in the flat batch
    captured: dict[str, torch.Tensor]  # per-row states the stage streams out
    sampled_seqs: list[Sequence]
    sampled_hidden: torch.Tensor | None  # [N, H] final hidden of the rows that sampled
    sampled_token_ids: torch.Tensor | None  # [N] long, on device
    completed: dict[str, torch.Tensor] | None = None  # stage.complete_step of every sampled row, when a graph ran it


def graph_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8, 16, 32, 48) if b < max_batch]
    return small + list(range(64, max_batch, 32)) + [max_batch] if max_batch > 48 else small + [max_batch]


class ModelRunner:
    def __init__(self, stage: StageModel, num_blocks: int, block_size: int, *, device: torch.device | str,
                 kv_dtype: torch.dtype, fast_path: bool = False, max_num_seqs: int = 64, cuda_graphs: bool = True,
                 prefill_graph_tokens: int = 0, linear_launch: str = "gemv", dependent_launch: bool = True):
        self.stage = stage
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" is the creating thread's current GPU: named, so the engine's own threads (which start on GPU 0)
            # make that one current too
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, stage.num_kv_heads, stage.head_dim,
                                      dtype=kv_dtype, device=self.device) for _ in range(stage.num_layers)]
        self.fast = fast_path and self.device.type == "cuda"
        model = getattr(stage, "model", None)
        # what the graphs' static hidden-state inputs hold (a stage without a torch model: its KV dtype); FP8
        # weights and their float32 block scales (layers.fp8) are not the activations' dtype
        self.model_dtype = activation_dtype(model) if isinstance(model, torch.nn.Module) else kv_dtype
        if isinstance(model, torch.nn.Module):
            set_fast_kernels(model, self.fast)
            set_linear_launch(model, linear_launch)  # before the graphs capture it
        if self.fast:  # before the graphs capture it (kernels import triton: CUDA only)
            from omni_triton.kernels.dependent_launch import set_dependent_launch

            set_dependent_launch(dependent_launch)
        self.fused_steps = self.fast and (not isinstance(model, torch.nn.Module) or fused_steps_on(model))
        self.streams = {MAIN_STREAM: lambda seq: seq.sample_row, **getattr(stage, "sample_streams", {})}
        self.samplers: dict[str, DeviceSampler] = {}
        self._last_sampler_rows: dict[str, tuple] = {}  # stream -> (seqs, their request ids, their SampleRows)
        if self.fast:
            history = TokenHistory(max_num_seqs, stage.model.vocab_size, self.device)
            self.samplers = {name: DeviceSampler(max_num_seqs, self.device, history if name == MAIN_STREAM else None)
                             for name in self.streams}
        self.graphs = DecodeGraphs(self, max_num_seqs) if self.fast and cuda_graphs else None
        # prefill graphs need the one-launch prefill attention (a fused-steps kernel): with the per-sequence
        # SDPA loop the step's launches depend on its sequences
        self.prefill_graphs = (PrefillGraphs(self, prefill_graph_tokens, max_num_seqs, self.graphs.pool)
                               if self.graphs is not None and self.fused_steps and prefill_graph_tokens > 0 else None)

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or preempted: its device history slot goes."""
        if self.samplers:
            self.samplers[MAIN_STREAM].history.release(seq.request_id)

    def attention_batch(self, chunks: list[Chunk]) -> AttentionBatch:
        bs = self.block_size
        slots = np.concatenate([kv_slots(seq.block_table, start, end, bs) for seq, start, end in chunks])
        max_blocks = max(len(seq.block_table) for seq, _, _ in chunks)
        tables = [seq.block_table + [-1] * (max_blocks - len(seq.block_table)) for seq, _, _ in chunks]
        return AttentionBatch(
            query_lens=[end - start for _, start, end in chunks],
            context_lens=[end for _, _, end in chunks],
            slot_mapping=to_device_async(torch.from_numpy(slots), self.device),
            block_tables=to_device_async(torch.tensor(tables, dtype=torch.int32), self.device),
            kv_caches=self.kv_caches,
            block_size=bs,
            use_kernels=self.fast,
            use_prefill_kernel=self.fused_steps,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        chunks = [(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
                  for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        if self.graphs is not None and self.graphs.serves(chunks):
            return self.graphs.run(chunks)
        offsets, row = [], 0
        for _, start, end in chunks:
            offsets.append(row)
            row += end - start
        positions = chunk_positions(chunks)
        inputs_embeds = self.stage.embed_inputs(chunks)
        if self.prefill_graphs is not None and self.prefill_graphs.serves(chunks):
            hidden, captured = self.prefill_graphs.forward(chunks, inputs_embeds, positions)
        else:
            hidden, captured = self.stage.forward(inputs_embeds, to_device_async(positions, self.device),
                                                  self.attention_batch(chunks))

        sampling = [(i, seq) for i, (seq, _, end) in enumerate(chunks) if seq.samples_after(end)]
        sampled_seqs = [seq for _, seq in sampling]
        sampled_hidden = sampled_ids = None
        if sampling:
            last_rows = to_device_async(
                torch.tensor([offsets[i] + chunks[i][2] - chunks[i][1] - 1 for i, _ in sampling]), hidden.device)
            sampled_hidden = hidden[last_rows]
            sampled_ids = self.sample(sampled_seqs, self.stage.compute_logits(sampled_hidden))
        return StepResult(chunks, offsets, captured, sampled_seqs, sampled_hidden, sampled_ids)

    @torch.inference_mode()
    def run_ahead(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None,
                  inputs_embeds: torch.Tensor | None = None, joined: int = 0) -> StepResult:
        """A decode step of one position per row whose inputs are on the device, made from the step before,
        whose tokens are not appended yet (``overlap.StepOverlap``): its sampled ``token_ids`` (a stage with
        ``embed_token_ids``) or ``inputs_embeds`` (``stage.inputs_ahead``). Samples as ``run`` would once they
        were: draws and bans one token ahead; but for the last ``joined`` rows, which were not in the step before
        (their tokens are appended: ``inputs_embeds`` holds their inputs as ``stage.embed_inputs`` makes them)."""
        seqs = [seq for seq, _, _ in chunks]
        tokens_ahead = 1 if not joined else [1] * (len(chunks) - joined) + [0] * joined
        if self.graphs is not None and self.graphs.serves_rows(len(chunks)):
            return self.graphs.run(chunks, token_ids=token_ids, inputs_embeds=inputs_embeds,
                                   tokens_ahead=tokens_ahead)
        # eagerly (the CPU, or no decode graphs): as the graph does, a stage whose completion samples (the talker)
        # completes every row here too, its frame's draws one token further on (the step's own main token)
        positions = chunk_positions(chunks)
        inputs = self.stage.embed_token_ids(token_ids) if token_ids is not None else inputs_embeds
        hidden, captured = self.stage.forward(inputs, to_device_async(positions, self.device),
                                              self.attention_batch(chunks))
        ids = self.sample(seqs, self.stage.compute_logits(hidden), tokens_ahead=tokens_ahead)
        completed = (self.complete_step(seqs, hidden, ids, tokens_ahead=_plus(tokens_ahead, 1))
                     if len(self.streams) > 1 else None)
        return StepResult(chunks, list(range(len(chunks))), captured, seqs, hidden, ids, completed)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, tokens_ahead: int | list[int] = 0) -> torch.Tensor:
        if not self.samplers:  # the host sampler reads the rows' own history: callers ahead check it is exact
            return sample(logits, [seq.sample_row for seq in seqs])
        self.prepare_sampler(MAIN_STREAM, seqs, tokens_ahead)
        return self.samplers[MAIN_STREAM].sample(logits)

    def prepare_sampler(self, stream: str, seqs: list[Sequence], tokens_ahead: int | list[int] = 0,
                        generated: list[int] | None = None) -> None:
        """Each row's draw index is its generated-token count (``tokens_ahead`` more when tokens sampled before
        are not appended yet: the step's own inside a graph, the previous step's when overlapped), so the same
        frame draws the same uniforms on every path. The main stream's min_new_tokens ban counts them too (the
        other streams' rows sample within a frame: their token count is the frame's). ``tokens_ahead``: one count
        for every row, or a row's each (rows that joined a step launched ahead have none). ``generated``: the
        rows' generated-token counts when the caller has them (one pass over the rows for every stream)."""
        if generated is None:
            generated = generated_counts(seqs)
        keys, rows = self._sampler_rows(stream, seqs)
        if isinstance(tokens_ahead, list):
            draws = [count + ahead for count, ahead in zip(generated, tokens_ahead)]
        else:
            draws = [count + tokens_ahead for count in generated] if tokens_ahead else generated
        self.samplers[stream].prepare(keys, rows, draws, tokens_ahead if stream == MAIN_STREAM else 0)

    def _sampler_rows(self, stream: str, seqs: list[Sequence]) -> tuple[list[str], list]:
        """The rows' request ids and their ``SampleRow`` of ``stream``: the lists of the last call when the rows
        are the same sequences (a steady decode batch), so the sampler's same-rows check is one comparison."""
        last = self._last_sampler_rows.get(stream)
        if last is None or last[0] != seqs:  # (Sequence has no __eq__: an identity comparison per row, in C)
            last = self._last_sampler_rows[stream] = (list(seqs), [seq.request_id for seq in seqs],
                                                      [self.streams[stream](seq) for seq in seqs])
        return last[1], last[2]

    @torch.inference_mode()
    def complete_step(self, seqs: list[Sequence], hidden: torch.Tensor, token_ids: torch.Tensor,
                      tokens_ahead: int | list[int] = 0) -> dict[str, torch.Tensor]:
        """The stage's work after sampling (talker: the rest of the codec frame), for rows that go on.
        ``tokens_ahead``: the rows' tokens sampled but not appended yet (0: ``token_ids`` are appended already;
        1: completed before they are, ``overlap.StepOverlap``; 2: an eager ``run_ahead``'s, whose previous step's
        tokens are not appended either), on either path below."""
        extra = [name for name in self.streams if name != MAIN_STREAM]
        if self.samplers:
            for name in extra:
                self.prepare_sampler(name, seqs, tokens_ahead)
            completion = self.graphs.completion if self.graphs is not None else None
            if completion is not None and completion.serves(hidden, token_ids):
                return completion.run(hidden, token_ids)
            sample_fns = {name: self.samplers[name].sample for name in extra}
        else:
            sample_fns = {name: _host_sample_fn([self.streams[name](seq) for seq in seqs]) for name in extra}
        return self.stage.complete_step(hidden, token_ids, sample_fns)


def _plus(tokens_ahead: int | list[int], more: int) -> int | list[int]:
    """``more`` tokens ahead more, for every row."""
    return tokens_ahead + more if isinstance(tokens_ahead, int) else [ahead + more for ahead in tokens_ahead]


def generated_counts(seqs: list[Sequence]) -> list[int]:
    """The rows' generated-token counts (the sampler's draw indices before any tokens ahead)."""
    return [len(seq.output_token_ids) for seq in seqs]


def _host_sample_fn(rows):
    return lambda logits, group: sample(logits, rows)


class DecodeGraphs:
    """CUDA graphs of the decode step, one per batch bucket, sharing one memory pool and one set of static
    inputs (the first rows of each buffer are a bucket's batch)."""

    def __init__(self, runner: ModelRunner, max_batch: int):
        self.runner = runner
        stage, device = runner.stage, runner.device
        self.buckets = graph_buckets(max_batch)
        self.in_graph_sampling = len(runner.streams) > 1  # the completion samples: it must run in the graph
        max_blocks = runner.num_blocks
        dtype = runner.kv_caches[0].dtype
        self.inputs_embeds = torch.zeros(max_batch, stage.hidden_size, dtype=dtype, device=device)
        # a stage whose decode inputs are token embeddings (the thinker) embeds them inside the graph
        self.token_inputs = getattr(stage, "embed_token_ids", None) is not None
        # positions (3 rows) | slot | context length | token id, and the block tables: staged on the host
        # (decode_inputs.DecodeRows), one copy each per step
        self.rows = DecodeRows(max_batch, max_blocks, runner.block_size, pinned=device.type == "cuda")
        self.ints = torch.zeros(6, max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self._staging = StagingGuard(device)  # the staged rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.pool = None
        self._capture_all()
        # steps that run eagerly still complete their sampled rows under a graph (after these: same pool)
        self.completion = CompletionGraphs(runner, self.buckets, self.pool) if self.in_graph_sampling else None

    def serves(self, chunks: list[Chunk]) -> bool:
        return (self.serves_rows(len(chunks))
                and all(end - start == 1 and seq.samples_after(end) for seq, start, end in chunks)
                and (not self.token_inputs or self.runner.stage.decode_token_ids(chunks) is not None))

    def serves_rows(self, num_rows: int) -> bool:
        return num_rows <= self.buckets[-1]

    def _body(self, batch_size: int) -> dict[str, torch.Tensor]:
        runner = self.runner
        ints = self.ints[:, :batch_size]
        positions, slots, context_lens = ints[:3], ints[3], ints[4]
        batch = DecodeBatch(slots, self.block_tables[:batch_size], context_lens, runner.kv_caches)
        inputs = (runner.stage.embed_token_ids(ints[5]) if self.token_inputs else self.inputs_embeds[:batch_size])
        hidden, captured = runner.stage.forward(inputs, positions, batch)
        logits = runner.stage.compute_logits(hidden)
        outputs = {"hidden": hidden, "logits": logits, **{"captured." + k: v for k, v in captured.items()}}
        if self.in_graph_sampling:
            ids = runner.samplers[MAIN_STREAM].sample(logits, general=True)
            sample_fns = _general_sample_fns(runner)
            outputs["token_ids"] = ids
            outputs.update({"completed." + k: v for k, v in
                            runner.stage.complete_step(hidden, ids, sample_fns).items()})
        return outputs

    def _capture_all(self) -> None:
        self.ints[3].fill_(-1)  # every row padding while capturing: no KV write, no context
        self.ints[4].fill_(0)
        self.pool = capture_buckets(self.buckets, self._body, self.graphs, self.outputs, pool=None)

    def run(self, chunks: list[Chunk], token_ids: torch.Tensor | None = None,
            inputs_embeds: torch.Tensor | None = None, tokens_ahead: int | list[int] = 0) -> StepResult:
        """One decode step by replay. The rows' inputs on the device instead of the sequences' (made by a step
        whose tokens are not appended yet: ``tokens_ahead`` of them, ``ModelRunner.run_ahead``): ``token_ids``
        (a token-input stage) or ``inputs_embeds``."""
        runner, num_rows = self.runner, len(chunks)
        batch_size = bucket_for(self.buckets, num_rows)  # serves() checked that one holds them
        seqs = [seq for seq, _, _ in chunks]
        if not self.token_inputs:
            self.inputs_embeds[:num_rows].copy_(inputs_embeds if inputs_embeds is not None
                                                else runner.stage.embed_inputs(chunks))
        self._staging.before_write()
        # (given ids are copied on the device below)
        tables = self.rows.fill(chunks, runner.stage.decode_token_ids(chunks)
                                if self.token_inputs and token_ids is None else None)
        self.ints.copy_(self.rows.ints, non_blocking=True)
        self.block_tables[:num_rows, :tables.shape[1]].copy_(tables, non_blocking=True)
        self._staging.copies_queued()
        if token_ids is not None:
            self.ints[5, :num_rows].copy_(token_ids)
        # every sampler's controls are queued before the replay (also those sampling after it): then an
        # overlapped step's rewrite of them waits for no more than the copies (host_copies.StagingGuard)
        generated = generated_counts(seqs)
        for name in runner.samplers:
            runner.prepare_sampler(name, seqs, _plus(tokens_ahead, name != MAIN_STREAM and self.in_graph_sampling),
                                   generated)
        self.graphs[batch_size].replay()
        outputs = self.outputs[batch_size]
        hidden = outputs["hidden"][:num_rows].clone()  # copies: the next replay overwrites the graph's outputs
        # (the per-position states of decode rows past the prompt are copied only for a stage that streams them)
        captured = (_rows(outputs, "captured.", num_rows)
                    if self.rows.prompt_rows or getattr(runner.stage, "states_past_prompt", True) else {})
        if self.in_graph_sampling:
            ids, completed = outputs["token_ids"][:num_rows].clone(), _rows(outputs, "completed.", num_rows)
        else:
            ids, completed = runner.samplers[MAIN_STREAM].sample(outputs["logits"][:num_rows]), None
        return StepResult(chunks, list(range(num_rows)), captured, seqs, hidden, ids, completed)


class CompletionGraphs:
    """CUDA graphs of ``stage.complete_step`` alone, one per batch bucket, for a stage whose completion samples
    (the talker: the code predictor's 15 draws, ~1,000 launches eagerly). Steps that are not pure decode
    (prefill, chunked prefill, mixed) run eagerly, then ``ModelRunner.complete_step`` completes their sampled
    rows with one replay here.

    Static inputs: hidden [max_batch, H] (model dtype) and token ids [max_batch] (long). Padding rows are zero
    hidden and id 0; every row of the completion is independent (the code predictor's per-frame KV cache is
    built fresh inside the graph, one slice per row; it writes no engine KV; its sampler has no token history
    and leaves padding rows greedy), so they never touch the real rows. The samplers are the ones the decode
    graph samples with, called the same way (``_general_sample_fns``): the caller ``prepare``s them as for the
    eager completion, so both draw the same per-row uniforms. Captured after the decode graphs in their memory
    pool: outputs are cloned right after each replay, since any later replay may overwrite them."""

    def __init__(self, runner: ModelRunner, buckets: list[int], pool):
        self.runner = runner
        self.buckets = list(buckets)
        stage, device = runner.stage, runner.device
        self.dtype = runner.model_dtype
        self.hidden = torch.zeros(self.buckets[-1], stage.hidden_size, dtype=self.dtype, device=device)
        self.token_ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.replays = 0  # completions served by a graph (tests, diagnostics)
        self._capture_all(pool)

    def _body(self, batch_size: int) -> dict[str, torch.Tensor]:
        return self.runner.stage.complete_step(self.hidden[:batch_size], self.token_ids[:batch_size],
                                               _general_sample_fns(self.runner))

    def _capture_all(self, pool) -> None:
        capture_buckets(self.buckets, self._body, self.graphs, self.outputs, pool)

    def serves(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> bool:
        return (bucket_for(self.buckets, hidden.shape[0]) is not None and token_ids.shape == hidden.shape[:1]
                and hidden.dtype == self.dtype and hidden.device == self.hidden.device
                and hidden.shape[1:] == self.hidden.shape[1:])

    def run(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``stage.complete_step(hidden, token_ids, ...)`` by replay; the samplers are prepared by the caller."""
        num_rows = hidden.shape[0]
        batch_size = bucket_for(self.buckets, num_rows)
        fill_padded(self.hidden, hidden, batch_size)
        fill_padded(self.token_ids, token_ids, batch_size)
        self.graphs[batch_size].replay()
        self.replays += 1
        return _rows(self.outputs[batch_size], "", num_rows)


def _rows(outputs: dict[str, torch.Tensor], prefix: str, num_rows: int) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: t[:num_rows].clone() for name, t in outputs.items() if name.startswith(prefix)}


def _general(sampler: DeviceSampler):
    return lambda logits, group: sampler.sample(logits, group, general=True)


def _general_sample_fns(runner: ModelRunner) -> dict:
    """The extra streams' sample functions inside a graph (decode and completion graphs alike)."""
    return {name: _general(sampler) for name, sampler in runner.samplers.items() if name != MAIN_STREAM}
