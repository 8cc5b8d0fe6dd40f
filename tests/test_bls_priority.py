"""A stream's first code2wav chunk, and an urgent one (its listener has little audio left), go ahead of the other
chunks queued at the stage: the orchestrator's BLS clients send them with the parameter "priority": 1 (omni_triton/stages/bls_clients.py), the code2wav config has two
priority levels, and the patched backend turns the parameter into the request's priority
(tests/test_python_backend.py::test_a_bls_request_with_priority_1_is_served_before_the_queued_default_ones shows
that a real tritonserver then serves it first)."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_triton.stages.bls_clients import AHEAD_PRIORITY, BlsStageClients


class _Tensor:
    """pb_utils.Tensor as the clients use it: a name and a value, to and from DLPack."""

    def __init__(self, name: str, value):
        self._name, self.value = name, value

    def name(self) -> str:
        return self._name

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(torch.as_tensor(self.value))

    @classmethod
    def from_dlpack(cls, name: str, capsule):
        return cls(name, torch.utils.dlpack.from_dlpack(capsule))


class _Response:
    def has_error(self) -> bool:
        return False

    def output_tensors(self) -> list[_Tensor]:
        return [_Tensor("AUDIO", torch.zeros(1920))]


class _FakePbUtils:
    """The part of triton_python_backend_utils the code2wav calls touch; every request is kept."""
    TRITONSERVER_MEMORY_CPU, TRITONSERVER_MEMORY_GPU = 0, 1
    Tensor = _Tensor

    def __init__(self):
        self.requests: list[dict] = []
        pb = self

        class InferenceRequest:
            def __init__(self, **kwargs):
                pb.requests.append(kwargs)

            def exec(self, decoupled: bool = False):
                assert decoupled
                return iter([_Response()])

        self.InferenceRequest = InferenceRequest

    @staticmethod
    def PreferredMemory(kind: int, device: int):
        return (kind, device)


def _priorities(pb: _FakePbUtils) -> list[int | None]:
    return [request["parameters"].get("priority") for request in pb.requests]


def test_a_streams_first_chunk_is_sent_ahead_and_the_rest_at_the_default():
    pb = _FakePbUtils()
    clients = BlsStageClients(pb, {}, gpu=None)
    codes = torch.zeros(16, 4, dtype=torch.int64)
    for first in (True, False, False):
        assert clients.code2wav_stream(codes, first=first).numel() == 1920
    clients.code2wav_close()  # STREAM_END alone: the default
    assert [request["model_name"] for request in pb.requests] == ["code2wav"] * 4
    assert _priorities(pb) == [AHEAD_PRIORITY, None, None, None]
    # every request still names its caller (callers.py), the priority beside it
    assert all(len(request["parameters"]) >= 1 for request in pb.requests)


def test_a_left_context_chunk_is_a_first_one_when_it_has_no_context():
    pb = _FakePbUtils()
    clients = BlsStageClients(pb, {}, gpu=None)
    codes = torch.zeros(16, 29, dtype=torch.int64)
    clients.code2wav(codes[:, :4], left_context_frames=0)
    clients.code2wav(codes, left_context_frames=25)
    assert _priorities(pb) == [AHEAD_PRIORITY, None]


def test_an_urgent_chunk_is_sent_ahead_on_either_path():
    pb = _FakePbUtils()
    clients = BlsStageClients(pb, {}, gpu=None)
    codes = torch.zeros(16, 29, dtype=torch.int64)
    clients.code2wav_stream(codes[:, :4], first=True)
    clients.code2wav_stream(codes[:, :8], first=False, urgent=True)
    clients.code2wav_stream(codes[:, :8], first=False)
    clients.code2wav(codes, left_context_frames=25, urgent=True)
    assert _priorities(pb) == [AHEAD_PRIORITY, AHEAD_PRIORITY, None, AHEAD_PRIORITY]


def test_the_code2wav_config_has_the_two_priority_levels_the_first_chunk_uses():
    config = (Path(__file__).resolve().parents[1] / "model_repository" / "code2wav" / "config.pbtxt").read_text()
    batching = next(line for line in config.splitlines() if line.startswith("dynamic_batching"))
    assert "priority_levels: 2" in batching and "default_priority_level: 2" in batching
    assert AHEAD_PRIORITY == 1  # the highest of the two levels (0 would mean the default)
