"""Realtime voice latency through `/v1/realtime` (issue 45): end of the user's speech to the reply's first audio
delta, and barge-in time (speech over a reply to its cancel reaching every stage).

Each session speaks like a person: the utterance (espeak-ng, or --wav) is sent paced in real time in 20 ms
chunks, followed by silence until the reply ends, so the server's VAD ends the turn as it would live. Per turn:
- `speech_end_to_audio_ms`: the first audio delta after the speech's end (VAD's audio_end_ms on the paced
  timeline); the VAD's silence wait (`--silence-ms`) is part of it (target: <= silence + 150 ms);
- `stopped_event_to_audio_ms`: the same from the arrival of `input_audio_buffer.speech_stopped`.
Barge-in (one session, alone on the server): a long reply is started, and at its first audio delta the
utterance is spoken over it. From the arrival of `speech_started`: `barge_in_done_ms` to the reply's
`response.done` (cancelled) and, with --metrics-url, `barge_in_idle_ms` to every stage gauge
(omni_active_requests, omni_kv_blocks_used, omni_pending_audio_frames) reading zero (target: <= 150 ms).

    omni-triton serve &  omni-triton api --checkpoint CKPT &
    python benchmarks/realtime_latency.py --api-url http://127.0.0.1:9000 --metrics-url \\
        http://127.0.0.1:8002/metrics --sessions 1,16 --out benchmarks/results/cpu-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_triton.client import read_wav, resample  # noqa: E402

CHUNK_MS = 20
UTTERANCE = "Hello there, what is the weather like in Paris today?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api-url", default="http://127.0.0.1:9000", help="the API (default: %(default)s)")
    parser.add_argument("--metrics-url", help="Triton's metrics endpoint, for the barge-in's stage-idle time")
    parser.add_argument("--model", default="omni", help="the served model (default: %(default)s)")
    parser.add_argument("--sessions", default="1", help="comma-separated concurrent sessions (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="spoken turns per session (default: %(default)s)")
    parser.add_argument("--barge-ins", type=int, default=3, help="barge-in trials, one session (default: %(default)s)")
    parser.add_argument("--silence-ms", type=int, default=500, help="VAD silence_duration_ms (default: %(default)s)")
    parser.add_argument("--max-output-tokens", type=int, default=16,
                        help="reply length of the spoken turns (default: %(default)s)")
    parser.add_argument("--wav", type=Path, help="the utterance (default: espeak-ng speaking a sentence)")
    parser.add_argument("--out", type=Path, help="directory for realtime_latency.json (default: print only)")
    return parser.parse_args(argv)


def utterance_pcm(wav: Path | None) -> bytes:
    """The utterance as 24 kHz PCM16."""
    if wav is None:
        with tempfile.TemporaryDirectory() as folder:
            wav = Path(folder) / "utterance.wav"
            subprocess.run(["espeak-ng", "-w", str(wav), UTTERANCE], check=True)
            audio = read_wav(wav)
    else:
        audio = read_wav(wav)
    audio = resample(audio, 16000, 24000)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


class Session:
    """One WebSocket; events are timestamped as they arrive; audio is sent on a real-time clock."""

    def __init__(self, socket):
        self.socket, self.events, self.arrived = socket, asyncio.Queue(), asyncio.Event()
        self.audio_t0: float | None = None  # wall time of the session's first input sample
        self.sent_ms = 0
        self.opened_at = time.perf_counter()
        # every event but the deltas, (ms since the socket opened, type, what says why): the report keeps the
        # first session's, so a turn that went wrong can be read back event by event
        self.timeline: list[tuple[int, str, object]] = []

    async def receive(self) -> None:
        async for message in self.socket:
            at, event = time.perf_counter(), json.loads(message)
            if not event["type"].endswith(".delta"):
                why = event.get("response", {}).get("status_details") or event.get("error") \
                    or event.get("audio_start_ms", event.get("audio_end_ms"))
                self.timeline.append((round((at - self.opened_at) * 1000), event["type"], why))
            await self.events.put((at, event))

    async def until(self, kinds: str | tuple[str, ...], timeout_s: float = 300) -> tuple[float, dict]:
        """(arrival time, event) of the next event of ``kinds``; the events before it are dropped."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        async with asyncio.timeout(timeout_s):
            while True:
                at, event = await self.events.get()
                if event["type"] == "error":
                    raise RuntimeError(f"error event: {event['error']}")
                if event["type"] in kinds:
                    return at, event

    async def speak(self, pcm: bytes, stop: asyncio.Event | None = None) -> None:
        """Send ``pcm`` paced in real time (silence after it while ``stop`` is not set)."""
        step = 24000 * 2 * CHUNK_MS // 1000
        silence = bytes(step)
        if self.audio_t0 is None:
            self.audio_t0 = time.perf_counter()
        offset = 0
        while offset < len(pcm) or (stop is not None and not stop.is_set()):
            chunk = pcm[offset:offset + step] if offset < len(pcm) else silence
            offset += step
            wait = self.audio_t0 + self.sent_ms / 1000 - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.socket.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(chunk).decode()}))
            self.sent_ms += CHUNK_MS

    def wall_of(self, audio_ms: int) -> float:
        return self.audio_t0 + audio_ms / 1000


async def open_session(args, turn_detection: dict, max_output_tokens: int):
    import websockets

    url = args.api_url.replace("http", "ws", 1) + f"/v1/realtime?model={args.model}"
    socket = await websockets.connect(url, max_size=None)
    session = Session(socket)
    receiver = asyncio.create_task(session.receive())
    await socket.send(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": turn_detection}}, "max_output_tokens": max_output_tokens}}))
    await session.until("session.updated")
    return session, receiver


async def spoken_turns(args, pcm: bytes, timelines: list) -> list[dict]:
    vad = {"type": "server_vad", "silence_duration_ms": args.silence_ms}
    session, receiver = await open_session(args, vad, args.max_output_tokens)
    timelines.append(session.timeline)
    turns = []
    try:
        for _ in range(args.turns):
            reply_done = asyncio.Event()
            speaking = asyncio.create_task(session.speak(pcm, stop=reply_done))
            stopped_at, stopped = await session.until("input_audio_buffer.speech_stopped")
            audio_at, done = None, None
            while done is None:  # a reply may end without audio (a random-weight talker can stop at once)
                at, event = await session.until(("response.output_audio.delta", "response.done"))
                if event["type"] == "response.done":
                    done = event["response"]
                elif audio_at is None:
                    audio_at = at
            reply_done.set()
            await speaking
            if audio_at is None or done["status"] != "completed":  # with why: a cancel's reason, a failure's error
                turns.append({"no_audio": done["status"], "details": done.get("status_details"),
                              "had_audio": audio_at is not None})
                continue
            turns.append({"speech_end_to_audio_ms": (audio_at - session.wall_of(stopped["audio_end_ms"])) * 1000,
                          "stopped_event_to_audio_ms": (audio_at - stopped_at) * 1000})
    finally:
        await session.socket.close()
        receiver.cancel()
    return turns


async def barge_ins(args, pcm: bytes) -> list[dict]:
    vad = {"type": "server_vad", "silence_duration_ms": args.silence_ms, "create_response": False}
    trials = []
    for _ in range(args.barge_ins):
        session, receiver = await open_session(args, vad, 2048)
        try:
            await session.socket.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}}))
            await session.socket.send(json.dumps({"type": "response.create"}))
            await session.until("response.output_audio.delta")
            speaking = asyncio.create_task(session.speak(pcm))
            started_at, done = await session.until(("input_audio_buffer.speech_started", "response.done"))
            idle, heard = None, done["type"] != "response.done"  # heard: while the reply was being made
            if heard:
                if args.metrics_url:
                    idle = asyncio.create_task(asyncio.to_thread(wait_idle, args.metrics_url))
                done_at, done = await session.until("response.done")
            if not heard or done["response"]["status"] != "cancelled":  # the reply was whole before the speech cut it
                trials.append({"reply_ended_first": done["response"]["status"]})
                if idle is not None:
                    await idle
                await speaking
                continue
            trial = {"barge_in_done_ms": (done_at - started_at) * 1000}
            if idle is not None:
                trial["barge_in_idle_ms"] = (await idle - started_at) * 1000
            trials.append(trial)
            await speaking
        finally:
            await session.socket.close()
            receiver.cancel()
    return trials


def wait_idle(metrics_url: str, timeout_s: float = 60.0) -> float:
    """Poll the stage gauges until none holds a request, KV blocks or audio frames; the wall time then."""
    import re
    import urllib.request

    held = ("omni_active_requests", "omni_kv_blocks_used", "omni_pending_audio_frames")
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        values = [float(v) for name, v in re.findall(r'^(omni_\w+)\{stage="\w+"\} (\S+)$', text, re.M)
                  if name in held]
        if values and not any(values):
            return time.perf_counter()
        time.sleep(0.005)
    raise TimeoutError(f"stages still busy after {timeout_s} s")


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": statistics.median(values), "max": max(values)} if values else {"n": 0}


async def main_async(args) -> dict:
    pcm = utterance_pcm(args.wav)
    # the host's load when the run began: on a shared CPU machine other jobs' work is in every number
    result = {"silence_ms": args.silence_ms, "max_output_tokens": args.max_output_tokens,
              "load_average_1m": os.getloadavg()[0], "levels": {}}
    for level in [int(n) for n in args.sessions.split(",")]:
        timelines: list = []
        per_session = await asyncio.gather(*(spoken_turns(args, pcm, timelines) for _ in range(level)))
        turns = [turn for session in per_session for turn in session]
        result["levels"][level] = {key: summary([t[key] for t in turns if key in t])
                                   for key in ("speech_end_to_audio_ms", "stopped_event_to_audio_ms")}
        result["levels"][level]["turns_without_audio"] = [
            {key: t[key] for key in ("no_audio", "details", "had_audio")} for t in turns if "no_audio" in t]
        printed = dict(result["levels"][level])
        result["levels"][level]["first_session_timeline"] = timelines[0]
        print(f"{level} sessions: {json.dumps(printed)}", flush=True)
        write(args.out, result)  # level by level: a run cut short keeps what it measured
    if args.barge_ins:
        trials = await barge_ins(args, pcm)
        result["barge_in"] = {key: summary([t[key] for t in trials if key in t])
                              for key in ("barge_in_done_ms", "barge_in_idle_ms")}
        result["barge_in"]["replies_ended_before_the_speech"] = [t["reply_ended_first"] for t in trials
                                                                 if "reply_ended_first" in t]
        print(f"barge-in: {json.dumps(result['barge_in'])}", flush=True)
    return result


def write(out: Path | None, result: dict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "realtime_latency.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write(args.out, asyncio.run(main_async(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
