"""A small byte-level BPE tokenizer with Qwen3-Omni's special tokens, for the tiny checkpoint.

Byte-level, so any UTF-8 text encodes; the role words are single tokens, as in Qwen's vocabulary,
because the talker finds the user/assistant segments by the token after ``<|im_start|>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Order fixes the ids (appended after the BPE vocabulary).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
]
ROLE_WORDS = ["system", "user", "assistant"]
BPE_VOCAB_SIZE = 512

# The chat template of the released model, reduced to what this server sends: text and audio parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.
Speech synthesis turns text into sound; a codec turns sound into discrete codes and back again.
Streaming audio means the first packet leaves the server long before the last word is written.
What is the weather like in Paris? It is sunny and warm, with a light breeze from the west.
Please tell me a short story about a robot who learns to sing. Once upon a time there was a robot.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ! ? ; : ' " ( ) - _ / \\ @ # $ % & *
"""


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Role words are repeated so BPE merges each into a single token.
    corpus = [_CORPUS] * 4 + [" ".join(ROLE_WORDS * 64), "\n".join(ROLE_WORDS * 64)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    for word in ROLE_WORDS:
        if len(tokenizer.encode(word).ids) != 1:
            raise RuntimeError(f"tiny tokenizer: role word {word!r} is not a single token")
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {"content": tok, "special": True, "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
