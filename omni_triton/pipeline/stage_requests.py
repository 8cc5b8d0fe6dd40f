"""Validated request tensors (preprocess outputs, by name) -> what each stage's engine runs.

Preprocess has already range-checked every value and filled in defaults; this only maps them onto
engine parameters, in one place for the Triton models and the in-process pipeline.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from omni_triton.engine import SamplingParams
from omni_triton.pipeline.request_params import TALKER_REPETITION_PENALTY
from omni_triton.pipeline.talker_service import TalkerRequest
from omni_triton.pipeline.thinker_service import ThinkerRequest

Tensors = Mapping[str, np.ndarray]


def _scalar(tensors: Tensors, name: str):
    return np.asarray(tensors[name]).reshape(-1)[0].item()


def _seed(tensors: Tensors) -> int | None:
    seed = int(_scalar(tensors, "SEED"))
    return None if seed < 0 else seed  # preprocess fills -1 for "no seed"


def thinker_request(tensors: Tensors, eos_token_ids: tuple[int, ...]) -> ThinkerRequest:
    features = np.asarray(tensors["AUDIO_FEATURES"], dtype=np.float32)
    sampling = SamplingParams(
        temperature=float(_scalar(tensors, "TEMPERATURE")), top_p=float(_scalar(tensors, "TOP_P")),
        top_k=int(_scalar(tensors, "TOP_K")), repetition_penalty=float(_scalar(tensors, "REPETITION_PENALTY")),
        seed=_seed(tensors), max_new_tokens=int(_scalar(tensors, "MAX_TOKENS")),
        min_new_tokens=int(_scalar(tensors, "MIN_TOKENS")), stop_token_ids=eos_token_ids,
        ignore_eos=bool(_scalar(tensors, "IGNORE_EOS")))
    return ThinkerRequest(input_ids=np.asarray(tensors["INPUT_IDS"]).reshape(-1).tolist(), sampling=sampling,
                          audio_features=torch.from_numpy(features) if features.size else None)


def talker_request(tensors: Tensors) -> TalkerRequest:
    # a talker request built without preprocess (e.g. perf_analyzer's talker-only data) may leave the penalty out
    repetition_penalty = (float(_scalar(tensors, "TALKER_REPETITION_PENALTY"))
                          if "TALKER_REPETITION_PENALTY" in tensors else TALKER_REPETITION_PENALTY)
    return TalkerRequest(speaker_id=int(_scalar(tensors, "SPEAKER_ID")),
                         greedy=float(_scalar(tensors, "TEMPERATURE")) == 0.0, seed=_seed(tensors),
                         repetition_penalty=repetition_penalty,
                         max_frames=int(_scalar(tensors, "MAX_AUDIO_FRAMES")),
                         min_frames=int(_scalar(tensors, "MIN_AUDIO_FRAMES")),
                         ignore_eos=bool(_scalar(tensors, "IGNORE_EOS")))
