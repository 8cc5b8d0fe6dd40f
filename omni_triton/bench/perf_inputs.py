"""perf_analyzer --input-data JSON for `omni` and each stage model, for one checkpoint and workload.

Stage inputs are what the stage sees in a real request: the thinker gets preprocess's outputs; code2wav one
chunk of codes; the talker a 1-step sequence holding the whole thinker output (prompt rows + every token,
THINKER_FINISHED) on which perf_analyzer sets START and END itself (it reads the sequence batcher from the
model config). Not 2 steps: perf_analyzer sends a sequence's next step only once the previous request has
completed, and a talker START request completes only after the thinker has finished (deadlock); and it gives
every request its own request id, while the talker keys a sequence's later chunks by the START's request id.
Embeddings and hidden states are random (the talker only needs their shape); the talker and thinker states
are FP32, as served on CPU (a GPU server's BF16 states are not expressible in this JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_triton.bench.workload import Workload, client_tensors, prompt_text

OMNI_FIELDS = ("TEXT", "MAX_TOKENS", "MIN_TOKENS", "IGNORE_EOS", "MAX_AUDIO_FRAMES", "MIN_AUDIO_FRAMES",
               "TEMPERATURE", "SEED")
THINKER_FIELDS = ("MAX_TOKENS", "MIN_TOKENS", "TEMPERATURE", "TOP_P", "TOP_K", "REPETITION_PENALTY", "SEED",
                  "IGNORE_EOS")
TALKER_START_FIELDS = ("SPEAKER_ID", "TEMPERATURE", "SEED", "IGNORE_EOS", "MAX_AUDIO_FRAMES", "MIN_AUDIO_FRAMES")


def _tensor(array: np.ndarray) -> dict:
    array = np.asarray(array)
    content = [v.decode("utf-8") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
    return {"content": content, "shape": list(array.shape)}


def omni_inputs(workload: Workload, text: str, sequential: bool = False) -> dict:
    tensors = client_tensors(workload, text, sequential=sequential)
    fields = OMNI_FIELDS + (("SEQUENTIAL",) if sequential else ())
    return {"data": [{name: _tensor(tensors[name]) for name in fields}]}


def stage_inputs(checkpoint_dir: str | Path, workload: Workload, seed: int = 0) -> dict[str, dict]:
    """{model name: input-data JSON} for omni, preprocess, thinker, talker and code2wav."""
    from omni_triton.pipeline.preprocess import Preprocessor
    from omni_triton.pipeline.request_params import RequestLimits

    checkpoint_dir = Path(checkpoint_dir)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    text = prompt_text(workload.prompt_tokens, checkpoint_dir / "tokenizer.json")
    omni = omni_inputs(workload, text)
    prepared = Preprocessor(checkpoint_dir, RequestLimits(), kv_cache_tokens=1 << 20)(client_tensors(workload, text))
    rng = np.random.default_rng(seed)

    thinker = {"INPUT_IDS": _tensor(prepared["INPUT_IDS"]), "AUDIO_FEATURES": _tensor(prepared["AUDIO_FEATURES"]),
               **{name: _tensor(prepared[name]) for name in THINKER_FIELDS}}

    hidden_size = int(config["thinker_config"]["text_config"]["hidden_size"])
    vocab = int(config["thinker_config"]["text_config"]["vocab_size"])
    row_ids = np.concatenate([prepared["INPUT_IDS"], rng.integers(0, vocab, workload.thinker_tokens)])
    rows = len(row_ids)
    talker = {"ROW_IDS": _tensor(row_ids.astype(np.int64)),
              "EMBEDS": _tensor(rng.normal(0, 0.02, (rows, hidden_size)).astype(np.float32)),
              "HIDDEN": _tensor(rng.normal(0, 0.02, (rows, hidden_size)).astype(np.float32)),
              "PROMPT_LEN": _tensor(np.array([len(prepared["INPUT_IDS"])], np.int32)),
              "THINKER_FINISHED": _tensor(np.array([True])),
              **{name: _tensor(prepared[name]) for name in TALKER_START_FIELDS}}

    code2wav_config = config["code2wav_config"]
    groups = int(config["talker_config"]["num_code_groups"])
    codes = rng.integers(0, int(code2wav_config["codebook_size"]), (groups, workload.audio_frames))
    code2wav = {"CODES": _tensor(codes.astype(np.int64)), "LEFT_CONTEXT": _tensor(np.array([0], np.int32))}

    return {"omni": omni, "preprocess": omni, "thinker": {"data": [thinker]},
            "talker": {"data": [[talker]]}, "code2wav": {"data": [code2wav]}}


def write_stage_inputs(checkpoint_dir: str | Path, workload: Workload, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for model, data in stage_inputs(checkpoint_dir, workload).items():
        paths[model] = out_dir / f"{model}.json"
        paths[model].write_text(json.dumps(data) + "\n")
    return paths
