"""The realtime endpoint's pure logic: input audio at 16 kHz, the VAD's turn boundaries on synthesized speech,
session updates, a conversation's prompt and truncation. The endpoint itself: tests/test_realtime_api.py."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from omni_triton.api.errors import ApiError
from omni_triton.api.realtime.audio import InputAudioBuffer, decode_pcm16
from omni_triton.api.realtime.conversation import Conversation, ConversationItem, spoken_text
from omni_triton.api.realtime.events import Session, parse_client_event
from omni_triton.api.realtime.session import merged, response_settings, updated_session
from omni_triton.client import read_wav, resample


def test_input_audio_converted_chunk_by_chunk_equals_the_whole_stream():
    audio = np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1
    buffer = InputAudioBuffer(max_seconds=10)
    pieces, at = [], 0
    for size in [100, 7, 2000, 1, 3000, 13] * 3:
        pieces.append(buffer.append(audio[at:at + size]))
        at += size
    whole = resample(audio[:at - at % 3], 24000, 16000)
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-6)
    assert buffer.end_ms == whole.size * 1000 // 16000


def test_input_audio_take_keep_last_and_limit():
    buffer = InputAudioBuffer(max_seconds=1)
    buffer.append(np.zeros(24000 // 2, np.float32))  # 500 ms
    buffer.keep_last(200)
    assert (buffer.start, buffer.duration_ms, buffer.end_ms) == (8000 - 3200, 200, 500)
    buffer.append(np.ones(2400, np.float32))  # 100 ms more
    assert buffer.take(from_ms=450).size == 150 * 16 and buffer.duration_ms == 0 and buffer.end_ms == 600
    with pytest.raises(ApiError) as full:
        buffer.append(np.zeros(2 * 24000, np.float32))
    assert full.value.code == "input_audio_buffer_full"
    with pytest.raises(ApiError) as odd:
        decode_pcm16("AAAA", "audio")  # 3 bytes
    assert odd.value.param == "audio"


def test_vad_finds_the_speech_in_silence(tmp_path):
    from omni_triton.api.realtime.vad import SpeechDetector, VadSettings

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it): no speech to detect")
    subprocess.run(["espeak-ng", "-w", str(tmp_path / "s.wav"), "Hello there, how are you today?"], check=True)
    speech = read_wav(tmp_path / "s.wav")
    audio = np.concatenate([np.zeros(16000, np.float32), speech, np.zeros(16000, np.float32)])
    detector = SpeechDetector(VadSettings(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500))
    events = [event for at in range(0, audio.size, 1600) for event in detector.feed(audio[at:at + 1600])]
    assert [e.kind for e in events] == ["started", "stopped"], events
    speech_ms = speech.size * 1000 // 16000
    assert 1000 - 300 - 64 <= events[0].ms <= 1000 - 300 + 300  # the onset, less the padding
    assert 1000 + speech_ms // 2 <= events[1].ms <= 1000 + speech_ms  # before espeak's trailing quiet ends
    assert not detector.feed(np.zeros(16000, np.float32)), "silence starts nothing"


def test_session_update_merges_and_refuses_by_field():
    session = updated_session(Session(), {"audio": {"output": {"voice": "chelsie"}}}, "omni")
    assert session.audio.output.voice == "chelsie" and session.audio.input.turn_detection.threshold == 0.5
    session = updated_session(session, {"audio": {"input": {"turn_detection": None}}}, "omni")
    assert session.audio.input.turn_detection is None and session.audio.output.voice == "chelsie"
    with pytest.raises(ApiError) as bad:
        updated_session(session, {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "omni")
    assert bad.value.param.startswith("session.audio.input.turn_detection")
    assert merged({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}
    options = parse_client_event({"type": "response.create", "response": {
        "instructions": "x", "output_modalities": ["text"], "audio": {"output": {"voice": "aiden"}}}}).response
    settings = response_settings(session, options)
    assert (settings.instructions, settings.audio_out, settings.voice) == ("x", False, "aiden")


def test_conversation_turn_and_history():
    conversation = Conversation(max_items=10)
    clip = np.ones(1600, np.float32)
    for item in (ConversationItem("u1", "user", text="Hi."), ConversationItem("a1", "assistant", text="Hello!"),
                 ConversationItem("u2", "user", audio=clip, audio_transcript="what time is it"),
                 ConversationItem("a2", "assistant", text="Noon."),
                 ConversationItem("u3", "user", text="And now?"), ConversationItem("u4", "user", audio=clip)):
        conversation.add(item)
    turn = conversation.turn("Be brief.")
    assert turn.text == "And now?" and turn.audio.size == 1600
    assert turn.history == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                            {"role": "assistant", "content": "Hello!"},
                            {"role": "user", "content": "what time is it"},
                            {"role": "assistant", "content": "Noon."}]
    conversation.add(ConversationItem("s1", "system", text="Speak French."), previous_item_id="u1")
    assert [item.id for item in conversation.items][:3] == ["u1", "s1", "a1"]
    conversation.delete("u3")
    conversation.delete("u4")
    with pytest.raises(ApiError) as nothing:
        conversation.turn("")
    assert nothing.value.code == "no_user_turn"
    with pytest.raises(ApiError) as duplicate:
        conversation.add(ConversationItem("u1", "user", text="again"))
    assert duplicate.value.param == "item.id"


def test_truncate_keeps_the_words_the_audio_spoke():
    conversation = Conversation(max_items=3)
    reply = ConversationItem("a", "assistant", text="one two three four", output_audio=True, audio_samples=24000)
    conversation.add(reply)
    conversation.truncate("a", 0, audio_end_ms=500)
    assert reply.text == "one two" and reply.audio_samples == 12000
    with pytest.raises(ApiError) as past:
        conversation.truncate("a", 0, audio_end_ms=600)
    assert past.value.param == "audio_end_ms"
    assert spoken_text("abc def", 0, 100) == "" and spoken_text("abc def", 100, 100) == "abc def"


def test_truncate_with_the_tokenizer_keeps_one_token_per_frame(tiny_checkpoint):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert spoken_text(text, 3 * 1920, 100 * 1920, tokenizer) == tokenizer.decode(ids[:3])
    assert spoken_text(text, 2 * 1920 + 1, 100 * 1920, tokenizer) == tokenizer.decode(ids[:3])
    assert spoken_text(text, len(ids) * 1920, len(ids) * 1920, tokenizer) == text


def test_a_cut_inside_a_character_keeps_the_text_before_it(tiny_checkpoint):
    """Byte-level tokens: a character may take two tokens, and the audio heard may end between them (CI found a
    cancelled reply's transcript ending in U+FFFD while the transcript deltas had the whole character)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    text = " whoas3\u00a43ten sound"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    split = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))  # inside the char
    heard = spoken_text(text, split * 1920, len(ids) * 1920, tokenizer)
    assert text.startswith(heard) and heard == tokenizer.decode(ids[:split - 1])
    assert "\ufffd" not in heard


def test_client_items_become_conversation_items():
    import base64

    from omni_triton.api.realtime.connection import _conversation_item
    from omni_triton.api.realtime.events import Item

    pcm = base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()  # 100 ms at 24 kHz
    user = _conversation_item(Item.model_validate({"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "listen:"}, {"type": "input_audio", "audio": pcm, "transcript": "silence"}]}))
    assert (user.role, user.text, user.audio.size, user.audio_transcript) == ("user", "listen:", 1600, "silence")
    assert user.id.startswith("item_") and user.history_text() == "listen:\nsilence"
    reply = _conversation_item(Item.model_validate({"id": "a1", "type": "message", "role": "assistant", "content": [
        {"type": "output_audio", "transcript": "hello"}]}))
    assert (reply.id, reply.text, reply.output_audio) == ("a1", "hello", True)
    assert reply.wire()["content"] == [{"type": "output_audio", "transcript": "hello"}]
    with pytest.raises(ApiError) as wrong:
        _conversation_item(Item.model_validate({"type": "message", "role": "system", "content": [
            {"type": "input_audio", "audio": pcm}]}))
    assert wrong.value.param == "item.content[0].type"
