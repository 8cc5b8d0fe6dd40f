"""The engine step's cheaper host paths give what the plain ones give: ``EmbedRows`` reads as the list of row
views it replaces, ``Sequence.append_token`` as ``append_output`` then ``check_stop``, ``draw_seeds_into`` as
``draw_seed`` row by row, and the talker's ``after_sample`` pushes ``inputs_ahead``'s inputs again only when
they are the same sums (the same codec embeds, rows and texts), else its own."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_toy_model import ToyTalker
from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage
from omni_triton.engine.embed_rows import EmbedRows
from omni_triton.engine.sampling import draw_seed, draw_seed_bases, draw_seeds_into
from omni_triton.engine.sequence import Sequence, chunk_positions


def test_embed_rows_read_as_the_row_views_they_stand_for():
    prompt, batch = torch.randn(3, 5), torch.randn(4, 5)
    rows = EmbedRows(prompt.unbind(0))
    expected = list(prompt.unbind(0))
    for i in (2, 0, 3):
        rows.append_row_of(batch, i)
        expected.append(batch.unbind(0)[i])
    rows.append(batch[1] * 2)
    expected.append(batch[1] * 2)
    assert len(rows) == len(expected) == 7
    for key in (0, 3, 5, -1, -2):
        got, want = rows[key], expected[key]
        assert torch.equal(got, want)
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    assert rows[4] is rows[4]  # a row read once stays the same view
    for key in (slice(None), slice(2, 5), slice(-3, None), slice(5, 2)):
        got = rows[key]
        assert isinstance(got, list) and len(got) == len(expected[key])
        assert all(torch.equal(a, b) for a, b in zip(got, expected[key]))
    assert all(torch.equal(a, b) for a, b in zip(rows, expected))
    assert torch.equal(torch.stack(rows[:]), torch.stack(expected))
    batch[2] += 1  # a reference, as a view is: later writes to the batch show
    assert torch.equal(rows[3], batch[2])


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=5, stop_token_ids=(3,)),
    SamplingParams(max_new_tokens=6, stop_token_ids=(3, 4), min_new_tokens=3),
    SamplingParams(max_new_tokens=4, stop_token_ids=(3,), ignore_eos=True),
    SamplingParams(max_new_tokens=1),
])
def test_append_token_is_append_output_then_check_stop(params):
    rng = random.Random(7)
    for _ in range(20):
        plain = Sequence("a", params, num_prompt_positions=2, prompt_token_ids=[1, 2])
        fused = Sequence("b", params, num_prompt_positions=2, prompt_token_ids=[1, 2])
        for _ in range(params.max_new_tokens):
            token = rng.choice((3, 4, 5, 6))
            plain.append_output(token)
            want = plain.check_stop(token)
            assert fused.append_token(token) == want
            assert fused.output_token_ids == plain.output_token_ids
            assert fused.sample_row.seen_ids == plain.sample_row.seen_ids
            assert fused.sample_row.num_generated == plain.sample_row.num_generated
            if want is not None:
                break


def test_draw_seeds_into_a_control_column_is_draw_seed_per_row():
    rng = random.Random(3)
    seeds = [rng.getrandbits(62) for _ in range(40)] + [(1 << 64) - 1, 0]
    draws = [rng.randrange(10**6) for _ in seeds]
    controls = np.full((4, 50), 17, dtype=np.int64)  # a sampler's [4, max_rows] column block
    bases = draw_seed_bases(np.array(seeds, dtype=np.uint64))
    draw_seeds_into(bases, np.asarray(draws, dtype=np.uint64), controls[1, :len(seeds)])
    assert controls[1, :len(seeds)].tolist() == [draw_seed(s, d) for s, d in zip(seeds, draws)]
    assert (controls[1, len(seeds):] == 17).all() and (controls[[0, 2, 3]] == 17).all()  # nothing else written


def _talker_engine(reuse: bool):
    talker = ToyTalker().eval()
    hidden = talker.hidden_size
    stage = TalkerStage(talker, tts_eos_embed=torch.full((hidden,), 0.5), tts_pad_embed=torch.full((hidden,), -0.25))
    engine = LLMEngine(stage, EngineConfig(block_size=4, num_blocks=256))
    assert engine.overlap is not None
    if not reuse:  # after_sample never finds inputs_ahead's: it adds its own
        inputs_ahead = stage.inputs_ahead

        def forgotten(seqs, completed):
            inputs = inputs_ahead(seqs, completed)
            stage._inputs_ahead = None
            return inputs

        stage.inputs_ahead = forgotten
    return engine, stage


def _run_talker(reuse: bool):
    """Three requests, one waiting for its text for a while and one stopping early, to the end: the codes out
    and every request's pushed inputs."""
    engine, stage = _talker_engine(reuse)
    gen = torch.Generator().manual_seed(0)
    hidden = stage.hidden_size
    texts = torch.randn(6, hidden, generator=gen)
    prompts = [torch.randn(n, hidden, generator=gen) for n in (7, 5, 6)]
    engine.add_request("a", SamplingParams(temperature=0.0, max_new_tokens=14), prompt_embeds=prompts[0],
                       trailing_text_embeds=texts[:2])
    engine.add_request("b", SamplingParams(temperature=1.0, seed=5, max_new_tokens=16), prompt_embeds=prompts[1],
                       thinker_finished=True)
    engine.add_request("c", SamplingParams(temperature=1.0, seed=9, max_new_tokens=6), prompt_embeds=prompts[2],
                       thinker_finished=True)
    seqs = {rid: engine.requests[rid] for rid in "abc"}
    pushes = {"reused": 0, "made": 0}
    after_sample = stage.after_sample

    def counted(seqs_, completed):
        ahead = stage._inputs_ahead
        extras = after_sample(seqs_, completed)
        last = seqs_[0].stage_state.input_embeds[-1]
        pushes["reused" if ahead is not None and last.data_ptr() == ahead[3].data_ptr() else "made"] += 1
        return extras

    stage.after_sample = counted
    codes = {rid: [] for rid in "abc"}
    for call in range(80):
        if call == 8:
            engine.append("a", trailing_text_embeds=texts[2:], finished=True)
        if not engine.has_work() and call > 8:
            break
        for out in engine.step():
            if "codes" in out.extras:
                codes[out.request_id].append(out.extras["codes"].clone())
    inputs = {rid: torch.stack(seq.stage_state.input_embeds[:]) for rid, seq in seqs.items()}
    return codes, inputs, pushes


def test_talker_pushes_the_inputs_it_would_make_whether_or_not_it_takes_inputs_ahead_again():
    reused_codes, reused_inputs, reused = _run_talker(reuse=True)
    made_codes, made_inputs, made = _run_talker(reuse=False)
    for rid in "abc":
        assert len(reused_codes[rid]) == len(made_codes[rid]) > 0
        assert all(torch.equal(a, b) for a, b in zip(reused_codes[rid], made_codes[rid]))
        assert torch.equal(reused_inputs[rid], made_inputs[rid])
    assert reused["reused"] > 5 and made["reused"] == 0  # (both paths ran)
    assert reused["reused"] + reused["made"] == made["made"]


def test_talker_takes_inputs_ahead_again_only_for_the_same_rows_and_texts():
    engine, stage = _talker_engine(reuse=True)
    hidden = stage.hidden_size
    gen = torch.Generator().manual_seed(1)
    for rid in "ab":
        engine.add_request(rid, SamplingParams(temperature=0.0, max_new_tokens=30),
                           prompt_embeds=torch.randn(5, hidden, generator=gen), thinker_finished=True)
    for _ in range(4):
        engine.step()
    seqs = [engine.requests[rid] for rid in "ab"]
    codec = torch.randn(2, hidden, generator=gen)
    completed = {"next_embeds": codec, "codes": torch.zeros(2, 4, dtype=torch.long)}

    def pushed_after(ahead_seqs, ahead_codec, texts_changed=False):
        """The rows after_sample pushes after an inputs_ahead over ahead_seqs / ahead_codec."""
        counts = [len(seq.stage_state.input_embeds) for seq in seqs]
        ahead = stage.inputs_ahead(ahead_seqs, {"next_embeds": ahead_codec})
        if texts_changed:  # the texts inputs_ahead saw are not the ones taken now (other objects, same values)
            stage._inputs_ahead = (*stage._inputs_ahead[:2], [t.clone() for t in stage._inputs_ahead[2]],
                                   stage._inputs_ahead[3])
        stage.after_sample(seqs, completed)
        rows = [seq.stage_state.input_embeds[n] for seq, n in zip(seqs, counts)]
        return ahead, rows

    pad = torch.full((2, hidden), -0.25)  # every row's text now (tts_eos taken at its first frame)
    ahead, rows = pushed_after(seqs, codec)
    assert all(row.data_ptr() == ahead[i].data_ptr() for i, row in enumerate(rows))  # taken again
    for ahead_seqs, ahead_codec, changed in ((seqs[::-1], codec, False), (seqs, codec.clone(), False),
                                             (seqs, codec, True)):
        ahead, rows = pushed_after(ahead_seqs, ahead_codec, changed)
        assert all(row.data_ptr() != ahead[i].data_ptr() for i, row in enumerate(rows))  # made again
        assert torch.equal(torch.stack(rows), codec + pad)
    assert stage._inputs_ahead is None  # taken by after_sample either way


def test_chunk_positions_are_each_chunks_positions_concatenated():
    rng = random.Random(3)
    params = SamplingParams()
    for _ in range(30):
        chunks = []
        for index in range(rng.randint(1, 8)):
            prompt = rng.randint(1, 12)
            explicit = None
            if rng.random() < 0.4:  # an M-RoPE prompt: explicit positions, the rest after their max
                explicit = torch.randint(0, 40, (3, prompt))
            seq = Sequence(f"r{index}", params, num_prompt_positions=prompt, prompt_positions=explicit)
            start = rng.randint(0, prompt + 4)
            chunks.append((seq, start, start + rng.randint(0, 6)))
        expected = torch.cat([seq.positions(start, end) for seq, start, end in chunks], dim=1)
        got = chunk_positions(chunks)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_history_slot_takes_its_banned_row_from_a_shared_one_and_a_freed_slot_starts_clean():
    from omni_triton.engine.sampling import SampleRow, TokenHistory

    history = TokenHistory(2, 16, torch.device("cpu"))
    plain = SamplingParams(stop_token_ids=(3,), suppressed_token_ids=(7, 9))
    other = SamplingParams(stop_token_ids=(4,))

    def expected(params):
        row = torch.zeros(16, dtype=torch.int8)
        row[list(params.stop_token_ids)] = TokenHistory.UNDER_MIN
        row[list(params.suppressed_token_ids)] = TokenHistory.ALWAYS
        return row

    a = history.slot("a", SampleRow(plain, None, seen_ids={1, 5}))
    b = history.slot("b", SampleRow(plain, None))
    assert torch.equal(history.banned[a], expected(plain)) and torch.equal(history.banned[b], expected(plain))
    assert history.seen[a].nonzero().flatten().tolist() == [1, 5] and not history.seen[b].any()
    history.banned[a, 0] = 2  # a slot's row is its own: the shared one is not written through it
    history.release("a")
    c = history.slot("c", SampleRow(other, None))
    assert c == a and torch.equal(history.banned[c], expected(other)) and not history.seen[c].any()
    history.release("b")
    d = history.slot("d", SampleRow(plain, None))
    assert torch.equal(history.banned[d], expected(plain))
