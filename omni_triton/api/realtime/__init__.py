"""The OpenAI Realtime API (``/v1/realtime``, a WebSocket): a spoken conversation with the ``omni`` model, with
server-side turn detection, barge-in and the conversation's history in every turn's prompt.

events.py: the client events taken and the server events sent; session.py: a session's settings; limits.py:
the server's limits on a session;
conversation.py: its items and how they become the next turn's prompt; audio.py: the input audio buffer;
vad.py: turn detection (silero-vad); connection.py: one WebSocket's event loop and its responses.
"""
