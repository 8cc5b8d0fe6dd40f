"""engine/output_batching.py: when a request's outputs are due (pure logic, simulated clock)."""

import pytest

from omni_triton.engine.engine import RequestOutput
from omni_triton import cli
from omni_triton.engine.output_batching import HeldOutputs, OutputBatching
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stages.model_args import output_batching
from server_fixture import rendered_settings


def out(tokens, finished=False, request_id="a"):
    return RequestOutput(request_id, list(range(tokens)), finished)


def test_the_default_delivers_every_output_at_once():
    held = HeldOutputs(OutputBatching())
    outputs = [out(1), out(0, request_id="b")]
    assert held.due(outputs, now=0.0) == outputs and len(held) == 0 and held.wait_s(0.0) is None


def test_first_eager_then_min_tokens():
    held = HeldOutputs(OutputBatching(first_tokens=3, eager_tokens=5, min_tokens=4, max_hold_s=1.0))
    assert held.due([out(2)], now=0.0) == [] and len(held) == 1  # before the first delivery: 3 tokens
    (waiting,) = held.take_held()
    merged = RequestOutput("a", waiting.new_token_ids + [9])
    assert held.due([merged], now=0.1) == [merged]  # 3 tokens: due
    assert held.due([out(1)], now=0.2) != []  # 3 of 5 eager tokens delivered: due at once
    assert held.due([out(1)], now=0.3) != []  # 4 of 5: still eager
    assert held.due([out(3)], now=0.4) == []  # 5 delivered: now 4 at a time
    assert held.due([out(4)], now=0.5) != []


def test_the_hold_time_and_finishing_make_an_output_due():
    held = HeldOutputs(OutputBatching(first_tokens=1, min_tokens=10, max_hold_s=0.05))
    assert held.due([out(1)], now=0.5) != []  # the first token
    assert held.due([out(1)], now=1.0) == []
    assert held.wait_s(1.01) == pytest.approx(0.04)
    (waiting,) = held.take_held()
    assert held.due([waiting], now=1.05) == [waiting]  # its oldest part waited 50 ms
    assert held.due([out(1, finished=True)], now=1.06) != []  # finished: due whatever its size
    assert held.wait_s(2.0) is None


def test_the_first_tokens_go_whole_however_long_they_take():
    """The talker's first response is the first audio chunk's frames: a part of them is of no use to the
    orchestrator, and the rest of a part sent at the hold's end used to wait for min_tokens (or another hold)."""
    held = HeldOutputs(OutputBatching(first_tokens=4, min_tokens=8, max_hold_s=0.04))
    assert held.due([out(2)], now=0.0) == []
    assert held.wait_s(0.1) is None  # no wake-up by age for it (the response thread would spin at 0 s)
    (waiting,) = held.take_held()
    assert held.due([waiting], now=0.1) == []  # 2 of 4 after 100 ms: still held (the hold is for later outputs)
    (waiting,) = held.take_held()
    merged = RequestOutput("a", waiting.new_token_ids + [7, 8])
    assert held.due([merged], now=0.11) == [merged]  # the 4 frames, at once and together
    assert held.due([out(1)], now=0.12) == []  # then min_tokens, or the hold
    assert held.wait_s(0.13) == pytest.approx(0.03)
    (waiting,) = held.take_held()
    assert held.due([waiting], now=0.16) == [waiting]
    other = HeldOutputs(OutputBatching(first_tokens=4, min_tokens=8, max_hold_s=0.04))
    assert other.due([out(1, finished=True)], now=0.0) != []  # a request that ends sooner: due as it ends


def test_a_held_output_keeps_its_arrival_time_across_rounds():
    held = HeldOutputs(OutputBatching(first_tokens=1, min_tokens=10, max_hold_s=0.1))
    assert held.due([out(1)], now=-1.0) != []  # the first token
    held.due([out(1)], now=0.0)
    for now in (0.03, 0.06, 0.09):
        (waiting,) = held.take_held()
        assert held.due([waiting], now=now) == []
    (waiting,) = held.take_held()
    assert held.due([waiting], now=0.1) == [waiting]


def test_a_round_delivers_the_starting_streams_first():
    """Streams still waiting for their first tokens go before those already playing, each group in its order."""
    held = HeldOutputs(OutputBatching(first_tokens=2, min_tokens=1, max_hold_s=1.0))
    assert [o.request_id for o in held.due([out(2, request_id="a"), out(2, request_id="b")], now=0.0)] == ["a", "b"]
    round_two = [out(1, request_id="a"), out(2, request_id="c"), out(1, request_id="b"),
                 out(1, request_id="d"), out(3, request_id="e")]
    # d is short of its first 2 tokens: held; c and e start; a and b play on
    assert [o.request_id for o in held.due(round_two, now=0.1)] == ["c", "e", "a", "b"]
    assert [o.request_id for o in held.take_held()] == ["d"]
    # once delivered, a stream is a playing one; a finished stream's id reused starts again
    finished = held.due([out(1, request_id="f"), out(1, finished=True, request_id="c")], now=0.2)
    assert [o.request_id for o in finished] == ["c"] and [o.request_id for o in held.take_held()] == ["f"]
    again = held.due([out(1, request_id="a"), out(2, request_id="c")], now=0.3)
    assert [o.request_id for o in again] == ["c", "a"]


def test_bad_policies_are_refused():
    for bad in (dict(first_tokens=0), dict(min_tokens=0), dict(eager_tokens=-1), dict(max_hold_s=-1)):
        with pytest.raises(ValueError):
            OutputBatching(**bad)


# ---------------------------------------------------------------- the stages' policies from the settings

def test_the_default_policies_are_the_ones_measured_before_the_thinker_settings():
    settings = LaunchConfig(checkpoint_dir="x")
    assert output_batching(settings, "thinker") == OutputBatching(first_tokens=1, eager_tokens=8, min_tokens=4,
                                                                  max_hold_s=0.04)
    assert output_batching(settings, "talker") == OutputBatching(first_tokens=4, min_tokens=8, max_hold_s=0.04)


def test_the_thinker_settings_change_the_thinker_alone():
    settings = LaunchConfig(checkpoint_dir="x", thinker_tokens_per_output=16, thinker_output_hold_ms=200)
    assert output_batching(settings, "thinker") == OutputBatching(first_tokens=1, eager_tokens=8, min_tokens=16,
                                                                  max_hold_s=0.2)
    assert output_batching(settings, "talker").max_hold_s == 0.04


@pytest.mark.parametrize("stage_hold, thinker_hold, thinker_every_step, talker_every_step", [
    (0, None, True, True), (0, 100, False, True), (40, 0, True, False)])
def test_a_hold_of_zero_sends_every_step(stage_hold, thinker_hold, thinker_every_step, talker_every_step):
    settings = LaunchConfig(checkpoint_dir="x", stage_output_hold_ms=stage_hold, thinker_output_hold_ms=thinker_hold)
    assert (output_batching(settings, "thinker") == OutputBatching()) is thinker_every_step
    assert (output_batching(settings, "talker") == OutputBatching()) is talker_every_step


def test_the_flags_reach_the_thinker_stage(tiny_checkpoint, tmp_path):
    args = cli.build_parser().parse_args(["serve", "--thinker-tokens-per-output", "12",
                                          "--thinker-output-hold-ms", "150"])
    names = ("thinker_tokens_per_output", "thinker_output_hold_ms")
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint,
                          **{name: value for name, value in flag_settings(args).items() if name in names})
    out = render_repository(config, tmp_path / "repository", ["thinker"])
    settings = rendered_settings(out, "thinker")
    assert (settings.thinker_tokens_per_output, settings.thinker_output_hold_ms) == (12, 150.0)


@pytest.mark.parametrize("flag, value, message", [
    ("--thinker-tokens-per-output", "0", "expected a whole number >= 1, got '0'"),
    ("--thinker-tokens-per-output", "2.5", "expected a whole number >= 1, got '2.5'"),
    ("--thinker-output-hold-ms", "1500", "must be milliseconds within 0-1000, got '1500'"),
    ("--stage-output-hold-ms", "-1", "must be milliseconds within 0-1000, got '-1'")])
def test_a_bad_value_is_refused_naming_the_flag(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_the_settings_refuse_what_the_flags_would():
    with pytest.raises(ValueError, match="thinker_tokens_per_output must be >= 1"):
        LaunchConfig(checkpoint_dir="x", thinker_tokens_per_output=0)
    with pytest.raises(ValueError, match="thinker_output_hold_ms must be within 0-1000"):
        LaunchConfig(checkpoint_dir="x", thinker_output_hold_ms=1001)
