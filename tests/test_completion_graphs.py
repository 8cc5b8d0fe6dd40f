"""CUDA graphs of the step completion alone (``runner.CompletionGraphs``): the talker's code predictor after a
step that ran eagerly (prefill, chunked prefill, mixed) replays a graph instead of ~1,000 launches.

CPU tests: the bucket choice and the padded static inputs. GPU tests (skipped without CUDA): on the tiny
checkpoint (fp32), ``runner.complete_step`` through the graph equals the eager completion (graph path
disabled) code for code, greedy, sampled and mixed, for 1 and 3 rows (3: one padding row); the talker engine
with requests arriving while others decode (first steps are prefills, later ones mixed and chunked) gives the
eager GPU path's greedy frames, and sampled frames equal to the fast path with the completion graphs off.
"""

from __future__ import annotations

import pytest
import torch

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage
from omni_triton.engine.runner import graph_buckets
from omni_triton.graph_buckets import bucket_for, fill_padded
from omni_triton.models.weights import load_talker

pytestmark = pytest.mark.engine
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NUM_SEQS = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed, max_new_tokens=24, ignore_eos=True)


# -- CPU: pure logic ------------------------------------------------------------------------------------------

def test_bucket_for_picks_the_smallest_bucket_that_holds_the_rows():
    buckets = graph_buckets(100)
    assert buckets == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 48, 49, 65, 97, 100)] == [1, 2, 4, 8, 48, 64, 96, 100, 100]
    assert bucket_for(buckets, 0) is None and bucket_for(buckets, 101) is None
    assert bucket_for(graph_buckets(1), 1) == 1 and bucket_for(graph_buckets(1), 2) is None


def test_fill_padded_writes_the_rows_and_zeroes_the_padding_up_to_the_bucket_only():
    static = torch.full((8, 3), 7.0)
    values = torch.arange(9, dtype=torch.float32).view(3, 3)
    fill_padded(static, values, 4)
    assert torch.equal(static[:3], values)
    assert torch.equal(static[3], torch.zeros(3))  # padding: zero hidden
    assert torch.equal(static[4:], torch.full((4, 3), 7.0))  # past the bucket: untouched
    ids = torch.full((8,), 5, dtype=torch.long)
    fill_padded(ids, torch.tensor([3]), 2)
    assert ids.tolist() == [3, 0, 5, 5, 5, 5, 5, 5]  # padding: id 0, a valid id


# -- on a device ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from omni_triton.checkpoints.tiny import build

    return build(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    return load_talker(tiny_checkpoint, "cuda", torch.float32)


def talker_engine(model, fast: bool, max_num_batched_tokens: int = 64) -> LLMEngine:
    device = next(model.parameters()).device
    zeros = torch.zeros(model.hidden_size, dtype=torch.float32, device=device)
    return LLMEngine(TalkerStage(model, tts_eos_embed=zeros, tts_pad_embed=zeros),
                     EngineConfig(block_size=16, num_blocks=64, max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=max_num_batched_tokens, device=device,
                                  kv_dtype=torch.float32, fast_path=fast))


@cuda
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("rows", [1, 3])
def test_graph_completion_equals_the_eager_completion(talker, rows, mode):
    engine = talker_engine(talker, fast=True)
    runner = engine.runner
    completion = runner.graphs.completion
    assert completion is not None and completion.buckets == graph_buckets(MAX_NUM_SEQS)
    gen = torch.Generator().manual_seed(rows)
    for i in range(rows):
        params = {"greedy": GREEDY, "sampled": sampled(10 + i)}.get(mode, GREEDY if i % 2 else sampled(10 + i))
        engine.add_request(str(i), params, prompt_embeds=torch.randn(3 + i, talker.hidden_size, generator=gen).cuda(),
                           thinker_finished=True)
    seqs = [engine.requests[str(i)] for i in range(rows)]
    for seq in seqs:  # as after the main token's append: the completion's draws are keyed by it
        seq.append_output(int(torch.randint(0, 128, (1,), generator=gen)))
    vocab = talker.vocab_size - 1024  # codebook ids
    for trial in range(3):  # the padding rows and the static inputs hold the last trial's data: no effect
        hidden = torch.randn(rows, talker.hidden_size, generator=gen).cuda()
        ids = torch.randint(0, vocab, (rows,), generator=gen).cuda()
        replays = completion.replays
        got = runner.complete_step(seqs, hidden, ids)
        assert completion.replays == replays + 1
        runner.graphs.completion = None  # the eager completion, same samplers, same preparation
        try:
            want = runner.complete_step(seqs, hidden, ids)
        finally:
            runner.graphs.completion = completion
        assert set(got) == set(want) == {"codes", "next_embeds"}
        assert torch.equal(got["codes"], want["codes"]), (trial, got["codes"], want["codes"])
        assert torch.equal(got["next_embeds"], want["next_embeds"])
        assert torch.equal(got["codes"][:, 0], ids)
        for seq in seqs:  # the next frame: other draw indices
            seq.append_output(0)


def frames(model, fast: bool, params: list[SamplingParams], arrivals: list[int], prompt_lens: list[int], *,
           completion_graphs: bool = True, max_num_batched_tokens: int = 64):
    """Codec frames per request, request i added before step ``arrivals[i]``; and the engine."""
    engine = talker_engine(model, fast, max_num_batched_tokens)
    if fast and not completion_graphs:
        engine.runner.graphs.completion = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randn(n, model.hidden_size, generator=gen).to(engine.runner.device) for n in prompt_lens]
    codes: dict[str, list[list[int]]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), params[i], prompt_embeds=prompts[i], thinker_finished=True)
        for out in engine.step() if engine.has_work() else ():
            if "codes" in out.extras:
                codes.setdefault(out.request_id, []).append(out.extras["codes"][0].tolist())
        step += 1
    return codes, engine


# request 0 alone (first step a prefill: 1 row); 1 arrives while 0 decodes (mixed: 2 rows); 2's prompt is
# chunked over steps where 0 and 1 decode (its last chunk: 3 rows), then all three decode under the decode graph
ARRIVALS, PROMPT_LENS, BUDGET = [0, 3, 6], [5, 9, 37], 16


def test_cpu_engine_ignores_the_fast_path_and_has_no_graphs(tiny_checkpoint):
    model = load_talker(tiny_checkpoint, "cpu", torch.float32)
    params = [sampled(21), GREEDY, sampled(22)]
    plain, _ = frames(model, False, params, ARRIVALS, PROMPT_LENS, max_num_batched_tokens=BUDGET)
    fast, engine = frames(model, True, params, ARRIVALS, PROMPT_LENS, max_num_batched_tokens=BUDGET)
    assert engine.runner.graphs is None and not engine.runner.samplers
    assert fast == plain and all(len(plain[str(i)]) == GREEDY.max_new_tokens - 1 for i in range(3))


@cuda
def test_talker_frames_with_prefill_and_mixed_steps_equal_the_eager_gpu_path(talker):
    params = [GREEDY] * 3
    eager, _ = frames(talker, False, params, ARRIVALS, PROMPT_LENS, max_num_batched_tokens=BUDGET)
    assert all(len(eager[str(i)]) == GREEDY.max_new_tokens - 1 for i in range(3))
    fast, engine = frames(talker, True, params, ARRIVALS, PROMPT_LENS, max_num_batched_tokens=BUDGET)
    assert engine.runner.graphs.completion.replays >= 3  # each request's first frame at least
    assert fast == eager
    no_graphs, engine = frames(talker, True, params, ARRIVALS, PROMPT_LENS, completion_graphs=False,
                               max_num_batched_tokens=BUDGET)
    assert no_graphs == eager


@cuda
def test_sampled_talker_frames_do_not_depend_on_the_completion_graphs(talker):
    params = [sampled(21), GREEDY, sampled(22)]
    with_graphs, engine = frames(talker, True, params, ARRIVALS, PROMPT_LENS, max_num_batched_tokens=BUDGET)
    assert engine.runner.graphs.completion.replays >= 3
    without, _ = frames(talker, True, params, ARRIVALS, PROMPT_LENS, completion_graphs=False,
                        max_num_batched_tokens=BUDGET)
    assert with_graphs == without
    assert with_graphs["0"] != with_graphs["2"]


@cuda
def test_capture_is_not_disturbed_by_garbage_collection_of_an_earlier_engine(talker):
    """The failure met when this file ran after the other GPU test files: Python's cyclic collector ran inside a
    capture (torch no longer collects before one) and freed an earlier engine's graphs and pinned buffers there,
    which invalidated the capture. Here that is forced: an earlier engine left as a dead cycle, and the collector
    set to run at almost every allocation; the new engine's captures must still succeed and serve."""
    import gc

    dead = talker_engine(talker, fast=True)
    dead.runner.cycle = dead  # a reference cycle: only the collector frees it
    frames_before = runs_one_request(dead)
    del dead
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        engine = talker_engine(talker, fast=True)
    finally:
        gc.set_threshold(*thresholds)
    assert engine.runner.graphs is not None and engine.runner.graphs.completion is not None
    assert runs_one_request(engine) == frames_before


def runs_one_request(engine: LLMEngine) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    engine.add_request("r", GREEDY, prompt_embeds=torch.randn(5, engine.runner.stage.hidden_size,
                                                              generator=gen).to(engine.runner.device),
                       thinker_finished=True)
    codes = []
    while engine.has_work():
        codes += [out.extras["codes"][0].tolist() for out in engine.step() if "codes" in out.extras]
    return codes
