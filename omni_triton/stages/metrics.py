"""Prometheus gauges on Triton's metrics port (8002), one set per stage.

Each stage reports a snapshot of its own state (engine stats, sessions in flight) every
``interval_s`` from a small daemon thread, so no request path pays for metrics (only the values that changed:
see ``StageMetrics.update``). Names:

    omni_active_requests{stage}      requests the stage holds (running + waiting + waiting for input)
    omni_waiting_requests{stage}     requests queued for admission (engine waiting queue)
    omni_waiting_for_input{stage}    talker requests waiting for thinker text
    omni_kv_blocks_used{stage}       paged-KV blocks held
    omni_kv_blocks_free{stage}       paged-KV blocks free (named blocks of the prefix cache nobody holds count as free)
  prefix caching (--prefix-caching; docs/prefix_caching.md; cumulative but the blocks):
    omni_prefix_cache_query_tokens{stage}  inputs of the requests the engine admitted
    omni_prefix_cache_hit_tokens{stage}    of those, taken from the prefix cache instead of computed
    omni_prefix_cache_hit_rate{stage}      hit tokens / query tokens (0 before any)
    omni_prefix_cache_blocks{stage}        KV blocks named in the prefix cache now (held or not)
    omni_prefix_cache_evictions{stage}     named blocks evicted for new ones
    omni_pending_audio_frames{stage} codec frames received but not yet decoded (orchestrator)
  admission (orchestrator; docs/load.md):
    omni_admission_queue_length{stage}          requests waiting for admission now
    omni_admission_waited_requests{stage}       requests started after waiting (cumulative)
    omni_admission_wait_seconds{stage}          their waits, summed (cumulative; / waited = mean wait)
    omni_admission_refused_requests{stage}      requests refused with UNAVAILABLE (cumulative)
    omni_admission_expected_wait_seconds{stage} expected wait of a request that queued now, learned from the starts
                                                out of the queue, before that from recent streams' lifetimes and
                                                starts (0: it would start at once, or nothing is learned yet)
    omni_realtime_capacity_audio_s_per_s{stage} estimated audio-seconds per second at the running streams
                                                (0: admission by real-time capacity is off)
  GPU memory of the orchestrator's own process (on a GPU only; torch's caching allocator, ``torch_memory_gauges``):
    omni_gpu_memory_allocated_bytes{stage}  held by live tensors: grows with requests when their tensors leak
    omni_gpu_memory_reserved_bytes{stage}   reserved by the allocator (live + cached): what nvidia-smi sees of it

A stage with several instances (``serve --instances``) labels each replica's series ``model_instance`` too, and a
stage of one of several pipelines (``serve --pipelines``) ``pipeline``: the orchestrator too, one instance per
pipeline, each reporting its own pipeline's streams, pending frames and admission. The server's totals are
``sum(omni_active_requests{stage="orchestrator"})`` (and so on): one series with one pipeline, one per pipeline
with several.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

GAUGES = {
    "omni_active_requests": "Requests the stage currently holds",
    "omni_waiting_requests": "Requests queued for admission to the stage's engine",
    "omni_waiting_for_input": "Talker requests waiting for thinker text",
    "omni_kv_blocks_used": "Paged KV-cache blocks in use",
    "omni_kv_blocks_free": "Paged KV-cache blocks free",
    "omni_prefix_cache_query_tokens": "Inputs of the requests the engine admitted (cumulative)",
    "omni_prefix_cache_hit_tokens": "Admitted inputs taken from the prefix cache (cumulative)",
    "omni_prefix_cache_hit_rate": "Prefix-cache hit tokens / query tokens",
    "omni_prefix_cache_blocks": "KV blocks named in the prefix cache",
    "omni_prefix_cache_evictions": "Prefix-cache blocks evicted for new ones (cumulative)",
    "omni_pending_audio_frames": "Codec frames received but not yet decoded to audio",
    "omni_admission_queue_length": "Requests waiting for admission",
    "omni_admission_waited_requests": "Requests started after waiting for admission (cumulative)",
    "omni_admission_wait_seconds": "Seconds requests waited for admission, summed (cumulative)",
    "omni_admission_refused_requests": "Requests refused with UNAVAILABLE by admission (cumulative)",
    "omni_admission_expected_wait_seconds": "Expected wait for admission of a request queued now (0: none or unknown)",
    "omni_realtime_capacity_audio_s_per_s": "Estimated audio-seconds per second at the running streams (0: off)",
    "omni_gpu_memory_allocated_bytes": "GPU memory held by this stage process's live tensors (torch)",
    "omni_gpu_memory_reserved_bytes": "GPU memory torch's allocator reserved in this stage process (live + cached)",
}


def torch_memory_gauges(gpu: int | None) -> dict[str, float]:
    """What torch's caching allocator of this process holds on ``gpu`` (None: a CPU deployment, no gauges). Next to
    nvidia-smi's per-process figure it tells a leak (allocated grows) from the allocator's cache (only reserved
    grows) from memory outside torch (neither grows: CUDA context, IPC mappings)."""
    if gpu is None:
        return {}
    import torch  # the stages that report these run torch anyway; the metrics module itself does not need it

    return {"omni_gpu_memory_allocated_bytes": torch.cuda.memory_allocated(gpu),
            "omni_gpu_memory_reserved_bytes": torch.cuda.memory_reserved(gpu)}


def engine_snapshot(stats: Any, extra_active: int = 0) -> dict[str, float]:
    """An EngineStats as gauge values (``extra_active``: requests held outside the engine)."""
    queried = stats.prefix_query_tokens
    return {
        "omni_active_requests": stats.num_running + stats.num_waiting + stats.num_waiting_for_input + extra_active,
        "omni_waiting_requests": stats.num_waiting,
        "omni_waiting_for_input": stats.num_waiting_for_input,
        "omni_kv_blocks_used": stats.kv_blocks_used,
        "omni_kv_blocks_free": stats.kv_blocks_free,
        "omni_prefix_cache_query_tokens": stats.prefix_query_tokens,
        "omni_prefix_cache_hit_tokens": stats.prefix_hit_tokens,
        "omni_prefix_cache_hit_rate": stats.prefix_hit_tokens / queried if queried else 0.0,
        "omni_prefix_cache_blocks": stats.prefix_cached_blocks,
        "omni_prefix_cache_evictions": stats.prefix_evictions,
    }


def release_metrics(metrics: dict, families: dict) -> None:
    """Drop pb_utils metrics, then their families, while the model's stub still runs (from finalize).

    A metric or family that Python frees later (in the interpreter's final garbage collection, when a
    reference cycle held it) tells a stub that no longer exists: python_backend r26.07 then creates a new,
    empty stub object and segfaults on its missing shared memory, at every shutdown."""
    metrics.clear()
    families.clear()


class StageMetrics:
    def __init__(self, pb_utils: Any, stage: str, snapshot: Callable[[], dict[str, float]],
                 interval_s: float = 0.1, labels: dict[str, str] | None = None):
        """``labels``: more labels beside ``stage`` (a replica's ``model_instance`` or ``pipeline``,
        ``model_args.replica_labels``, ``model_args.instance_pipeline``)."""
        self._snapshot = snapshot
        self._interval_s = interval_s
        names = set(snapshot())
        # families are process-wide in the stub; keep them alive as long as their metrics
        self._families = {name: pb_utils.MetricFamily(name=name, description=GAUGES[name],
                                                      kind=pb_utils.MetricFamily.GAUGE) for name in sorted(names)}
        labels = {"stage": stage, **(labels or {})}
        self._gauges = {name: family.Metric(labels=labels) for name, family in self._families.items()}
        self._set_values: dict[str, float] = {}  # what each gauge was last set to (update skips the same again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{stage}-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.update()

    def update(self) -> None:
        """Set the gauges whose value changed since the last update. A ``set`` is a round trip to tritonserver;
        python_backend r26.07 made it holding the stub's GIL, stalling every other thread of the stage meanwhile
        (our backend build releases it: python_backend-metric-set-without-gil.patch; another build still holds
        it), and most gauges stay put between updates, so most of those round trips are skipped."""
        for name, value in self._snapshot().items():
            if self._set_values.get(name) != float(value):
                self._gauges[name].set(float(value))
                self._set_values[name] = float(value)

    def stop(self) -> None:
        """Last update, then release the metrics: call from the model's finalize (see ``release_metrics``)."""
        self._stop.set()
        self._thread.join()
        self.update()
        release_metrics(self._gauges, self._families)


class HostHopCounter:
    """Counts inter-stage tensors that arrived in host memory although the stages run on a GPU.

    On a GPU deployment every stage-to-stage tensor (thinker states, codec frames, audio) must stay in
    device memory; ``omni_interstage_host_tensors_total{stage}`` stays 0 when they do. On a CPU
    deployment host memory is where they belong, so nothing is counted.
    """

    def __init__(self, pb_utils: Any, stage: str, on_gpu: bool, labels: dict[str, str] | None = None):
        self.on_gpu = on_gpu
        self._family = pb_utils.MetricFamily(
            name="omni_interstage_host_tensors_total",
            description="Inter-stage tensors received in host memory on a GPU deployment (should be 0)",
            kind=pb_utils.MetricFamily.COUNTER)
        self._counter = self._family.Metric(labels={"stage": stage, **(labels or {})})

    def close(self) -> None:
        """Release the counter: call from the model's finalize (see ``release_metrics``)."""
        release_metrics({"counter": self._counter}, {"family": self._family})
        del self._counter, self._family

    def check(self, *tensors: Any) -> None:
        """``tensors``: pb_utils.Tensor objects that came from another stage."""
        if self.on_gpu:
            hops = sum(1 for tensor in tensors if tensor.is_cpu() and 0 not in tensor.shape())
            if hops:
                self._counter.increment(hops)
