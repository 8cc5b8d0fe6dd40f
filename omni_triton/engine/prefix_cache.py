"""Prefix caching's content addresses: what a KV block holds, as a hash chained over everything before it.

A position's K/V (and the states a stage streams for it) is a function of the inputs at it and at every position
before it, and of the rope positions. So a block is named by ``hash(parent block's hash, its positions' keys)``:
two sequences share a block exactly when their inputs agree up to its end. A position's key is 16 bytes:
- a token input (the thinker's text, any stage's generated tokens fed back): its id and -1;
- an input that is not a token's embedding (the thinker's audio positions, the talker's prompt embeddings): a
  digest of what the stage puts there (``audio_position_keys``: the recording's digest and the row index, so two
  recordings never share a block; ``embedding_keys``: the embedding's bytes);
- explicit rope positions (M-RoPE prompts) are mixed into each position's key.
Stages make the prompt's keys (``cache_keys``); generated positions are keyed by their token ids where the stage
feeds sampled tokens back as inputs (the thinker), else they are never cached (the talker: its next input is
made from the codec frame, and no later prompt repeats it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from omni_triton.engine.sequence import Sequence

KEY_BYTES = 16


def token_keys(token_ids) -> np.ndarray:
    """[n, 16] uint8: the keys of token inputs."""
    keys = np.full((len(token_ids), 2), -1, dtype=np.int64)
    keys[:, 0] = np.asarray(token_ids, dtype=np.int64)
    return keys.view(np.uint8)


def digest(data: bytes, size: int = KEY_BYTES) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A digest of a tensor's values (its bytes on the host: a device tensor is copied there)."""
    host = tensor.detach().contiguous().cpu()
    return digest(host.view(torch.uint8).numpy().tobytes() + str(host.dtype).encode() + str(tuple(host.shape)).encode())


def audio_position_keys(recording_key: bytes, count: int) -> np.ndarray:
    """[count, 16] keys of the audio rows 0..count-1 of one recording (``recording_key``: a digest of its features)."""
    return np.frombuffer(b"".join(digest(recording_key + index.to_bytes(8, "little")) for index in range(count)),
                         dtype=np.uint8).reshape(count, KEY_BYTES)


def embedding_keys(embeds: torch.Tensor) -> np.ndarray:
    """[n, 16] keys of input embeddings [n, H], one digest of each row's bytes."""
    host = embeds.detach().contiguous().cpu()
    rows = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
    return np.frombuffer(b"".join(digest(row.tobytes()) for row in rows), dtype=np.uint8).reshape(-1, KEY_BYTES)


def with_positions(keys: np.ndarray, positions: torch.Tensor) -> np.ndarray:
    """Explicit rope positions [3, n] mixed into the keys [n, 16]."""
    pos = positions.to(torch.int64).T.contiguous().numpy()
    return np.frombuffer(b"".join(digest(key.tobytes() + p.tobytes()) for key, p in zip(keys, pos)),
                         dtype=np.uint8).reshape(-1, KEY_BYTES)


def block_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """The chained hashes of ``seq``'s leading full blocks whose inputs are known (the prompt's; the generated
    tokens' where they are keyed), extending ``seq.block_hashes`` (a sequence's inputs never change, so the
    hashes outlive preemption)."""
    if seq.cache_keys is None:
        return seq.block_hashes
    known = seq.num_prompt_positions + (seq.num_generated if seq.keys_follow_tokens else 0)
    for index in range(len(seq.block_hashes), known // block_size):
        start, end = index * block_size, (index + 1) * block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else b""
        content = _position_keys(seq, start, end)
        seq.block_hashes.append(digest(parent + content))
    return seq.block_hashes


def _position_keys(seq: Sequence, start: int, end: int) -> bytes:
    prompt = seq.num_prompt_positions
    keys = seq.cache_keys[start * KEY_BYTES:min(end, prompt) * KEY_BYTES]
    if end > prompt:
        keys += token_keys(seq.output_token_ids[max(start, prompt) - prompt:end - prompt]).tobytes()
    return keys
