"""Prompt ids of the preprocess stage == transformers' Qwen3-Omni processor, for chat templates of several styles
saved into a checkpoint by transformers itself (``processor.save_pretrained``)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from omni_triton.pipeline.preprocess import Preprocessor
from omni_triton.pipeline.request_params import InvalidRequest, RequestLimits

transformers = pytest.importorskip("transformers")

# Plain ChatML: prints message['content'] as it is (many text checkpoints ship this).
STRING_CONTENT = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Reads content parts only, with a default system turn, a BOS variable and transformers' tojson filter.
PARTS_CONTENT = ("{{ bos_token }}<|im_start|>system\n{{ {'voice': 'calm'} | tojson }}<|im_end|>\n"
                 "{% for message in messages %}<|im_start|>{{ message.role }}\n"
                 "{% for part in message.content %}{% if part.type == 'audio' %}"
                 "<|audio_start|><|audio_pad|><|audio_end|>{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
                 "{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"string content": STRING_CONTENT, "parts content": PARTS_CONTENT, "tiny checkpoint's": None}
PROMPTS = ["Hello, how are you today?", "héllo wörld ✓ 你好", " spaces  and\nnewlines "]
EXTRA_SPECIAL_TOKENS = {"audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>",
                        "video_token": "<|video_pad|>", "audio_bos_token": "<|audio_start|>",
                        "audio_eos_token": "<|audio_end|>", "vision_bos_token": "<|vision_start|>",
                        "vision_eos_token": "<|vision_end|>"}


class AudioTextProcessor(transformers.Qwen3OmniMoeProcessor):
    """Qwen3-Omni's processor without its image and video processors, which need torchvision (not installed);
    text and audio take exactly the released processor's code path."""

    def __init__(self, feature_extractor=None, tokenizer=None, chat_template=None):
        transformers.ProcessorMixin.__init__(self, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image_token", "audio_token", "video_token", "image_token_id", "audio_token_id",
                     "video_token_id", "vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token"):
            setattr(self, name, getattr(self.tokenizer, name))


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def checkpoint(request, tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, its processor): the tiny checkpoint with the template written by save_pretrained."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint),
                                                           extra_special_tokens=EXTRA_SPECIAL_TOKENS)
    if request.param == "parts content":
        tokenizer.add_special_tokens({"bos_token": "<|endoftext|>"})
    template = TEMPLATES[request.param] or tokenizer.chat_template
    processor = AudioTextProcessor(transformers.WhisperFeatureExtractor(feature_size=128), tokenizer,
                                   chat_template=template)
    out = tmp_path_factory.mktemp("template")
    processor.save_pretrained(str(out))
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_checkpoint / name, out / name)
    return out, processor


def preprocess(checkpoint_dir, **inputs) -> list[int]:
    inputs = {name: value for name, value in inputs.items() if value is not None}
    preprocessor = Preprocessor(checkpoint_dir, RequestLimits(), kv_cache_tokens=4096)
    return preprocessor(inputs)["INPUT_IDS"].tolist()


def text_tensor(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)


def processor_ids(processor, content, **kwargs) -> list[int]:
    ids = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, **kwargs)["input_ids"]
    return list(np.asarray(ids).reshape(-1))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_prompt_ids_equal_the_processor(checkpoint, prompt):
    checkpoint_dir, processor = checkpoint
    # the turn as a caller writes it for this template: a string for ChatML, parts otherwise
    content = prompt if processor.chat_template == STRING_CONTENT else [{"type": "text", "text": prompt}]
    expected = processor_ids(processor, content)
    assert "[{'type'" not in processor.tokenizer.decode(expected)
    assert preprocess(checkpoint_dir, TEXT=text_tensor(prompt)) == expected


def test_spoken_prompt_ids_equal_the_processor(checkpoint):
    checkpoint_dir, processor = checkpoint
    t = np.arange(int(1.5 * 16000)) / 16000
    waveform = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    content = [{"type": "audio", "audio": waveform}, {"type": "text", "text": "what is this?"}]
    if processor.chat_template == STRING_CONTENT:
        with pytest.raises(ValueError, match="audio"):  # transformers refuses it ...
            processor_ids(processor, content)
        with pytest.raises(InvalidRequest) as refused:  # ... and so do we, naming the input
            preprocess(checkpoint_dir, TEXT=text_tensor("what is this?"), AUDIO_IN=waveform)
        assert refused.value.field == "AUDIO_IN"
        return
    expected = processor_ids(processor, content)
    assert expected.count(processor.audio_token_id) > 1
    assert preprocess(checkpoint_dir, TEXT=text_tensor("what is this?"), AUDIO_IN=waveform) == expected
    # spoken input alone: no TEXT tensor at all
    assert preprocess(checkpoint_dir, AUDIO_IN=waveform) == processor_ids(processor, content[:1])


HISTORY = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello, how are you today?"},
           {"role": "assistant", "content": "I am fine, thank you."}]


def test_conversation_ids_equal_the_processor(checkpoint):
    """Earlier turns (HISTORY) and a spoken last turn render as the processor renders the whole conversation."""
    import json

    checkpoint_dir, processor = checkpoint
    history = text_tensor(json.dumps(HISTORY))
    as_parts = processor.chat_template != STRING_CONTENT
    earlier = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}] if as_parts else m["content"]}
               for m in HISTORY]
    last = [{"type": "text", "text": "And the weather?"}] if as_parts else "And the weather?"
    expected = processor.apply_chat_template([*earlier, {"role": "user", "content": last}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = list(np.asarray(expected["input_ids"]).reshape(-1))
    assert preprocess(checkpoint_dir, TEXT=text_tensor("And the weather?"), HISTORY=history) == expected
    if as_parts:
        waveform = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)
        spoken = [*earlier, {"role": "user", "content": [{"type": "audio", "audio": waveform}]}]
        expected = processor.apply_chat_template(spoken, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert preprocess(checkpoint_dir, AUDIO_IN=waveform, HISTORY=history) == list(
            np.asarray(expected["input_ids"]).reshape(-1))


@pytest.mark.parametrize("history, message", [
    ("not json", "HISTORY is not JSON"),
    ('{"role": "user"}', "HISTORY must be a JSON list"),
    ('[{"role": "tool", "content": "x"}]', "HISTORY [0].role must be one of"),
    ('[{"role": "user", "content": 3}]', "HISTORY [0].content must be a string"),
    ('[{"role": "user", "content": "x", "name": "n"}]', "HISTORY [0] must be an object"),
])
def test_bad_history_is_refused_naming_it(tiny_checkpoint, history, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[")) as refused:
        preprocess(tiny_checkpoint, TEXT=text_tensor("hi"), HISTORY=text_tensor(history))
    assert refused.value.field == "HISTORY"
