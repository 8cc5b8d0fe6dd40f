"""The voice demo page (``/demo``) in a real headless Chromium (Debian's, driven by Playwright), with a WAV of
synthesized speech as the fake microphone: the page connects, the VAD takes a turn, the reply's audio arrives,
and the next utterance (the fake microphone loops its file) interrupts a reply still being made."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from omni_triton.client import read_wav, write_wav
from test_openai_api import ApiServer

pytestmark = pytest.mark.server
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# a reply long enough (~4 s or more here) that the next utterance comes while it is still being made
DEMO_URL_QUERY = "?max_output_tokens=60"


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """The fake microphone's file, looped by Chromium: 0.5 s silence, ~1.5 s of speech, 1.5 s silence (the VAD
    ends the turn after 0.5 s of it, so the next utterance begins about 1 s into the reply)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it): no speech for the microphone")
    folder = tmp_path_factory.mktemp("microphone")
    subprocess.run(["espeak-ng", "-s", "190", "-w", str(folder / "speech.wav"), "Hello there, how are you today?"],
                   check=True)
    speech = read_wav(folder / "speech.wav", sample_rate=48000)
    loop = np.concatenate([np.zeros(24000, np.float32), speech, np.zeros(72000, np.float32)])
    write_wav(folder / "microphone.wav", loop, sample_rate=48000)
    return folder / "microphone.wav"


def test_demo_page_talks_and_is_interrupted(triton_server, microphone):
    playwright = pytest.importorskip("playwright.sync_api", reason="the demo test drives Chromium with Playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)")
    with ApiServer(triton_server.grpc_url, triton_server.checkpoint_dir) as api, \
            playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=[
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={microphone}", "--autoplay-policy=no-user-gesture-required",
            "--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(api.url + "/demo" + DEMO_URL_QUERY)
            page.click("#start")
            page.wait_for_function("window.demoState.connected", timeout=60_000)
            # a spoken turn answered with audio, then one cancelled by the next utterance
            page.wait_for_function("window.demoState.audioDeltas > 0", timeout=120_000)
            page.wait_for_function(
                "Object.values(window.demoState.responses).includes('cancelled')", timeout=120_000)
            # and one interrupted while its audio played (the page then truncates it): the microphone loops, so a
            # first reply that had no audio yet when the next utterance came (a slow first turn on a loaded CPU)
            # is followed by others
            page.wait_for_function("window.demoState.truncated >= 1", timeout=120_000)
            state = page.evaluate("window.demoState")
            transcript = page.inner_text("#transcript")
            page.click("#stop")
        finally:
            browser.close()
    assert state["speechStarted"] >= 2 and state["truncated"] >= 1 and not state["errors"], state
    assert "you: (spoken)" in transcript and "(reply cancelled)" in transcript
    assert any(request.startswith("resp_") for request in api.app.state.bridge.cancelled)
