"""stages/collector.py and ``--stage-gc-freeze``: a stage's loaded objects kept out of garbage collection."""

from __future__ import annotations

import gc
import weakref

import pytest

from benchmark_scripts import load_script
from omni_triton import cli
from omni_triton.launch.options import flag_settings
from omni_triton.launch.repository import render_repository
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stages.collector import freeze_loaded_objects
from omni_triton.stages.stage_io import stage_loading
from server_fixture import rendered_settings


class Node:
    def __init__(self):
        self.other = None


@pytest.fixture
def unfrozen():
    """Each test starts and ends with no frozen object (the worker process runs other tests after)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_loaded_objects_are_frozen_and_garbage_from_loading_is_collected_first(unfrozen, capsys):
    kept = [Node() for _ in range(3)]  # what a stage keeps: out of every later collection's walk
    garbage = Node()
    garbage.other = Node()
    garbage.other.other = garbage  # a cycle loading dropped: collected now, not frozen for the process's life
    dropped = weakref.ref(garbage)
    del garbage
    frozen = freeze_loaded_objects("talker")
    assert dropped() is None
    assert frozen == gc.get_freeze_count() > 0
    walked = {id(obj) for obj in gc.get_objects()}  # what a full collection walks: the frozen ones are not there
    assert not any(id(node) in walked for node in kept)
    assert f"talker: {frozen} objects from loading kept out of garbage collection" in capsys.readouterr().out


def test_objects_made_after_the_freeze_are_collected_as_before(unfrozen):
    freeze_loaded_objects("thinker")
    later = Node()
    later.other = later
    collected = weakref.ref(later)
    del later
    gc.collect()
    assert collected() is None


@pytest.mark.parametrize("freeze", [True, False])
def test_stage_loading_freezes_only_when_asked(unfrozen, freeze):
    with stage_loading("code2wav", freeze_collector=freeze):
        loaded = [Node() for _ in range(3)]
    assert (gc.get_freeze_count() > 0) is freeze
    assert loaded


@pytest.mark.parametrize("flag, expected", [([], True), (["--stage-gc-freeze", "off"], False)])
def test_the_flag_reaches_every_stage_that_freezes(tiny_checkpoint, tmp_path, flag, expected):
    args = cli.build_parser().parse_args(["serve", *flag])
    config = LaunchConfig(checkpoint_dir=tiny_checkpoint, **{
        name: value for name, value in flag_settings(args).items() if name == "stage_gc_freeze"})
    stages = ["thinker", "talker", "code2wav", "orchestrator"]
    out = render_repository(config, tmp_path / "repository", stages)
    for stage in stages:
        assert rendered_settings(out, stage).stage_gc_freeze is expected


def test_the_probe_tables_full_collections_before_and_after_the_freeze(unfrozen, tmp_path, capsys):
    """benchmarks/gc_freeze_probe.py on the tiny talker: what a full collection walks, as loaded and frozen."""
    result = load_script("gc_freeze_probe").main(["--config", "tiny", "--rounds", "2", "--out-dir", str(tmp_path)])
    assert result["frozen_objects"] > 10_000  # torch's, the service's: what the stage's collections walked
    assert result["frozen"]["tracked_objects"] < result["unfrozen"]["tracked_objects"] / 100
    assert len(result["unfrozen"]["times_ms"]) == len(result["frozen"]["times_ms"]) == 2
    assert "| after gc.freeze |" in capsys.readouterr().out
    assert (tmp_path / "gc_freeze_probe.json").is_file()
