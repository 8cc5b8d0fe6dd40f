"""graph_buckets.collector_paused: one garbage collection for a set of CUDA-graph captures, none inside it."""

import gc

import pytest

from omni_triton.graph_buckets import collector_paused


@pytest.fixture
def collections(monkeypatch):
    """The full collections made (``gc.collect`` calls), counted."""
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    yield calls
    gc.enable()


def test_one_collection_then_none_until_the_block_ends(collections):
    assert gc.isenabled()
    with collector_paused():
        assert len(collections) == 1 and not gc.isenabled()
        for _ in range(5):  # a set's captures, each pausing again: no more collections
            with collector_paused():
                assert not gc.isenabled()
        assert not gc.isenabled()  # an inner block does not turn the collector back on
    assert len(collections) == 1 and gc.isenabled()


def test_the_collector_comes_back_after_an_error(collections):
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("capture invalidated")
    assert gc.isenabled()


def test_a_collector_turned_off_outside_stays_off_and_is_not_run(collections):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled() and collections == []
