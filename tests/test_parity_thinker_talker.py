"""Parity of our thinker / talker / code predictor / reference generate against transformers (fp32, CPU).

Both tiny presets (16 code groups / 4 thinker layers, and 8 code groups / 3 thinker layers with the
talker reading the *last* thinker layer) are built once per module by the checkpoint builder.
"""

from __future__ import annotations

import pytest
import torch

from omni_triton.checkpoints.tiny import build
from omni_triton.models.config import OmniConfig
from omni_triton.models.layers.attention import AttentionBatch, contiguous_batch
from omni_triton.models.weights import load_talker, load_thinker
from omni_triton.pipeline.reference import Sampling, generate
from omni_triton.pipeline.talker_inputs import TalkerInputs

pytestmark = pytest.mark.parity

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
PROMPT = ("<|im_start|>system\nYou are a helpful voice.<|im_end|>\n"
          "<|im_start|>user\nHello, how are you today?<|im_end|>\n<|im_start|>assistant\n")
THINKER_MAX_NEW_TOKENS = 12
TALKER_MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["tiny", "tiny-8g"])
def stack(request, tmp_path_factory):
    """Our modules and transformers' model over one freshly built checkpoint."""
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    checkpoint = build(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return dict(
        checkpoint=checkpoint, hf=hf, config=OmniConfig.from_pretrained(checkpoint),
        thinker=load_thinker(checkpoint, with_audio=False), talker=load_talker(checkpoint),
        prompt_ids=tokenizer.encode(PROMPT).ids,
    )


@pytest.fixture(scope="module")
def hf_run(stack):
    """One greedy HF generate(return_audio=True), recording the talker's inputs and the codes it decodes."""
    hf, config = stack["hf"], stack["config"]
    seen = {}
    talker_generate, chunked_decode = hf.talker.generate, hf.code2wav.chunked_decode

    def record_talker(**kwargs):
        seen["talker_kwargs"] = kwargs
        return talker_generate(**kwargs)

    def record_codes(codes, **kwargs):
        seen["codes"] = codes
        return chunked_decode(codes, **kwargs)

    hf.talker.generate, hf.code2wav.chunked_decode = record_talker, record_codes
    try:
        with torch.no_grad():
            sequences, waveform = hf.generate(
                torch.tensor([stack["prompt_ids"]]), speaker="ethan", return_audio=True,
                thinker_max_new_tokens=THINKER_MAX_NEW_TOKENS, thinker_do_sample=False,
                thinker_eos_token_id=list(config.thinker_eos_token_ids),
                talker_max_new_tokens=TALKER_MAX_NEW_TOKENS, talker_do_sample=False)
    finally:
        del hf.talker.generate, hf.code2wav.chunked_decode
    seen["thinker_ids"] = sequences[0, len(stack["prompt_ids"]):].tolist()
    seen["waveform"] = waveform.reshape(-1)
    return seen


def _thinker_rows(stack, token_ids):
    """Our thinker over prompt + fed tokens in one pass: (ids, input embeds, accept-layer hidden)."""
    thinker, accept = stack["thinker"], stack["config"].accept_hidden_layer
    ids = torch.tensor(token_ids)
    embeds = thinker.embed(ids)
    batch = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                             dtype=torch.float32)
    _, captured = thinker(embeds, torch.arange(len(ids)), batch, capture_layers=(accept,))
    return ids, embeds, captured[accept]


@torch.no_grad()
def test_thinker_logits_and_every_hidden_state(stack):
    thinker = stack["thinker"]
    ids = torch.tensor(stack["prompt_ids"])
    expected = stack["hf"].thinker(input_ids=ids[None], output_hidden_states=True)
    batch = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                             dtype=torch.float32)
    layers = range(thinker.num_layers + 1)
    final, captured = thinker(thinker.embed(ids), torch.arange(len(ids))[None].expand(3, -1), batch,
                              capture_layers=layers)
    assert (thinker.compute_logits(final) - expected.logits[0]).abs().max() <= TOLERANCE
    for k in layers:
        assert (captured[k] - expected.hidden_states[k][0]).abs().max() <= TOLERANCE, f"hidden_states[{k}]"


@torch.no_grad()
def test_batched_varlen_and_chunked_prefill_match_single_sequences(stack):
    thinker = stack["thinker"]
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 500, (n,), generator=generator) for n in (7, 19)]

    def alone(ids):
        batch = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                                 dtype=torch.float32)
        return thinker.compute_logits(thinker(thinker.embed(ids), torch.arange(len(ids)), batch)[0])

    singles = [alone(ids) for ids in seqs]
    flat = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(ids)) for ids in seqs])
    batch = contiguous_batch([len(ids) for ids in seqs], thinker.num_layers, thinker.num_kv_heads,
                             thinker.head_dim, dtype=torch.float32)
    both = thinker.compute_logits(thinker(thinker.embed(flat), positions, batch)[0])
    assert (both[:7] - singles[0]).abs().max() <= 1e-5
    assert (both[7:] - singles[1]).abs().max() <= 1e-5

    # The long sequence again, as a 12-token prefill chunk then 7 more tokens on top of its cache.
    ids = seqs[1]
    full = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                            dtype=torch.float32)
    outputs = []
    for start, end in ((0, 12), (12, 19)):
        step = AttentionBatch([end - start], [end], torch.arange(start, end), full.block_tables, full.kv_caches,
                              full.block_size)
        outputs.append(thinker.compute_logits(thinker(thinker.embed(ids[start:end]), torch.arange(start, end),
                                                      step)[0]))
    assert (torch.cat(outputs) - singles[1]).abs().max() <= 1e-5


@torch.no_grad()
def test_talker_prefill_and_trailing_text_match_hf(stack, hf_run):
    config, talker = stack["config"], stack["talker"]
    fed = stack["prompt_ids"] + hf_run["thinker_ids"][:-1]  # the last sampled token is never fed back
    ids, embeds, hidden = _thinker_rows(stack, fed)
    tts = stack["thinker"].embed(torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id,
                                               config.tts_pad_token_id]))
    inputs = TalkerInputs(talker, config, stack["prompt_ids"], "ethan", tts)
    for start in range(0, len(fed), 5):  # arbitrary chunking, as the served pipeline feeds it
        inputs.feed(ids[start:start + 5], embeds[start:start + 5], hidden[start:start + 5])
    inputs.finish()
    prefill, positions = inputs.take_prefill()
    expected = hf_run["talker_kwargs"]
    assert prefill.shape == expected["inputs_embeds"][0].shape
    assert (prefill - expected["inputs_embeds"][0]).abs().max() <= TOLERANCE
    assert torch.equal(positions, torch.arange(prefill.shape[0])[None].expand(3, -1))
    trailing = expected["trailing_text_hidden"][0]
    ours = torch.stack([inputs.next_trailing() for _ in range(trailing.shape[0] + 2)])
    assert (ours[:len(trailing)] - trailing).abs().max() <= TOLERANCE
    assert (ours[len(trailing):] - expected["tts_pad_embed"].reshape(1, -1)).abs().max() <= TOLERANCE


@torch.no_grad()
def test_talker_logits_on_built_prefill(stack, hf_run):
    talker = stack["talker"]
    prefill = hf_run["talker_kwargs"]["inputs_embeds"][0]
    expected = stack["hf"].talker(inputs_embeds=prefill[None]).logits[0]
    batch = contiguous_batch([prefill.shape[0]], talker.num_layers, talker.num_kv_heads, talker.head_dim,
                             dtype=torch.float32)
    logits = talker.compute_logits(talker(prefill, torch.arange(prefill.shape[0]), batch))
    assert (logits - expected).abs().max() <= TOLERANCE


@torch.no_grad()
def test_code_predictor_greedy_codes_and_frame_embedding(stack):
    hf_talker, talker = stack["hf"].talker, stack["talker"]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, talker.hidden_size, generator=generator)
    code0 = torch.randint(0, stack["config"].talker.code_predictor.vocab_size, (3,), generator=generator)
    codes, next_embeds = talker.predict_frame(hidden, code0)

    code0_embeds = hf_talker.get_input_embeddings()(code0)
    result = hf_talker.code_predictor.generate(
        inputs_embeds=torch.stack((hidden, code0_embeds), dim=1), max_new_tokens=talker.num_code_groups - 1,
        do_sample=False, return_dict_in_generate=True)
    assert torch.equal(codes[:, 1:], result.sequences)
    assert torch.equal(codes[:, 0], code0)
    embeddings = hf_talker.code_predictor.get_input_embeddings()
    expected = code0_embeds + sum(embeddings[g](result.sequences[:, g]) for g in range(talker.num_code_groups - 1))
    assert (next_embeds - expected).abs().max() <= TOLERANCE


@torch.no_grad()
def test_full_greedy_run_matches_hf_generate(stack, hf_run):
    config = stack["config"]
    assert len(hf_run["thinker_ids"]) >= 2, "tiny checkpoint degenerate: thinker stops at once"
    try:
        from omni_triton.models.weights import load_code2wav

        code2wav = load_code2wav(stack["checkpoint"])
    except ImportError as error:  # the audio helper's module may not exist yet
        code2wav, missing = None, str(error)
    out = generate(stack["thinker"], stack["talker"], config, stack["prompt_ids"], speaker="ethan",
                   code2wav=code2wav, thinker_max_new_tokens=THINKER_MAX_NEW_TOKENS,
                   thinker_eos_token_ids=config.thinker_eos_token_ids, talker_max_new_tokens=TALKER_MAX_NEW_TOKENS,
                   talker_repetition_penalty=1.05)  # HF's default, applied the same way
    assert out.thinker_ids == hf_run["thinker_ids"]
    assert torch.equal(out.codes, hf_run["codes"][0])
    assert out.codes.shape[0] == config.num_code_groups
    if code2wav is None:
        pytest.skip(f"waveform parity not checked: Code2Wav unavailable ({missing})")
    assert out.waveform.shape == hf_run["waveform"].shape
    assert (out.waveform - hf_run["waveform"]).abs().max() <= TOLERANCE


@torch.no_grad()
def test_multimodal_user_rows_use_hidden_projection_like_hf(stack):
    """Audio placeholder rows of user turns go through hidden_projection (HF's _get_talker_user_parts)."""
    config, talker, hf = stack["config"], stack["talker"], stack["hf"]
    audio = config.thinker.audio_token_id
    prompt = stack["prompt_ids"]
    user_at = prompt.index(config.user_token_id)
    prompt = prompt[:user_at + 2] + [config.thinker.audio_start_token_id, audio, audio, audio] + prompt[user_at + 2:]
    fed = prompt + [7]
    generator = torch.Generator().manual_seed(2)
    embeds = torch.randn(len(fed), config.talker.thinker_hidden_size, generator=generator)
    hidden = torch.randn(len(fed), config.talker.thinker_hidden_size, generator=generator)
    tts = torch.randn(3, config.talker.thinker_hidden_size, generator=generator)
    inputs = TalkerInputs(talker, config, prompt, "chelsie", tts)
    inputs.feed(torch.tensor(fed), embeds, hidden)
    prefill, _ = inputs.take_prefill()

    ids = torch.tensor([prompt])
    multimodal = ids == audio
    all_rows = hf._get_talker_user_parts(0, len(prompt), multimodal, hidden[None, :len(prompt)],
                                         embeds[None, :len(prompt)])[0]
    user = torch.zeros(len(prompt), dtype=torch.bool)
    system_end = prompt.index(config.im_start_token_id, 1)
    user[system_end:prompt.index(config.im_start_token_id, system_end + 1)] = True
    assert prefill.shape[0] == int(user.sum()) + 9
    assert (prefill[:int(user.sum())] - all_rows[user]).abs().max() <= TOLERANCE


@torch.no_grad()
def test_talker_inputs_wait_for_thinker_rows(stack):
    config, talker = stack["config"], stack["talker"]
    prompt = stack["prompt_ids"]
    ids, embeds, hidden = _thinker_rows(stack, prompt + [11, 12, 13])
    inputs = TalkerInputs(talker, config, prompt, "aiden", embeds[:3])
    inputs.feed(ids[:len(prompt)], embeds[:len(prompt)], hidden[:len(prompt)])
    assert not inputs.prefill_ready  # the first generated token has not been fed back yet
    inputs.feed(ids[len(prompt):len(prompt) + 1], embeds[len(prompt):len(prompt) + 1])
    assert inputs.prefill_ready and inputs.next_trailing() is None  # token 2 not yet fed
    inputs.feed(ids[len(prompt) + 1:], embeds[len(prompt) + 1:])
    first, second = inputs.next_trailing(), inputs.next_trailing()
    close = dict(atol=1e-6, rtol=0)  # projected in a different batch shape
    assert torch.allclose(first, talker.project_text(embeds[len(prompt) + 1:len(prompt) + 2])[0], **close)
    assert second is not None and inputs.next_trailing() is None
    inputs.finish()
    eos, pad = inputs.next_trailing(), inputs.next_trailing()
    tts_eos, tts_pad = talker.project_text(embeds[1:3])
    assert torch.allclose(eos, tts_eos, **close) and torch.allclose(pad, tts_pad, **close)


@torch.no_grad()
def test_talker_inputs_take_the_rows_projection_from_the_caller(stack):
    """The served talker projects a running request's appended rows on Triton's thread (``projected_text``): the
    inputs then hold the very rows their own projection gives, and the prefill is untouched."""
    config, talker = stack["config"], stack["talker"]
    prompt = stack["prompt_ids"]
    ids, embeds, hidden = _thinker_rows(stack, prompt + [11, 12, 13, 14, 15])
    p = len(prompt)
    own, given = (TalkerInputs(talker, config, prompt, "aiden", embeds[:3]) for _ in range(2))
    for inputs in (own, given):
        inputs.feed(ids[:p + 1], embeds[:p + 1], hidden[:p + 1])
    for start in (p + 1, p + 3):
        rows = slice(start, start + 2)
        own.feed(ids[rows], embeds[rows])
        given.feed(ids[rows], embeds[rows], projected_text=talker.project_text(embeds[rows]))
    assert torch.equal(own.take_prefill()[0], given.take_prefill()[0])
    for _ in range(4):
        assert torch.equal(own.next_trailing(), given.next_trailing())
    assert own.next_trailing() is None and given.next_trailing() is None


@torch.no_grad()
def test_seeded_sampling_is_reproducible(stack):
    config = stack["config"]
    kwargs = dict(thinker_max_new_tokens=6, thinker_eos_token_ids=(), talker_max_new_tokens=4,
                  thinker_sampling=Sampling(do_sample=True, temperature=0.9, top_k=50, top_p=0.95),
                  talker_sampling=Sampling(do_sample=True, temperature=0.9, top_k=50))
    runs = [generate(stack["thinker"], stack["talker"], config, stack["prompt_ids"], seed=seed, **kwargs)
            for seed in (3, 3, 4)]
    assert runs[0].thinker_ids == runs[1].thinker_ids and torch.equal(runs[0].codes, runs[1].codes)
    assert (runs[0].thinker_ids, runs[0].codes.tolist()) != (runs[2].thinker_ids, runs[2].codes.tolist())


@torch.no_grad()
def test_interleaved_mrope_tables_match_hf_for_distinct_thw_positions(stack):
    """Text/audio positions have t == h == w; check the interleaving itself with distinct rows."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    hf_rotary = Qwen3OmniMoeThinkerTextRotaryEmbedding(stack["hf"].config.thinker_config.text_config)
    positions = torch.stack([torch.arange(10), torch.arange(10) % 3 + 100, torch.arange(10) * 7 + 1000])
    expected_cos, expected_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    cos, sin = stack["thinker"].model.rotary.cos_sin(positions, torch.float32)
    assert torch.allclose(cos, expected_cos[0], atol=1e-6, rtol=0)
    assert torch.allclose(sin, expected_sin[0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_greedy_run_stopping_on_thinker_eos_matches_hf(stack, hf_run):
    """Declare a token the thinker emits mid-way as EOS, so both sides stop on it (not on the length cap)."""
    ids = hf_run["thinker_ids"]
    stop_at = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), None)
    if stop_at is None:
        pytest.skip(f"no fresh thinker token to use as EOS in {ids}")
    eos = (ids[stop_at],)
    codes = {}
    chunked_decode = stack["hf"].code2wav.chunked_decode

    def record_codes(hf_codes, **kwargs):
        codes["hf"] = hf_codes
        return chunked_decode(hf_codes, **kwargs)

    stack["hf"].code2wav.chunked_decode = record_codes
    try:
        sequences, _ = stack["hf"].generate(
            torch.tensor([stack["prompt_ids"]]), speaker="aiden", return_audio=True,
            thinker_max_new_tokens=THINKER_MAX_NEW_TOKENS, thinker_do_sample=False, thinker_eos_token_id=list(eos),
            talker_max_new_tokens=TALKER_MAX_NEW_TOKENS, talker_do_sample=False)
    finally:
        del stack["hf"].code2wav.chunked_decode
    out = generate(stack["thinker"], stack["talker"], stack["config"], stack["prompt_ids"], speaker="aiden",
                   thinker_max_new_tokens=THINKER_MAX_NEW_TOKENS, thinker_eos_token_ids=eos,
                   talker_max_new_tokens=TALKER_MAX_NEW_TOKENS)
    assert out.thinker_ids == ids[:stop_at + 1] == sequences[0, len(stack["prompt_ids"]):].tolist()
    assert torch.equal(out.codes, codes["hf"][0])
