"""The mark of the progress lines each stage prints to the server log while it warms up (``engine.warmup``,
``pipeline.code2wav.warmup``); `omni-triton serve` echoes the log's lines that carry it while it waits for ready.
Torch-free, so the CLI can import it without loading torch."""

PROGRESS_MARK = "warm-up"
