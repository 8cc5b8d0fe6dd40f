"""OpenAI-compatible HTTP API in front of a running tritonserver (``omni-triton api``).

Layers, bottom-up: ``errors`` (OpenAI error objects), ``schema`` (request bodies), ``prompt`` (messages ->
the ``omni`` model's inputs), ``encoding`` (PCM16, WAV, SSE), ``usage`` (token counts), ``bridge`` (the gRPC
stream to Triton), ``realtime`` (the Realtime WebSocket: its events, sessions, conversations and VAD), ``app``
(the routes).
"""
