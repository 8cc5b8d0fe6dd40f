"""The engine on the real modules of the tiny checkpoint: thinker greedy ids equal transformers' generate,
and thinker engine -> TalkerInputs -> talker engine equals the reference pipeline, with requests batched."""

from __future__ import annotations

import pytest
import torch

from omni_triton.checkpoints.tiny import build
from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.models.config import OmniConfig
from omni_triton.models.weights import load_talker, load_thinker
from omni_triton.pipeline.reference import generate
from omni_triton.pipeline.talker_inputs import TalkerInputs

pytestmark = pytest.mark.engine

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "<|im_start|>user\nHello, how are you today?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful voice.<|im_end|>\n<|im_start|>user\nTell me a story about a cat "
    "and a dog who went to the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]
THINKER_MAX_NEW = 10
TALKER_MAX_NEW = 14


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    checkpoint = build(tmp_path_factory.mktemp("tiny"), "tiny")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return dict(checkpoint=checkpoint, config=OmniConfig.from_pretrained(checkpoint),
                thinker=load_thinker(checkpoint, with_audio=False).eval(), talker=load_talker(checkpoint).eval(),
                prompts=[tokenizer.encode(p).ids for p in PROMPTS])


def thinker_params(config: OmniConfig) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=THINKER_MAX_NEW, stop_token_ids=config.thinker_eos_token_ids)


def test_batched_thinker_greedy_equals_transformers_generate(tiny):
    config = tiny["config"]
    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny["checkpoint"],
                                                                          dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in tiny["prompts"]:
            out = hf.thinker.generate(torch.tensor([prompt]), max_new_tokens=THINKER_MAX_NEW, do_sample=False,
                                      eos_token_id=list(config.thinker_eos_token_ids))
            expected.append(out[0, len(prompt):].tolist())
    # block size 4 and a 24-token budget: paged KV across blocks, chunked prefill next to decodes
    engine = LLMEngine(ThinkerStage(tiny["thinker"]), EngineConfig(block_size=4, num_blocks=128,
                                                                   max_num_batched_tokens=24))
    for i, prompt in enumerate(tiny["prompts"]):
        engine.add_request(str(i), thinker_params(config), prompt_token_ids=prompt)
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[str(i)] for i in range(len(expected))] == expected


def test_thinker_and_talker_engines_equal_the_reference_pipeline(tiny):
    config, thinker, talker = tiny["config"], tiny["thinker"], tiny["talker"]
    references = [generate(thinker, talker, config, prompt, speaker="ethan", return_audio=True,
                           thinker_max_new_tokens=THINKER_MAX_NEW, talker_max_new_tokens=TALKER_MAX_NEW)
                  for prompt in tiny["prompts"]]

    thinker_engine = LLMEngine(ThinkerStage(thinker, accept_hidden_layer=config.accept_hidden_layer),
                               EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=32))
    talker_engine = LLMEngine(TalkerStage(talker), EngineConfig(block_size=4, num_blocks=128))
    tts_ids = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
    talker_params = SamplingParams(temperature=0.0, max_new_tokens=TALKER_MAX_NEW, repetition_penalty=1.05,
                                   stop_token_ids=(config.talker.codec_eos_token_id,),
                                   suppressed_token_ids=tuple(talker.suppressed_token_ids().tolist()))
    inputs, fed_ids, thinker_ids, talker_ids, frames = {}, {}, {}, {}, {}
    for i, prompt in enumerate(tiny["prompts"]):
        request_id = str(i)
        thinker_engine.add_request(request_id, thinker_params(config), prompt_token_ids=prompt)
        inputs[request_id] = TalkerInputs(talker, config, prompt, "ethan", thinker.embed(tts_ids))
        fed_ids[request_id] = list(prompt)
        thinker_ids[request_id], talker_ids[request_id], frames[request_id] = [], [], []

    with torch.no_grad():
        while thinker_engine.has_work() or talker_engine.has_work():
            for out in thinker_engine.step():  # thinker rows -> talker (prefill, then appends)
                rid = out.request_id
                thinker_ids[rid] += out.new_token_ids
                rows = None
                if out.states:
                    n = out.states["input_embeds"].shape[0]
                    ids = torch.tensor(fed_ids[rid][out.states_start:out.states_start + n])
                    rows = (ids, out.states["input_embeds"], out.states["accept_hidden"])
                fed_ids[rid] += out.new_token_ids
                if rid in talker_engine.requests:
                    talker_engine.append(rid, thinker_rows=rows, finished=out.finished)
                    continue
                if rows is not None:
                    inputs[rid].feed(*rows)
                if out.finished:
                    inputs[rid].finish()
                if inputs[rid].prefill_ready:
                    embeds, positions = inputs[rid].take_prefill()
                    talker_engine.add_request(rid, talker_params, prompt_embeds=embeds, prompt_positions=positions,
                                              talker_inputs=inputs[rid])
            for out in talker_engine.step():
                talker_ids[out.request_id] += out.new_token_ids
                if "codes" in out.extras:
                    frames[out.request_id].append(out.extras["codes"])

    for i, ref in enumerate(references):
        rid = str(i)
        assert thinker_ids[rid] == ref.thinker_ids
        assert talker_ids[rid] == ref.talker_ids
        assert torch.equal(torch.cat(frames[rid]).T, ref.codes)
