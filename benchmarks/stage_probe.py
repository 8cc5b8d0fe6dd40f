"""Drive thinker -> talker -> code2wav directly over gRPC (no orchestrator, no ensemble) on a device.

A diagnostic for deployments where the full pipeline fails: it shows which stage model works on its
own. States cross as FP32 (``--dtype float32``), which numpy clients can send.

    python benchmarks/stage_probe.py --device cuda --checkpoint checkpoints/tiny
"""

from __future__ import annotations

import argparse
import json
import queue
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port

PROMPT_IDS = [513, 264, 198, 339, 78, 11, 505, 441, 325, 511, 30, 514, 198, 513, 270, 198]  # tiny tokenizer


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    array = np.ascontiguousarray(array)
    value = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
    value.set_data_from_numpy(array)
    return value


def collect(responses: queue.Queue, finals: int) -> list:
    results = []
    while finals:
        result, error = responses.get(timeout=120)
        if error is not None:
            raise error
        results.append(result)
        finals -= result.get_response().parameters["triton_final_response"].bool_param
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/tiny")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--frames", type=int, default=10)
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="omni-probe-"))
    config = LaunchConfig(checkpoint_dir=Path(args.checkpoint), device=args.device, dtype="float32")
    repository = render_repository(config, workdir / "repository", ["thinker", "talker", "code2wav"])
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            gpu=args.device == "cuda")
    server = TritonServer(repository, find_tritonserver(), options, log_path=workdir / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))

        scalars = dict(MAX_TOKENS=np.array([5], np.int32), MIN_TOKENS=np.array([0], np.int32),
                       TEMPERATURE=np.array([0.0], np.float32), TOP_P=np.array([1.0], np.float32),
                       TOP_K=np.array([0], np.int32), REPETITION_PENALTY=np.array([1.0], np.float32),
                       SEED=np.array([-1], np.int64), IGNORE_EOS=np.array([False]))
        inputs = [tensor("INPUT_IDS", np.array(PROMPT_IDS, np.int64)),
                  tensor("AUDIO_FEATURES", np.zeros((128, 0), np.float32))]
        inputs += [tensor(name, value) for name, value in scalars.items()]
        client.async_stream_infer("thinker", inputs, request_id="probe", enable_empty_final_response=True)
        chunks = [{name: r.as_numpy(name) for name in ("TOKEN_IDS", "ROW_IDS", "EMBEDS", "HIDDEN", "PROMPT_LEN",
                                                       "FINISHED")}
                  for r in collect(responses, 1) if r.as_numpy("TOKEN_IDS") is not None]
        print("thinker ok: tokens", [int(c["TOKEN_IDS"][0]) for c in chunks])

        speakers = json.loads((Path(args.checkpoint) / "config.json").read_text())["talker_config"]["speaker_id"]
        start_inputs = dict(SPEAKER_ID=np.array([[speakers["ethan"]]], np.int64),
                            TEMPERATURE=np.array([[0.0]], np.float32), SEED=np.array([[-1]], np.int64),
                            IGNORE_EOS=np.array([[True]]), MAX_AUDIO_FRAMES=np.array([[args.frames]], np.int32),
                            MIN_AUDIO_FRAMES=np.array([[args.frames]], np.int32))
        for index, chunk in enumerate(chunks):
            talker_inputs = [tensor("ROW_IDS", chunk["ROW_IDS"][None]), tensor("EMBEDS", chunk["EMBEDS"][None]),
                             tensor("HIDDEN", chunk["HIDDEN"][None]), tensor("PROMPT_LEN", chunk["PROMPT_LEN"][None]),
                             tensor("THINKER_FINISHED", chunk["FINISHED"][None])]
            if index == 0:
                talker_inputs += [tensor(name, value) for name, value in start_inputs.items()]
            client.async_stream_infer("talker", talker_inputs, request_id="probe", sequence_id=77,
                                      sequence_start=index == 0, sequence_end=index == len(chunks) - 1,
                                      enable_empty_final_response=True)
        frames = [r.as_numpy("CODES") for r in collect(responses, len(chunks)) if r.as_numpy("CODES") is not None]
        codes = np.concatenate([f.reshape(-1, f.shape[-1]) for f in frames])
        print("talker ok: frames", codes.shape)

        audio = client.infer("code2wav", [tensor("CODES", codes.T[None].astype(np.int64)),
                                          tensor("LEFT_CONTEXT", np.array([[0]], np.int32))]).as_numpy("AUDIO")
        print("code2wav ok: samples", audio.shape, "peak", float(np.abs(audio).max()))
        client.stop_stream()
    finally:
        server.stop()
        print("server log:", workdir / "tritonserver.log")


if __name__ == "__main__":
    main()
