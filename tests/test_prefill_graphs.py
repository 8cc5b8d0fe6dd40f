"""CUDA graphs of steps with prefill rows (``engine.prefill_graphs``): fresh prompts, chunks over cached context
and mixed steps replay one graph per token bucket instead of ~900 launches.

CPU tests: the token buckets, the tile bound the graph's grid is sized by, and the host fill of the static
buffers (slots, block tables, padded tile list, the empty sequence). GPU tests (skipped without CUDA): on the
tiny checkpoint (fp32), the thinker engine with requests arriving while others decode (first steps prefills,
later ones mixed and chunked, some past the largest bucket and so eager) gives the same greedy tokens and the
same streamed states as the same engine with prefill graphs off, and its steps did replay them; the talker's
greedy frames likewise; after its requests, the engine's KV blocks are all free again.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.engine.prefill_graphs import fill_step, prefill_buckets
from omni_triton.kernels.paged_attention import PREFILL_BLOCK_M, max_prefill_tiles, prefill_tile_rows
from omni_triton.models.weights import load_talker, load_thinker

pytestmark = pytest.mark.engine
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- CPU: pure logic ------------------------------------------------------------------------------------------

def test_buckets_end_at_the_step_budget_and_pad_at_most_a_third_past_32_tokens():
    assert prefill_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_buckets(100) == [16, 32, 64, 96, 100]
    assert prefill_buckets(16) == [16] and prefill_buckets(0) == []
    buckets = prefill_buckets(2048)
    assert all(b / a <= 1.5 for a, b in zip(buckets[2:], buckets[3:]))


def test_tile_bound_holds_for_any_split_of_the_rows():
    rng = random.Random(0)
    for _ in range(500):
        tokens, max_seqs = rng.randint(1, 600), rng.randint(1, 64)
        num_seqs = rng.randint(1, min(max_seqs, tokens))
        cuts = sorted(rng.sample(range(1, tokens), num_seqs - 1)) if num_seqs > 1 else []
        lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
        rows = [(i, sum(lens[:i]), n, n + 5) for i, n in enumerate(lens)]
        tiles, _ = prefill_tile_rows(rows)
        assert len(tiles) <= max_prefill_tiles(tokens, max_seqs)
    # tight: 64 one-row sequences need 64 tiles; one 128-row sequence 2
    assert max_prefill_tiles(64, 64) == 65 and max_prefill_tiles(128, 1) == 3


class FakeSeq:
    def __init__(self, block_table):
        self.block_table = block_table


def test_fill_step_writes_slots_tables_and_pads_the_tiles_with_the_empty_sequence():
    block = 4
    long, decode = FakeSeq([7, 2, 9]), FakeSeq([5, 1])
    chunks = [(long, 2, 11), (decode, 6, 7)]  # a chunk over 2 cached positions, then one decode row
    max_seqs, max_blocks, num_tiles = 3, 6, max_prefill_tiles(16, 3)
    slots = np.full(16, 99, dtype=np.int64)
    tables = np.zeros((max_seqs + 1, max_blocks), dtype=np.int32)
    tiles = np.full((num_tiles + 2, 2), 42, dtype=np.int32)
    seqs = np.full((max_seqs + 1, 3), 42, dtype=np.int32)
    rows = fill_step(chunks, block, slots, tables, tiles, seqs, num_tiles)
    assert rows == 10
    want = [7 * 4 + 2, 7 * 4 + 3] + [2 * 4 + i for i in range(4)] + [9 * 4 + i for i in range(3)] + [1 * 4 + 2]
    assert slots[:10].tolist() == want and (slots[10:] == -1).all()
    assert tables[0, :3].tolist() == [7, 2, 9] and tables[1, :2].tolist() == [5, 1]
    assert seqs.tolist() == [[0, 9, 11], [9, 1, 7], [0, 0, 0], [0, 0, 0]]  # entry max_seqs: the empty sequence
    assert tiles[:2].tolist() == [[0, 0], [1, 0]]
    assert (tiles[2:num_tiles] == [max_seqs, 0]).all()  # padding tiles: no query, no write
    assert (tiles[num_tiles:] == 42).all()  # past this bucket's grid: untouched
    assert PREFILL_BLOCK_M == 64  # the tile count above assumes one tile per sequence under 64 rows


def test_fill_step_refuses_more_tiles_than_the_graph_has():
    seqs = [FakeSeq([i]) for i in range(3)]
    with pytest.raises(ValueError, match="3 attention tiles for a graph of 2"):
        fill_step([(s, 0, 1) for s in seqs], 16, np.zeros(4, np.int64), np.zeros((4, 2), np.int32),
                  np.zeros((2, 2), np.int32), np.zeros((4, 3), np.int32), 2)


# -- on a device ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("tiny"), "tiny")


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
# request 0 alone (a prefill: graph), 1 and 2 arrive while 0 decodes (one mixed step of 23 rows: graph), 3's prompt
# is chunked over steps where the rest decode: with a 40-token budget and graphs up to 32 tokens, its first two
# chunks (37 rows + 3 decode rows) run eagerly, its last (16 + 3) replays a graph: 3 replays
ARRIVALS, PROMPT_LENS, BUDGET, GRAPH_TOKENS = [0, 2, 2, 5], [7, 19, 3, 90], 40, 32


def run_requests(engine: LLMEngine, add) -> dict[str, dict]:
    """Per request: its tokens, its stage extras (talker codes) and its streamed states, rows in order."""
    got: dict[str, dict] = {}
    step = 0
    while step <= max(ARRIVALS) or engine.has_work():
        for i, at in enumerate(ARRIVALS):
            if at == step:
                add(engine, i)
        for out in engine.step() if engine.has_work() else ():
            entry = got.setdefault(out.request_id, {"tokens": [], "codes": [], "states": {}})
            entry["tokens"] += out.new_token_ids
            if "codes" in out.extras:
                entry["codes"].append(out.extras["codes"][0].tolist())
            for name, rows in out.states.items():
                entry["states"].setdefault(name, []).append(rows.float().cpu())
        step += 1
    return got


def engine_for(stage, device, graph_tokens: int) -> LLMEngine:
    return LLMEngine(stage, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=BUDGET,
                                         device=device, kv_dtype=torch.float32, fast_path=True,
                                         prefill_graph_tokens=graph_tokens))


@cuda
def test_thinker_steps_with_prefill_rows_replay_graphs_and_equal_the_eager_steps(tiny_checkpoint):
    model = load_thinker(tiny_checkpoint, "cuda", torch.float32, with_audio=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    def add(engine, i):
        engine.add_request(str(i), GREEDY, prompt_token_ids=prompts[i])

    results, engines = {}, {}
    for graph_tokens in (GRAPH_TOKENS, 0):
        stage = ThinkerStage(model, accept_hidden_layer=1)
        engines[graph_tokens] = engine = engine_for(stage, "cuda", graph_tokens)
        results[graph_tokens] = run_requests(engine, add)
    graphs = engines[GRAPH_TOKENS].runner.prefill_graphs
    assert engines[0].runner.prefill_graphs is None
    assert graphs is not None and graphs.buckets == [16, 32]
    assert graphs.replays >= 3
    got, want = results[GRAPH_TOKENS], results[0]
    assert set(got) == set(want) == {"0", "1", "2", "3"}
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        for name in ("input_embeds", "accept_hidden"):
            a, b = torch.cat(got[rid]["states"][name]), torch.cat(want[rid]["states"][name])
            assert a.shape == b.shape and a.shape[0] == PROMPT_LENS[int(rid)] + GREEDY.max_new_tokens - 1
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = engines[GRAPH_TOKENS].stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


@cuda
def test_talker_frames_with_prefill_graphs_equal_the_eager_prefills(tiny_checkpoint):
    model = load_talker(tiny_checkpoint, "cuda", torch.float32)
    zeros = torch.zeros(model.hidden_size, device="cuda")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randn(n, model.hidden_size, generator=gen).cuda() for n in PROMPT_LENS]

    def add(engine, i):
        engine.add_request(str(i), GREEDY, prompt_embeds=prompts[i], thinker_finished=True)

    results = {}
    for graph_tokens in (GRAPH_TOKENS, 0):
        engine = engine_for(TalkerStage(model, tts_eos_embed=zeros, tts_pad_embed=zeros), "cuda", graph_tokens)
        results[graph_tokens] = run_requests(engine, add)
        assert (engine.runner.prefill_graphs is not None) == (graph_tokens > 0)
        if graph_tokens:
            assert engine.runner.prefill_graphs.replays >= 3
    assert set(results[0]) == set(results[GRAPH_TOKENS]) == {"0", "1", "2", "3"}
    for rid, want in results[0].items():
        assert results[GRAPH_TOKENS][rid]["codes"] == want["codes"], rid
        assert len(want["codes"]) >= GREEDY.max_new_tokens - 1  # every frame but a last one the engine ends on
