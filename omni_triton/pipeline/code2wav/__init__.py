"""Audio out of codec frames, stream by stream: chunking with left context (chunking.py), chunk sizes that follow
the stream (pacing.py), the code2wav stage's per-stream vocoder states (stream_states.py) and its warm start
(warmup.py). The vocoder itself is ``omni_triton.models.code2wav``."""
