"""StageMetrics sets a gauge only when its value changed: each set is a round trip to tritonserver that holds the
stage's GIL (the gauges themselves are checked on a real server in tests/test_server_pipeline.py)."""

from __future__ import annotations

import torch

from omni_triton.stages.metrics import StageMetrics, torch_memory_gauges


class RecordingPbUtils:
    """The two pb_utils metric types StageMetrics uses, recording every ``set``."""

    def __init__(self):
        self.sets: list[tuple[str, float]] = []
        recording = self

        class Metric:
            def __init__(self, name):
                self.name = name

            def set(self, value):
                recording.sets.append((self.name, value))

        class MetricFamily:
            GAUGE = "gauge"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 (pb_utils' name)
                return Metric(self.name)

        self.MetricFamily = MetricFamily


def test_only_the_gauges_that_changed_are_set_again():
    pb = RecordingPbUtils()
    snapshot = {"omni_active_requests": 3, "omni_pending_audio_frames": 0}
    metrics = StageMetrics(pb, "orchestrator", lambda: dict(snapshot), interval_s=3600)  # updates only when told
    try:
        metrics.update()
        assert sorted(pb.sets) == [("omni_active_requests", 3.0), ("omni_pending_audio_frames", 0.0)]
        pb.sets.clear()
        metrics.update()
        assert pb.sets == []
        snapshot["omni_pending_audio_frames"] = 7
        metrics.update()
        assert pb.sets == [("omni_pending_audio_frames", 7.0)]
    finally:
        metrics.stop()


def test_the_orchestrators_gpu_memory_gauges_report_torchs_allocator_on_a_gpu_only(monkeypatch):
    """No GPU here: torch's two counters stand in (what they count is torch's business); what is checked is that the
    gauges exist on a GPU only, carry the allocator's numbers of the pipeline's GPU, and are families StageMetrics
    can register (described in GAUGES)."""
    assert torch_memory_gauges(None) == {}
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda gpu: asked.append(gpu) or 3 << 20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda gpu: asked.append(gpu) or 8 << 20)
    pb = RecordingPbUtils()
    metrics = StageMetrics(pb, "orchestrator", lambda: torch_memory_gauges(1), interval_s=3600)
    try:
        metrics.update()
        assert sorted(pb.sets) == [("omni_gpu_memory_allocated_bytes", float(3 << 20)),
                                   ("omni_gpu_memory_reserved_bytes", float(8 << 20))]
        assert set(asked) == {1}
    finally:
        metrics.stop()
