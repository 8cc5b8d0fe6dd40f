"""StageMetrics sets a gauge only when its value changed: each set is a round trip to tritonserver that holds the
stage's GIL (the gauges themselves are checked on a real server in tests/test_server_pipeline.py)."""

from __future__ import annotations

from omni_triton.stages.metrics import StageMetrics


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
