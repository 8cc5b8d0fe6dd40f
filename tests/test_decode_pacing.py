"""When the code2wav stage's execute returns (stages/decode_pacing.py): after its own decode by default, after the
previous one's with --code2wav-overlap on (the next call's host work then runs while this call decodes). The
served GPU path itself runs on the device (benchmarks/served_variants.sh with the flag)."""

from __future__ import annotations

from omni_triton import cli
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stages.decode_pacing import DecodePacing
from server_fixture import rendered_settings


class Decode:
    """A decode's done-event: says when the host waited for it."""

    def __init__(self, name: str, waits: list[str]):
        self.name, self._waits = name, waits

    def synchronize(self) -> None:
        self._waits.append(self.name)


def test_by_default_a_call_returns_once_its_own_decode_is_done():
    waits: list[str] = []
    pacing = DecodePacing(overlap=False)
    for name in ("a", "b"):
        pacing.before_return(Decode(name, waits))
        assert waits[-1] == name
    pacing.before_return(None)  # the CPU: the decode is done when it returns
    pacing.drain()
    assert waits == ["a", "b"]


def test_with_overlap_a_call_returns_once_the_previous_decode_is_done():
    waits: list[str] = []
    pacing = DecodePacing(overlap=True)
    pacing.before_return(Decode("a", waits))  # nothing before it: back to Triton at once, "a" decoding
    assert waits == []
    pacing.before_return(Decode("b", waits))
    assert waits == ["a"]                     # "b" goes on decoding after this return
    pacing.before_return(Decode("c", waits))
    assert waits == ["a", "b"]
    pacing.drain()                            # the stage stops: the last one is waited for, once
    pacing.drain()
    assert waits == ["a", "b", "c"]


def test_the_flag_reaches_the_code2wav_stage(tiny_checkpoint, tmp_path):
    assert cli.build_parser().parse_args(["serve"]).code2wav_overlap == "off"
    args = cli.build_parser().parse_args(["serve", "--code2wav-overlap", "on"])
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, **{
        name: value for name, value in flag_settings(args).items() if name == "code2wav_overlap"})
    assert config.code2wav_overlap is True
    out = render_repository(config, tmp_path / "repository", ["code2wav"])
    assert rendered_settings(out, "code2wav").code2wav_overlap is True
