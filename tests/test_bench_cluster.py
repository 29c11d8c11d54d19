"""bench/cluster.py: one Redis against a Redis Cluster at a tiny size, every part of its report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")  # bench/machine.py names the torch version


@pytest.mark.slow
def test_cluster_bench_measures_both_layouts_in_interleaved_rounds_and_writes_its_command(
    redis_binary, tmp_path
):
    from bench.cluster import main

    out = tmp_path / "cluster.json"
    argv = ["--faces", "300", "--per-subject", "3", "--writers", "2", "--enroll-rounds", "2",
            "--probe-rounds", "2", "--probes", "3", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].endswith(" ".join(argv))
    single, cluster = report["layouts"]["single"], report["layouts"]["cluster"]
    assert single["enroll"]["ratio_to_first"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    for layout, primaries in ((single, 1), (cluster, 3)):
        rates = layout["enroll"]["per_round_faces_per_s"]
        assert len(rates) == 2 and all(rate > 0 for rate in rates)
        cpu = layout["enroll"]["cpu_ms_per_1000_faces"]
        assert cpu["writers"] > 0 and cpu["redis"] >= 0  # /proc counts Redis's CPU in 10 ms ticks
        memory = layout["redis_memory"]
        nodes = memory["nodes"]
        assert [n["role"] for n in nodes] == ["master"] * primaries
        assert memory["primaries_used_memory"] == sum(n["used_memory"] for n in nodes)
        assert memory["bytes_per_face"] > 4 * report["dim"]  # at least the stored vector
        assert layout["pod"]["faces"] == 300
        assert layout["pod"]["index_nbytes"] >= 300 * 4 * report["dim"]
        for kind in ("refresh", "scan", "identify"):
            p50 = layout["identify_ms"][kind]["p50"]
            assert 0 < p50["min"] <= p50["median"] <= p50["max"]
    assert all(n["keys"] > 0 for n in cluster["redis_memory"]["nodes"])  # every primary holds faces


@pytest.mark.slow
def test_the_replicas_layout_enrolls_through_writes_that_wait_for_a_replica(redis_binary):
    """The gallery's writes wait for a replica (WAIT): the layout starts with every replica synced."""
    from bench.cluster import LAYOUTS
    from bench.cluster_work import enroll_range
    from service.gallery.writes import replicas_of

    layout = LAYOUTS["cluster-replicas"]().start()
    try:
        with layout.spec.client() as client:
            assert replicas_of(client) == 3
        assert enroll_range(layout.spec, 0, 30, 16, 3, 10)[0] == 30
    finally:
        layout.stop()
