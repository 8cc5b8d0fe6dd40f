"""The reference: transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True).

Not streaming: text and audio both arrive when generate returns, so TTFT = TTFA = end-to-end time.
One request at a time (generate has no request batching across clients).

Weights: a checkpoint's (``from_pretrained``), or with ``random_weights`` seeded random weights built from the
checkpoint dir's config.json alone (a ``--config`` dummy dir: config + tokenizer, no weights file). The random
weights are the served stages' own (``omni_triton.models.weights._dummy_values_``: each tensor seeded by the seed
and its checkpoint name), filled in transformers' parameters under the names the checkpoint files give them, so
both systems run the same tensors (same device and dtype: values drawn on the GPU in bf16 are not those drawn on
the CPU in float32). Only the vision tower, which the served pipeline has not, is extra.

dtype: the served pipeline's (``LaunchConfig.resolved_dtype``): bfloat16 on cuda, float32 on cpu, for both kinds
of weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker, time_request

# transformers' parameter name prefix -> the name the served component gives it (what seeds its random values:
# the checkpoint file's name less the component's prefix). transformers 5 nests the thinker's text model and
# audio tower under ``thinker.model``; the checkpoint files (and transformers 4) do not. First match wins.
SERVED_NAME_PREFIXES = (
    ("thinker.model.language_model.", "model."),  # thinker (transformers 5)
    ("thinker.model.audio_tower.", ""),           # audio encoder (transformers 5)
    ("thinker.audio_tower.", ""),                 # audio encoder (transformers 4)
    ("thinker.model.visual.", "visual."),         # vision tower: not served, any stable name will do
    ("thinker.visual.", "visual."),
    ("thinker.", ""),                             # thinker: model.* (transformers 4), lm_head
    ("talker.", ""),
    ("code2wav.", ""),
)


def served_name(name: str) -> str:
    """The served component's name of transformers' parameter ``name`` (ValueError for an unknown one)."""
    for prefix, replacement in SERVED_NAME_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    raise ValueError(f"parameter {name!r} belongs to no served component (no prefix in SERVED_NAME_PREFIXES)")


def bench_dtype(device: str):
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_config(checkpoint_dir: str | Path):
    from transformers import Qwen3OmniMoeConfig

    from omni_triton.checkpoints.transformers_rope_keys import quiet_mrope_key_warning

    with quiet_mrope_key_warning():
        return Qwen3OmniMoeConfig.from_pretrained(checkpoint_dir)


def build_random_model(checkpoint_dir: str | Path, device, dtype, seed: int = 0):
    """Qwen3OmniMoeForConditionalGeneration from ``checkpoint_dir``'s config.json, allocated on ``device`` in
    ``dtype`` (never materialised on the CPU first: the full size is 35B parameters), every parameter filled with
    the served stages' seeded values. transformers' own init is skipped (``no_init_weights``: at 30B it would
    draw every tensor once more for nothing); every floating-point parameter is then overwritten, so nothing
    uninitialised is left. Buffers (rotary frequencies, code offsets, positions) are computed in the modules'
    __init__ on the device, as in from_pretrained."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_triton.models.weights import _dummy_values_

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: its init runs (slower, then overwritten all the same)
        no_init_weights = contextlib.nullcontext
    config = load_config(checkpoint_dir)
    with torch.device(device), no_init_weights():
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not parameter.is_floating_point():
                continue
            if parameter.dtype != dtype:  # a module transformers keeps in float32 draws other values than the stage
                raise ValueError(f"{name} is {parameter.dtype}, not {dtype}: its random values would not be the "
                                 "served stage's")
            _dummy_values_(served_name(name), parameter, seed)
    torch.manual_seed(seed)  # generate is greedy; any sampling left (none expected) is seeded too
    return model.eval()


class TransformersRunner:
    name = "transformers"
    sequential = False
    max_concurrency = 1

    def __init__(self, checkpoint_dir: str | Path, device: str = "cpu", *, random_weights: bool = False,
                 seed: int = 0):
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omni_triton.pipeline.preprocess import Preprocessor
        from omni_triton.pipeline.request_params import RequestLimits

        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        self.speaker_names = {int(i): name for name, i in config["talker_config"]["speaker_id"].items()}
        self.im_end_token_id = int(config["im_end_token_id"])
        # The server's own preprocess, so both systems see the same prompt token ids.
        self.preprocessor = Preprocessor(checkpoint_dir, RequestLimits(), kv_cache_tokens=1 << 20)
        self.device = torch.device(device)
        dtype = bench_dtype(device)
        if random_weights:
            self.model = build_random_model(checkpoint_dir, self.device, dtype, seed)
        else:
            self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                checkpoint_dir, dtype=dtype).to(self.device).eval()

    def open_worker(self) -> SharedWorker:
        return SharedWorker(self.request)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        import torch

        def events():  # generate() returns everything at the end: one event, text and audio at once
            inputs = self.preprocessor(tensors)
            input_ids = torch.from_numpy(inputs["INPUT_IDS"]).reshape(1, -1).to(self.device)
            tokens, frames = int(inputs["MAX_TOKENS"][0]), int(inputs["MAX_AUDIO_FRAMES"][0])
            with torch.inference_mode():
                # Exactly the workload's tokens and frames, whatever random weights predict. The talker's step
                # that samples codec token t runs the code predictor of token t - 1, so N talker tokens give N - 1
                # frames (the last token is meant to be codec EOS): `frames` non-EOS tokens, then one more slot.
                _, waveform = self.model.generate(
                    input_ids, speaker=self.speaker_names[int(inputs["SPEAKER_ID"][0])], return_audio=True,
                    thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens, thinker_do_sample=False,
                    thinker_eos_token_id=self.im_end_token_id,
                    talker_max_new_tokens=frames + 1, talker_min_new_tokens=frames, talker_do_sample=False,
                    talker_temperature=None)  # greedy: no "temperature is ignored" warning per request
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the audio is out when it is on the host's side of the stream
            yield True, int(waveform.numel()) if waveform is not None else 0

        return time_request(events)

    def close(self) -> None:
        self.model = None  # frees its GPU memory for whatever the bench runs next
