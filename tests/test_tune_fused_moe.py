"""``bench.tune_fused_moe``'s FP8 search on the CPU: which candidates it tries and keeps (a stand-in timer), and one
bucket of a tiny shape end to end through Triton's interpreter, its entry keyed apart from bf16's and read back by
``fused_moe.block_config``."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from omni_triton.bench import tune_fused_moe as tune  # noqa: E402
from omni_triton.kernels import fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class StandInBench:
    """Times a config by a formula: gate/up likes 128 columns and 4 stages, down likes 64 columns at K 64."""

    num_tokens = 64
    weight_bytes = 595_000_000

    def __init__(self):
        self.timed = []

    def ms(self, config, gemv=False):
        self.timed.append(config)
        gate, down = config["gate_up"], config["down"]
        return (abs(gate["BLOCK_N"] - 128) + abs(gate["num_stages"] - 4) + (gate["num_warps"] == 8)
                + abs(down["BLOCK_N"] - 64) + (down["BLOCK_K"] != 64) + config["BLOCK_M"] / 16
                + (not gate["SCALE_AFTER_DOT"] if "SCALE_AFTER_DOT" in gate else 0))


def test_fp8_search_keeps_the_fastest_tile_of_each_gemm():
    bench = StandInBench()
    took, config = tune.fp8_search(bench, top_k=8, num_experts=128, deadline=float("inf"), say=lambda line: None)
    assert config["BLOCK_M"] == 16  # 4 pairs an expert: 16 and 32 tried, 16 the cheaper
    assert {c["BLOCK_M"] for c in bench.timed} == {16, 32}
    gate, down = config["gate_up"], config["down"]
    assert (gate["BLOCK_N"], gate["num_warps"], gate["num_stages"], gate["SCALE_AFTER_DOT"]) == (128, 4, 4, True)
    assert (down["BLOCK_N"], down["BLOCK_K"]) == (64, 64)
    assert all(c[p]["BLOCK_K"] <= 128 for c in bench.timed for p in ("gate_up", "down"))  # one block of scales
    assert any(c["gate_up"].get("SCALE_AFTER_DOT") is False for c in bench.timed)  # the torch rounding, for the table
    # deep pipelines of wide tiles that cannot fit in shared memory are skipped, not compiled
    assert not any(tune.fp8_shared_bytes(p, c["BLOCK_M"], c[p]) > tune.SHARED_MEMORY_BYTES
                   for c in bench.timed for p in ("gate_up", "down"))


def test_fp8_search_past_its_deadline_keeps_the_size_rule():
    bench = StandInBench()
    _, config = tune.fp8_search(bench, top_k=8, num_experts=128, deadline=0.0, say=lambda line: None)
    rule = fused_moe.default_config(64)
    assert config["gate_up"] == rule["gate_up"] and config["down"] == rule["down"]


@pytest.mark.parametrize("compile_workers", [0, 1])
def test_fp8_tuning_writes_an_entry_that_block_config_reads(monkeypatch, tmp_path, compile_workers):
    """With a compile worker too (a spawned process running each round's candidates first; here through the
    interpreter, which caches nothing, so only the plumbing is checked)."""
    monkeypatch.setattr(tune, "LAYERS", 1)
    monkeypatch.setattr(tune, "FP8_TILES", [(16, 16, 4), (32, 16, 4)])
    monkeypatch.setattr(tune, "FP8_STAGES", (2, 3))
    monkeypatch.setattr(tune, "FP8_BLOCK", (16, 16))
    monkeypatch.setattr(tune.triton.testing, "do_bench_cudagraph", lambda fn, rep: fn() or 1.0)
    table_file = tmp_path / "configs.json"
    table: dict = {}
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"  # block_config's key
    key = fused_moe.shape_key(4, 32, 32, fp8=True)
    shape = table.setdefault(device_name, {})[key] = {}
    # the interpreter's bf16 dot is wrong (test_kernels.py): fp32 activations on the CPU
    rows = tune.tune_shape(4, 32, 32, 2, True, shape, lambda: table_file.write_text(json.dumps(table)), buckets=[2],
                           device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
                           compile_workers=compile_workers)
    assert len(rows) == 1 and "FAILED" not in rows[0]
    written = json.loads(table_file.read_text())[device_name][key]["2"]
    assert written["gate_up"]["SCALE_AFTER_DOT"] in (True, False)
    assert key.endswith("_fp8") and key != fused_moe.shape_key(4, 32, 32)
    monkeypatch.setattr(fused_moe, "CONFIG_FILE", table_file)
    fused_moe._tuned_table.cache_clear()
    try:
        assert fused_moe.block_config(2, 4, 32, 32, fp8=True) == written
        assert fused_moe.block_config(2, 4, 32, 32) == fused_moe.default_config(2)  # bf16 never reads FP8's
    finally:
        fused_moe._tuned_table.cache_clear()
