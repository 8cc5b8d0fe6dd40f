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


def with_token_ids(tokenizer: Tokenizer, pinned: dict[str, int], vocab_size: int) -> Tokenizer:
    """``tokenizer`` (a tokenizer of this module) renumbered into a ``vocab_size`` vocabulary: each token of
    ``pinned`` (special tokens and role words) at its given id, the other BPE tokens at the lowest free ids, the
    other special tokens right after the highest pinned one, and every id left over a filler token that decodes
    to `` w<id>`` and that no text encodes to. For a checkpoint whose config names ids of another vocabulary (the
    released model's ~151k): a model sampling any id of its vocabulary still decodes to text."""
    layout = json.loads(tokenizer.to_str())
    bpe = sorted(layout["model"]["vocab"], key=layout["model"]["vocab"].get)
    specials = [token["content"] for token in sorted(layout["added_tokens"], key=lambda token: token["id"])]
    unknown = sorted(set(pinned) - set(bpe) - set(specials))
    if unknown:
        raise ValueError(f"tokens {unknown} are not in the tokenizer")
    by_id: dict[int, str] = {}
    for token, token_id in pinned.items():
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{token!r} pinned at id {token_id}, outside the vocabulary of {vocab_size}")
        if token_id in by_id:
            raise ValueError(f"{token!r} and {by_id[token_id]!r} are both pinned at id {token_id}")
        by_id[token_id] = token
    free = (i for i in range(vocab_size) if i not in by_id)
    after_pinned = max((pinned[t] for t in specials if t in pinned), default=-1)
    free_after = (i for i in range(after_pinned + 1, vocab_size) if i not in by_id)
    try:
        ids = {token: next(free) for token in bpe if token not in pinned}
        by_id.update({token_id: token for token, token_id in ids.items()})
        ids.update({token: next(free_after) for token in specials if token not in pinned})
    except StopIteration:
        raise ValueError(f"{len(bpe) + len(specials)} tokens do not fit a vocabulary of {vocab_size} "
                         f"with {len(pinned)} pinned ids") from None
    ids.update(pinned)
    taken = set(ids.values())
    fillers = {f"\u0120w{i}": i for i in range(vocab_size) if i not in taken}
    if set(fillers) & set(ids):
        raise ValueError(f"filler tokens collide with the vocabulary: {sorted(set(fillers) & set(ids))[:4]}")
    # Special tokens are in the model's vocabulary too: an added token takes the id the model has for it, and
    # only that way can it sit below other ids (tokenizers numbers the rest after the model's vocabulary).
    layout["model"]["vocab"] = {**{token: ids[token] for token in bpe + specials}, **fillers}
    for token in layout["added_tokens"]:
        token["id"] = ids[token["content"]]
    layout["added_tokens"].sort(key=lambda token: token["id"])
    renumbered = Tokenizer.from_str(json.dumps(layout))
    for token, token_id in pinned.items():
        encoded = renumbered.encode(token, add_special_tokens=False).ids
        if encoded != [token_id]:
            raise ValueError(f"{token!r} encodes to {encoded}, not to its pinned id [{token_id}]")
    return renumbered
