"""Single-request generate over our modules with contiguous KV caches: the in-process oracle.

Mirrors ``Qwen3OmniMoeForConditionalGeneration.generate`` (transformers 5.x): thinker until an EOS id or
``thinker_max_new_tokens``; talker from the prefill of ``TalkerInputs`` with codec EOS as stop token, the top
1024 ids except EOS suppressed and HF's repetition penalty (default 1.05, applied to the talker's own
generated ids, before suppression) -- so greedy runs match HF token for token with the same arguments.
Every talker token except the last (EOS, or the one that hit the limit) becomes a frame: it is fed back
through the code predictor, exactly as HF only builds frames for tokens it feeds. The waveform is
Code2Wav over all frames, chunked like HF's ``chunked_decode`` (300 frames, 25 of left context).
Defaults differ from HF's in one place: the talker is greedy unless ``talker.do_sample`` (HF samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_triton.models.config import OmniConfig
from omni_triton.models.layers.attention import AttentionBatch, contiguous_batch
from omni_triton.pipeline.request_params import TALKER_REPETITION_PENALTY
from omni_triton.pipeline.talker_inputs import TalkerInputs


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0


# The code predictor's fixed sampling settings when the talker samples (HF's prepare_inputs_for_generation).
CODE_PREDICTOR_SAMPLING = Sampling(do_sample=True, top_k=50, top_p=0.8)


@dataclass
class ReferenceOutput:
    thinker_ids: list[int]  # generated thinker tokens (the EOS included when emitted)
    talker_ids: list[int] = field(default_factory=list)  # generated first-codebook ids (EOS included)
    codes: torch.Tensor | None = None  # [G, frames]
    waveform: torch.Tensor | None = None  # [samples]


class ContiguousCache:
    """A single sequence's KV cache, grown step by step through AttentionBatch views."""

    def __init__(self, model, capacity: int, dtype: torch.dtype, device: torch.device):
        self._full = contiguous_batch([capacity], model.num_layers, model.num_kv_heads, model.head_dim,
                                      dtype=dtype, device=device)
        self.capacity, self.length = capacity, 0

    def step(self, new_tokens: int) -> AttentionBatch:
        if self.length + new_tokens > self.capacity:
            raise ValueError(f"cache of {self.capacity} tokens cannot take {new_tokens} more after {self.length}")
        slots = torch.arange(self.length, self.length + new_tokens, device=self._full.slot_mapping.device)
        self.length += new_tokens
        full = self._full
        return AttentionBatch([new_tokens], [self.length], slots, full.block_tables, full.kv_caches, full.block_size)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] float32 -> ids [B]: argmax, or temperature -> top-k -> top-p -> multinomial (HF order)."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - sampling.top_p
        drop_sorted[..., -1] = False  # always keep the best token
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: list[int], penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on logits [1, V]: divide positive, multiply negative scores."""
    if penalty == 1.0 or not previous_ids:
        return logits
    ids = torch.tensor([previous_ids], device=logits.device)
    score = logits.gather(1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, ids, score)


@torch.no_grad()
def generate(thinker, talker, config: OmniConfig, prompt_ids: list[int] | torch.Tensor, *,
             speaker: str = "ethan", code2wav=None, return_audio: bool = True,
             thinker_max_new_tokens: int = 64, thinker_eos_token_ids: tuple[int, ...] | None = None,
             thinker_sampling: Sampling = Sampling(),
             talker_max_new_tokens: int = 512, talker_sampling: Sampling = Sampling(),
             talker_repetition_penalty: float = TALKER_REPETITION_PENALTY, seed: int = 0) -> ReferenceOutput:
    prompt_ids = [int(t) for t in prompt_ids]
    device = thinker.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    eos_ids = set(thinker_eos_token_ids if thinker_eos_token_ids is not None else config.thinker_eos_token_ids)

    talker_inputs = None
    if return_audio:
        tts_ids = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
                               device=device)
        talker_inputs = TalkerInputs(talker, config, prompt_ids, speaker, thinker.embed(tts_ids))
    thinker_ids = _run_thinker(thinker, config, prompt_ids, talker_inputs, thinker_max_new_tokens, eos_ids,
                               thinker_sampling, generator)
    out = ReferenceOutput(thinker_ids)
    if talker_inputs is None:
        return out
    if talker_inputs.nothing_to_speak:
        raise ValueError("the thinker stopped before producing a token to speak; the talker needs >= 2 thinker tokens")
    out.talker_ids, out.codes = _run_talker(talker, talker_inputs, talker_max_new_tokens, talker_sampling,
                                            talker_repetition_penalty, generator)
    if code2wav is not None and out.codes.shape[1] > 0:
        out.waveform = chunked_decode(code2wav, out.codes[None])[0]
    return out


def _run_thinker(thinker, config, prompt_ids, talker_inputs, max_new_tokens, eos_ids, sampling, generator):
    accept = config.accept_hidden_layer
    cache = ContiguousCache(thinker, len(prompt_ids) + max_new_tokens, thinker.lm_head.weight.dtype,
                            thinker.lm_head.weight.device)
    ids = torch.tensor(prompt_ids, device=thinker.lm_head.weight.device)
    generated: list[int] = []
    while True:
        embeds = thinker.embed(ids)
        positions = torch.arange(cache.length, cache.length + ids.shape[0], device=ids.device)
        hidden, captured = thinker(embeds, positions, cache.step(ids.shape[0]), capture_layers=(accept,))
        if talker_inputs is not None:
            talker_inputs.feed(ids, embeds, captured[accept])
        token = int(pick(thinker.compute_logits(hidden[-1:]), sampling, generator)[0])
        generated.append(token)
        if token in eos_ids or len(generated) == max_new_tokens:
            break
        ids = torch.tensor([token], device=ids.device)
    if talker_inputs is not None:
        talker_inputs.finish()
    return generated


def _run_talker(talker, talker_inputs: TalkerInputs, max_new_tokens, sampling, repetition_penalty, generator):
    cfg = talker.config
    weight = talker.codec_head.weight
    embeds, positions = talker_inputs.take_prefill()
    prefill_len = embeds.shape[0]
    cache = ContiguousCache(talker, prefill_len + max_new_tokens, weight.dtype, weight.device)
    last = talker(embeds, positions, cache.step(prefill_len))[-1:]
    suppressed = talker.suppressed_token_ids().to(weight.device)
    predictor_sampling = CODE_PREDICTOR_SAMPLING if sampling.do_sample else Sampling()

    def sample_residual(logits, group):
        return pick(logits, predictor_sampling, generator)

    generated: list[int] = []
    frames: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        logits = apply_repetition_penalty(talker.compute_logits(last), generated, repetition_penalty)
        logits[:, suppressed] = float("-inf")
        code0 = pick(logits, sampling, generator)
        generated.append(int(code0[0]))
        if generated[-1] == cfg.codec_eos_token_id or step == max_new_tokens - 1:
            break
        codes, next_embeds = talker.predict_frame(last, code0, sample_residual)
        frames.append(codes[0])
        trailing = talker_inputs.next_trailing()
        position = torch.full((3, 1), prefill_len + step, dtype=torch.long, device=weight.device)
        last = talker(next_embeds + trailing[None], position, cache.step(1))
    codes = (torch.stack(frames, dim=1) if frames
             else torch.empty(cfg.num_code_groups, 0, dtype=torch.long, device=weight.device))
    return generated, codes


def chunked_decode(code2wav, codes: torch.Tensor, chunk_frames: int = 300, left_context: int = 25) -> torch.Tensor:
    """HF's Code2Wav.chunked_decode: chunks of 300 frames, each with up to 25 frames of left context."""
    pieces, start, total = [], 0, codes.shape[-1]
    while start < total:
        end = min(start + chunk_frames, total)
        context = left_context if start - left_context > 0 else start
        wav = code2wav(codes[..., start - context:end])
        pieces.append(wav[..., context * code2wav.samples_per_frame:])
        start = end
    return torch.cat(pieces, dim=-1)
