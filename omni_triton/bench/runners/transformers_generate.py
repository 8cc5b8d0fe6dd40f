"""The reference: transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True).

Not streaming: text and audio both arrive when generate returns, so TTFT = TTFA = end-to-end time.
One request at a time (generate has no request batching across clients)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.runners import SharedWorker, time_request


class TransformersRunner:
    name = "transformers"
    sequential = False
    max_concurrency = 1

    def __init__(self, checkpoint_dir: str | Path, device: str = "cpu"):
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
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            checkpoint_dir, dtype=torch.float32).to(self.device).eval()

    def open_worker(self) -> SharedWorker:
        return SharedWorker(self.request)

    def request(self, tensors: dict[str, np.ndarray]) -> RequestTiming:
        import torch

        def events():  # generate() returns everything at the end: one event, text and audio at once
            inputs = self.preprocessor(tensors)
            input_ids = torch.from_numpy(inputs["INPUT_IDS"]).reshape(1, -1).to(self.device)
            tokens, frames = int(inputs["MAX_TOKENS"][0]), int(inputs["MAX_AUDIO_FRAMES"][0])
            with torch.inference_mode():
                _, waveform = self.model.generate(
                    input_ids, speaker=self.speaker_names[int(inputs["SPEAKER_ID"][0])], return_audio=True,
                    thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens, thinker_do_sample=False,
                    thinker_eos_token_id=self.im_end_token_id,
                    talker_max_new_tokens=frames, talker_min_new_tokens=frames, talker_do_sample=False)
            yield True, int(waveform.numel()) if waveform is not None else 0

        return time_request(events)

    def close(self) -> None:
        pass
