"""Streaming gRPC client for the `omni` model: text (or speech) in, streamed text + 24 kHz audio out.

Reports the latencies the project is judged on (benchmarks/README.md, Metrics): TTFT (request sent -> first text
delta), TTFA (request sent -> first non-empty audio chunk) and RTF (generation wall time / audio duration).

A failed request raises ``StreamError``: its ``code`` names the cause as Triton's error codes do (INVALID_ARG,
UNAVAILABLE, CANCELLED, INTERNAL, ...; DEADLINE_EXCEEDED for a deadline), and its ``result`` holds what
arrived before the error. A streamed error carries a message only; the pipeline names its code in it
(``omni_triton.error_tags``).

    python client/stream_client.py "Tell me a story" --out out.wav
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import queue
import sys
import time
import uuid
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
from tritonclient.utils import InferenceServerException

from omni_triton import trace
from omni_triton.error_tags import code_of

OUTPUT_SAMPLE_RATE = 24000
INPUT_SAMPLE_RATE = 16000
# Streams do not carry the ``triton_grpc_error`` header (the server would end a stream on an error with the
# error's gRPC status): tritonserver 2.51's gRPC frontend segfaults within a few dozen streams ended that way.
# A streamed error then carries its message only, in which the pipeline names its code (``error_tags``).
GRPC_ERROR_HEADERS: dict[str, str] = {}
# gRPC status -> the Triton error code that the server answers with it (TRITONSERVER_Error_Code names).
# DEADLINE_EXCEEDED has no Triton code: it comes from gRPC's own deadline (``deadline_s``) or from the client.
TRITON_ERROR_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "UNIMPLEMENTED": "UNSUPPORTED"}


@dataclass
class StreamResult:
    text: str = ""
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    ttft_s: float | None = None
    ttfa_s: float | None = None
    total_s: float = 0.0
    responses: int = 0
    cancelled: bool = False
    error: str | None = None  # "CODE: message" of a request that failed


    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.audio_chunks) if self.audio_chunks else np.zeros(0, np.float32)

    @property
    def audio_seconds(self) -> float:
        return sum(len(c) for c in self.audio_chunks) / OUTPUT_SAMPLE_RATE

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_seconds if self.audio_seconds else None

    def summary(self) -> str:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value * 1000:.0f} ms"
        rtf = "n/a" if self.rtf is None else f"{self.rtf:.3f}"
        failed = "" if self.error is None else f"FAILED {self.error} | "
        return (f"{failed}TTFT {ms(self.ttft_s)} | TTFA {ms(self.ttfa_s)} | RTF {rtf} "
                f"| audio {self.audio_seconds:.2f} s | total {self.total_s:.2f} s | {self.responses} responses")


def error_code(error: Exception) -> str:
    """The Triton error code of a failed request: its gRPC status, else the code its message names
    (``error_tags``), else ``UNKNOWN``."""
    status = error.status() if isinstance(error, InferenceServerException) else None
    if status is None:
        return code_of(error.message() if isinstance(error, InferenceServerException) else str(error)) or "UNKNOWN"
    name = str(status).removeprefix("StatusCode.")
    return TRITON_ERROR_CODES.get(name, name)


class StreamError(InferenceServerException):
    """A request that failed: ``code`` (see ``error_code``) and ``result``, what arrived before the error (its
    summary names the failure)."""

    def __init__(self, cause: InferenceServerException, result: StreamResult):
        super().__init__(cause.message(), cause.status(), cause.debug_details())
        self.code = error_code(cause)
        self.result = result
        result.error = f"{self.code}: {self.message()}"

    def __str__(self) -> str:
        return f"{self.code}: {self.message()}"


def build_inputs(text: str, audio_in: np.ndarray | None = None, **scalars) -> list:
    """Client tensors for `omni`: TEXT, optional AUDIO_IN, and any of the optional scalar inputs
    (max_tokens=..., speaker=..., temperature=..., seed=..., return_audio=..., history=JSON text of the earlier
    turns, ...); None values are omitted."""
    return infer_inputs(request_arrays(text, audio_in, **scalars))


def request_arrays(text: str, audio_in: np.ndarray | None = None, **scalars) -> dict[str, np.ndarray]:
    """``build_inputs``' tensors as named numpy arrays (object arrays are BYTES)."""
    dtypes = {"MAX_TOKENS": np.int32, "MIN_TOKENS": np.int32, "TOP_K": np.int32, "MAX_AUDIO_FRAMES": np.int32,
              "MIN_AUDIO_FRAMES": np.int32, "SEED": np.int64, "TEMPERATURE": np.float32, "TOP_P": np.float32,
              "REPETITION_PENALTY": np.float32, "TALKER_REPETITION_PENALTY": np.float32, "RETURN_AUDIO": np.bool_,
              "IGNORE_EOS": np.bool_, "SEQUENTIAL": np.bool_, "SPEAKER": np.object_, "HISTORY": np.object_}
    tensors = {"TEXT": np.array([text.encode("utf-8")], dtype=np.object_)}
    if audio_in is not None:
        tensors["AUDIO_IN"] = np.asarray(audio_in, dtype=np.float32).reshape(-1)
    for key, value in scalars.items():
        name = key.upper()
        if name not in dtypes:
            raise ValueError(f"unknown input {key!r}; known: {sorted(dtypes)}")
        if value is not None:
            value = value.encode("utf-8") if isinstance(value, str) else value
            tensors[name] = np.array([value], dtype=dtypes[name])
    return tensors


def infer_inputs(arrays: dict[str, np.ndarray]) -> list:
    """gRPC InferInputs of named arrays (object arrays as BYTES): any model's inputs, e.g. the orchestrator's."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class OmniStreamClient:
    """One gRPC stream; ``stream()`` sends one request and gathers its responses as they arrive. The stream is
    reopened after a request that failed (the server closes it with the error) and for one with ``deadline_s``
    (which gets a stream of its own with that gRPC deadline)."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "omni"):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._stream_open = False
        self._awaiting = False  # a request was sent on the open stream and has not ended yet
        self._request_id: str | None = None  # the request in flight, for cancel()
        self._open_stream()

    def stream(self, text: str, audio_in: np.ndarray | None = None, *, timeout_s: float = 600.0,
               on_text: Callable[[str], None] | None = None, on_audio: Callable[[np.ndarray], None] | None = None,
               deadline_s: float | None = None, request_id: str | None = None, **scalars) -> StreamResult:
        return self.stream_inputs(build_inputs(text, audio_in, **scalars), timeout_s=timeout_s, on_text=on_text,
                                  on_audio=on_audio, deadline_s=deadline_s, request_id=request_id)

    def stream_inputs(self, inputs: list, *, timeout_s: float = 600.0,
                      on_text: Callable[[str], None] | None = None,
                      on_audio: Callable[[np.ndarray], None] | None = None,
                      deadline_s: float | None = None, request_id: str | None = None) -> StreamResult:
        """Send ready-made InferInputs (e.g. the orchestrator's, preprocessed client-side) and gather the stream.
        Raises ``StreamError`` when the request fails, DEADLINE_EXCEEDED when no response came for ``timeout_s``.
        ``request_id``: the request's id (default: a fresh one), which ``cancel`` names.

        ``deadline_s``: the request fails with DEADLINE_EXCEEDED after this many seconds (gRPC's deadline on its
        stream), and the server ends it (and frees its state) then too, even if this client disappears."""
        if deadline_s is not None:
            self._close_stream()
            self._open_stream(stream_timeout=deadline_s)
        elif not self._stream_open:
            self._open_stream()
        result = StreamResult()
        try:
            return self._gather(inputs, result, timeout_s, on_text, on_audio, deadline_s, request_id)
        except InferenceServerException as error:
            self._close_stream()  # the server ended it with the error (or it timed out): start afresh next time
            raise StreamError(error, result) from None
        finally:
            if deadline_s is not None:
                self._close_stream()

    def _gather(self, inputs: list, result: StreamResult, timeout_s: float, on_text, on_audio,
                deadline_s: float | None, request_id: str | None) -> StreamResult:
        request_id = self._request_id = request_id or uuid.uuid4().hex
        start = time.perf_counter()
        self._awaiting = True
        trace.event(request_id, "client.sent")
        try:
            self.client.async_stream_infer(self.model, inputs, request_id=request_id,
                                           enable_empty_final_response=True,
                                           parameters=None if deadline_s is None else {"deadline_s": deadline_s})
        except Exception:
            # a broken stream (server down, refused) reports its cause through the callback: raise that one
            try:
                _, cause = self._responses.get(timeout=1.0)
            except queue.Empty:
                cause = None
            if cause is None:
                raise
            raise cause from None
        while True:
            try:
                response, error = self._responses.get(timeout=timeout_s)
            except queue.Empty:
                result.total_s = time.perf_counter() - start
                with contextlib.suppress(InferenceServerException, TimeoutError):  # the server may be what hangs
                    self.cancel()  # giving up: the server must not keep generating for nobody
                raise InferenceServerException(f"no response from {self.model} for {timeout_s:g} s",
                                               status="StatusCode.DEADLINE_EXCEEDED") from None
            now = time.perf_counter() - start
            if error is not None:
                self._awaiting = False  # the server ended the stream with this error
                result.total_s = now
                if deadline_s is not None and error.status() == "StatusCode.DEADLINE_EXCEEDED":
                    raise InferenceServerException(f"deadline_s {deadline_s:g} s exceeded ({error.message()})",
                                                   status=error.status()) from None
                raise error
            result.responses += 1
            delta = text_delta(response)
            if delta:
                if result.ttft_s is None:
                    trace.event(request_id, "client.first_text")
                result.ttft_s = now if result.ttft_s is None else result.ttft_s
                result.text += delta
                if on_text:
                    on_text(delta)
            audio = response.as_numpy("AUDIO")
            if audio is not None and audio.size:
                if result.ttfa_s is None:
                    trace.event(request_id, "client.first_audio")
                result.ttfa_s = now if result.ttfa_s is None else result.ttfa_s
                chunk = audio.reshape(-1).astype(np.float32)
                result.audio_chunks.append(chunk)
                if on_audio:
                    on_audio(chunk)
            if response.get_response().parameters["triton_final_response"].bool_param:
                trace.event(request_id, "client.finished")  # ends the level's window in trace breakdowns
                self._awaiting = False
                result.total_s = now
                return result

    def cancel(self) -> None:
        """Cancel the request in flight (it then fails with CANCELLED). Closing the stream cancels what Triton has
        not scheduled yet; an ``omni`` request already inside the orchestrator is cancelled by a control request
        with its id (Triton does not pass an ensemble's cancellation to a step that is running)."""
        self._close_stream()
        if self._request_id is not None:
            send_cancel(self.client, self._request_id)
            self._request_id = None

    def close(self) -> None:
        self._close_stream()
        self.client.close()

    def _open_stream(self, stream_timeout: float | None = None) -> None:
        responses = self._responses = queue.Queue()  # a fresh queue: nothing of an earlier stream mixes in
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                 stream_timeout=stream_timeout, headers=GRPC_ERROR_HEADERS)
        self._stream_open = True

    def _close_stream(self) -> None:
        # Cancel only a stream whose request may still answer: a plain stop_stream() waits for every response,
        # forever when a request never ends (e.g. after stream() gave up waiting). A stream that is done (FINAL
        # received, or ended with an error) has nothing to cancel and is closed plainly. (Not the same as
        # ``_request_id``: cancel() closes the stream, which ends the gathering, before it sends the control
        # cancel by id.)
        if self._stream_open:
            self._stream_open = False
            self.client.stop_stream(cancel_requests=self._awaiting)
            self._awaiting = False

    def __enter__(self) -> "OmniStreamClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def send_cancel(client, request_id: str, timeout_s: float = 10.0) -> None:
    """Ask the orchestrator to cancel request ``request_id`` (a control request on a stream of its own)."""
    import tritonclient.grpc as grpcclient

    done: queue.Queue = queue.Queue()
    control = grpcclient.InferInput("CONTROL", [1], "BYTES")
    control.set_data_from_numpy(np.array([b"cancel"], dtype=np.object_))
    client.start_stream(callback=lambda result, error: done.put(error))
    try:
        client.async_stream_infer("orchestrator", [control], request_id=request_id, enable_empty_final_response=True)
        try:
            error = done.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the orchestrator did not answer the cancel of {request_id} in {timeout_s:.0f} s") \
                from None
        if error is not None:
            raise error
    finally:
        client.stop_stream(cancel_requests=True)


def text_delta(response) -> str:
    text = response.as_numpy("TEXT_DELTA")
    if text is None or text.size == 0:
        return ""
    value = text.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


# -- WAV files ------------------------------------------------------------------------------------

def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 16-bit little-endian PCM (clipped, rounded)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")


def write_wav(path: str | Path | BinaryIO, audio: np.ndarray, sample_rate: int = OUTPUT_SAMPLE_RATE) -> None:
    """16-bit mono WAV to a path or a binary file object."""
    with wave.open(path if hasattr(path, "write") else str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(to_pcm16(audio).tobytes())


def read_wav(path: str | Path | BinaryIO, sample_rate: int = INPUT_SAMPLE_RATE) -> np.ndarray:
    """A PCM WAV file (a path or a binary file object) as float32 mono at ``sample_rate`` (channels averaged,
    linear resampling). Raises ValueError for what is not a PCM WAV."""
    try:
        return _read_wav(path, sample_rate)
    except (wave.Error, EOFError) as error:
        raise ValueError(f"{path}: not a PCM WAV file ({error})") from None


def _read_wav(path: str | Path | BinaryIO, sample_rate: int) -> np.ndarray:
    with wave.open(path if hasattr(path, "read") else str(path), "rb") as source:
        width, channels, rate = source.getsampwidth(), source.getnchannels(), source.getframerate()
        raw = source.readframes(source.getnframes())
    if width == 1:
        audio = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = "<i2" if width == 2 else "<i4"
        audio = np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    else:
        raise ValueError(f"{path}: {8 * width}-bit WAV is not supported (use 8, 16 or 32-bit PCM)")
    audio = audio.reshape(-1, channels).mean(axis=1)
    return resample(audio, rate, sample_rate)


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate == to_rate or audio.size == 0:
        return audio.astype(np.float32)
    duration = audio.size / from_rate
    target = np.arange(int(round(duration * to_rate))) / to_rate
    return np.interp(target, np.arange(audio.size) / from_rate, audio).astype(np.float32)


# -- command line -----------------------------------------------------------------------------------

def add_request_arguments(parser: argparse.ArgumentParser, seed_default: int | None = None) -> None:
    """The request inputs as options; the help states each one's meaning and default (README: request inputs)."""
    request = parser.add_argument_group("request (omni inputs; absent: the server's default)")
    request.add_argument("--speaker", help="SPEAKER: chelsie | ethan | aiden (default: ethan)")
    request.add_argument("--max-tokens", type=int, help="MAX_TOKENS: thinker tokens at most (default: 256)")
    request.add_argument("--temperature", type=float,
                         help="TEMPERATURE: thinker sampling temperature; 0 = greedy thinker and talker (the "
                              "talker's repetition penalty still applies: set it to 1.0 for transformers' plain "
                              "greedy); "
                              "default: the checkpoint's generation_config.json, else 0.7. A sampling talker uses "
                              "transformers' talker defaults (temperature 0.9, top-k 50)")
    request.add_argument("--repetition-penalty", type=float,
                         help="REPETITION_PENALTY: the thinker's (default: generation_config.json, else 1.0, "
                              "transformers' generate() default for the thinker)")
    request.add_argument("--talker-repetition-penalty", type=float,
                         help="TALKER_REPETITION_PENALTY: the talker's (default: 1.05, transformers' generate "
                              "default talker_repetition_penalty)")
    request.add_argument("--max-audio-frames", type=int,
                         help="MAX_AUDIO_FRAMES: codec frames at most, 12.5 per second of audio (default 0: until "
                              "the talker stops). N frames = N + 1 talker tokens in transformers' "
                              "talker_max_new_tokens: the talker's EOS step yields no frame")
    seed_help = "SEED: same seed, same output; -1 = a fresh random seed"
    request.add_argument("--seed", type=int, default=seed_default,
                         help=f"{seed_help} (default: {seed_default if seed_default is not None else -1})")
    request.add_argument("--text-only", action="store_true", help="RETURN_AUDIO=false: text only (default: off)")
    request.add_argument("--audio-in", type=Path,
                         help="AUDIO_IN: spoken input, a WAV file, resampled to 16 kHz (default: none)")


def request_scalars(args: argparse.Namespace) -> dict:
    return dict(speaker=args.speaker, max_tokens=args.max_tokens, temperature=args.temperature,
                repetition_penalty=args.repetition_penalty, talker_repetition_penalty=args.talker_repetition_penalty,
                max_audio_frames=args.max_audio_frames, seed=args.seed,
                return_audio=False if args.text_only else None)


def run_request(url: str, text: str, args: argparse.Namespace, out: Path | None) -> StreamResult:
    """Stream one request, printing text as it arrives, then its summary (a failure's too, with its error code,
    before the StreamError is raised on); Ctrl-C cancels it on the server."""
    audio_in = read_wav(args.audio_in) if args.audio_in else None
    client = OmniStreamClient(url)
    try:
        result = client.stream(text, audio_in, on_text=lambda delta: print(delta, end="", flush=True),
                               **request_scalars(args))
    except KeyboardInterrupt:
        client.cancel()
        print("\ncancelled", file=sys.stderr)
        raise
    except StreamError as error:
        print()
        print(error.result.summary(), file=sys.stderr)
        raise
    finally:
        client.close()
    print()
    if out is not None and not args.text_only:
        write_wav(out, result.audio)
        print(f"wrote {out} ({result.audio_seconds:.2f} s at {OUTPUT_SAMPLE_RATE} Hz)")
    print(result.summary())
    return result


def machine_description() -> str:
    """The machine this process runs on, for numbers quoted with it: OS, CPU model, cores, memory."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    memory_text = f", {memory:.0f} GiB memory" if memory else ""
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{memory_text}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream one request to the omni model and save the audio.")
    parser.add_argument("text", nargs="?", default="", help="user text (may be empty with --audio-in)")
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC address (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out.wav"), help="WAV to write (default: %(default)s)")
    add_request_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_request(args.url, args.text, args, args.out)
    except KeyboardInterrupt:
        return 130
    except InferenceServerException as error:
        print(f"request failed: {error}", file=sys.stderr)
        return 1
    return 0
