"""The soak's memory check: every process's RSS and GPU memory flat after warm-up (within FLAT_GROWTH of the
warm-up value or FLAT_SLACK_MIB, whichever is larger). Issue 48's H200 soak passed a check that looked at RSS alone
while the orchestrator's GPU memory grew from 684 to 2200 MiB: that series, as the sampler recorded it, must fail."""

from __future__ import annotations

from omni_triton.bench.soak import FLAT_SLACK_MIB, memory_growth, memory_not_flat

# benchmarks/results/h200-soak/soak.json, scenarios.soak.samples: seconds, and the orchestrator's and talker's memory
TIMES = [0.04, 10.09, 20.14, 30.18, 40.25, 50.29, 60.34, 70.4, 80.46, 90.5, 100.55, 110.6, 120.65, 130.7, 140.76,
         150.81, 160.85, 170.91, 180.96, 191.0, 201.05, 211.1, 221.15, 231.2, 241.25, 251.29, 261.35, 271.39, 281.44,
         291.48, 301.53, 311.58, 321.63, 331.68, 341.73, 351.78, 361.83, 371.87, 381.92, 391.96, 402.0, 412.05, 422.1,
         432.15, 442.19, 444.23]
ORCHESTRATOR_GPU = [684, 692, 740, 770, 800, 832, 860, 898, 928, 966, 1006, 1042, 1078, 1112, 1150, 1188, 1220, 1264,
                    1296, 1326, 1362, 1396, 1436, 1462, 1502, 1536, 1574, 1602, 1630, 1672, 1710, 1752, 1790, 1826,
                    1858, 1892, 1930, 1964, 1994, 2028, 2062, 2092, 2134, 2164, 2200, 2200]
ORCHESTRATOR_RSS = [726.9, 735.2, 766.5, 773.0, 781.8, 785.8, 787.2, 792.1, 794.0, 796.6, 804.2, 806.5, 809.4, 811.0,
                    812.3, 813.7, 813.7, 815.8, 817.3, 816.7, 818.0, 818.9, 819.6, 821.3, 823.1, 824.3, 826.0, 825.9,
                    826.7, 829.4, 830.1, 835.8, 837.0, 839.6, 838.5, 840.5, 841.7, 844.7, 844.5, 846.3, 847.0, 847.8,
                    850.1, 850.5, 851.1, 849.9]
TALKER_GPU = [26232, 26240, 26272, 26276, 26276, 26278, 26278, 26284, 26284, 26284] + [26290] * 23 + [26296] * 13


def samples(**processes: tuple[list[float], list[float | None]]) -> list[dict]:
    """Sampler records (bench.soak_probes.Sampler): per process its RSS and GPU series (None: no nvidia-smi)."""
    return [{"t": t, "processes": {name: {"pid": 1, "threads": 20, "rss_mib": rss[i], "gpu_mib": gpu[i]}
                                   for name, (rss, gpu) in processes.items()}, "shm_regions": 5, "gauges": {}}
            for i, t in enumerate(TIMES)]


def test_the_h200_soaks_orchestrator_gpu_memory_is_not_flat_though_its_rss_is():
    growth = memory_growth(samples(orchestrator_0_0=(ORCHESTRATOR_RSS, ORCHESTRATOR_GPU),
                                   talker_0_0=([1255.0] * len(TIMES), TALKER_GPU)))
    assert memory_not_flat(growth) == ["orchestrator_0_0 GPU 1220 -> 2062 MiB"]


def test_flat_processes_pass_with_noise_and_a_process_without_gpu_memory():
    wobble = [0, 3, -2, 5, 1, -4] * 8
    flat_gpu = [700 + wobble[i] for i in range(len(TIMES))]
    no_gpu = [None] * len(TIMES)
    growth = memory_growth(samples(orchestrator_0_0=([800 + w for w in wobble[:len(TIMES)]], flat_gpu),
                                   preprocess_0_0=([610.0] * len(TIMES), no_gpu)))
    assert "gpu_mib" not in growth["preprocess_0_0"]
    assert memory_not_flat(growth) == []


def test_a_small_process_may_grow_by_the_slack_and_no_more():
    """10% of a small value is noise (a lazily loaded CUDA module, an allocator segment): the slack decides there."""
    warm = len(TIMES) // 2  # the warm-up reference is the second quarter of the samples: the growth comes after it
    within = [40.0] * warm + [40 + FLAT_SLACK_MIB - 1] * (len(TIMES) - warm)
    past = [40.0] * warm + [40 + 3 * FLAT_SLACK_MIB] * (len(TIMES) - warm)
    rss = [600.0] * len(TIMES)
    assert memory_not_flat(memory_growth(samples(code2wav_0_0=(rss, within)))) == []
    assert memory_not_flat(memory_growth(samples(code2wav_0_0=(rss, past)))) == [
        f"code2wav_0_0 GPU 40 -> {40 + 3 * FLAT_SLACK_MIB:g} MiB"]
