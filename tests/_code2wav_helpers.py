"""Test helpers for the Code2Wav tests.

``calibrate_output_gain_`` keeps a random-weight Code2Wav's waveform out of the +-1 clamp: with saturated
output, tiny float differences (ORT vs torch, chunked vs one pass) are amplified by the decoder's gain and
then hidden or flipped by the clamp; scaling the last conv so the unclamped waveform has std ~0.2 makes
absolute tolerances meaningful whatever the checkpoint's random scale.
"""

import pytest
import torch

from omni_triton.models.code2wav.vocoder import Code2Wav


@torch.no_grad()
def calibrate_output_gain_(model: Code2Wav, target_std: float = 0.2, num_frames: int = 40) -> Code2Wav:
    last_conv = model.decoder[-1].conv
    captured = []
    handle = last_conv.register_forward_hook(lambda module, args, out: captured.append(out))
    codes = torch.randint(0, model.config.codebook_size, (2, model.num_quantizers, num_frames),
                          generator=torch.Generator().manual_seed(0))
    model(codes.to(last_conv.weight.device))
    handle.remove()
    scale = target_std / captured[0].float().std().item()
    last_conv.weight.mul_(scale)
    last_conv.bias.mul_(scale)
    return model


def overwrite_code2wav_weights(checkpoint, model: Code2Wav) -> None:
    """Save ``model``'s weights into ``checkpoint`` (every backend that loads the checkpoint runs that model)."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    tensors.update({f"code2wav.{name}": value.contiguous() for name, value in model.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def one_torch_thread():
    """Many small conv calls: on a shared 2-core machine, 2 intra-op threads per process are several
    times slower than 1 (oversubscription)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@torch.inference_mode()
def stateful_decode(streaming, codes: torch.Tensor, splits: list[list[int]],
                    first_call: list[int] | None = None) -> list[torch.Tensor]:
    """Decode streams ``codes[b]`` ([B, G, N]) chunk by chunk with ``StreamingCode2Wav``, the streams due in a
    call batched together: stream b's chunks have ``splits[b]`` frames and its first one goes in call
    ``first_call[b]`` (default 0). Returns each stream's concatenated new samples."""
    batch = codes.shape[0]
    first_call = first_call or [0] * batch
    states = [streaming.initial_state(1, codes.device) for _ in range(batch)]
    decoded, pieces = [0] * batch, [[] for _ in range(batch)]
    for call in range(max(len(s) + f for s, f in zip(splits, first_call))):
        rows = [b for b in range(batch) if 0 <= call - first_call[b] < len(splits[b])]
        lengths = [splits[b][call - first_call[b]] for b in rows]
        longest = max(lengths)
        chunk = torch.stack([torch.nn.functional.pad(codes[b, :, decoded[b]:decoded[b] + n], (0, longest - n))
                             for b, n in zip(rows, lengths)])
        state = [torch.cat(parts) for parts in zip(*(states[b] for b in rows))]
        waveform, *state = streaming(chunk, torch.tensor(lengths, device=codes.device), *state)
        for row, (b, n) in enumerate(zip(rows, lengths)):
            pieces[b].append(waveform[row, :streaming.new_samples(decoded[b], n)])
            states[b] = [tensor[row:row + 1] for tensor in state]
            decoded[b] += n
    return [torch.cat(p) for p in pieces]


def stream_ramp(runtime, codes: torch.Tensor, ramp: list[int]) -> list[torch.Tensor]:
    """Each row of ``codes`` [B, G, sum(ramp)] streamed in chunks of ``ramp``'s sizes, all rows batched in one
    stateful call per chunk (the stage's ``Code2WavStreamStates``): each row's samples, joined."""
    from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates, StreamChunk

    states = Code2WavStreamStates(runtime.decode_stream, runtime.state_specs(), runtime.streaming_samples,
                                  runtime.device)
    pieces, done = [[] for _ in range(codes.shape[0])], 0
    for index, frames in enumerate(ramp):
        chunks = [StreamChunk(f"row{b}", row[:, done:done + frames], first=index == 0) for b, row in enumerate(codes)]
        for b, samples in enumerate(states.decode(chunks)):
            pieces[b].append(samples)
        done += frames
    return [torch.cat(row) for row in pieces]


def assert_equals_one_pass(runtime, codes: torch.Tensor, streamed: list[torch.Tensor]) -> None:
    """Each streamed row equals the one-pass decode of its codes (other shapes than one pass: cuDNN may pick other
    kernels and round differently, TF32 convs included)."""
    with torch.inference_mode():
        expected = runtime.model(codes).float()
    for row, samples in enumerate(streamed):
        torch.testing.assert_close(samples, expected[row], rtol=0, atol=5e-3)
