"""The telemetry service's handling of kvstore stats records (``<ns>.kvstore.<store>.stats``): gauges set,
the store's cumulative counters applied by delta, a restarted store (new epoch) counting from zero."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.telemetry.collector import Collector
from talaria.subjects import Subjects
from talaria.v1 import kvstore_pb2 as kpb


def record(epoch: int, **stats) -> bytes:
    st = kpb.StatsReply(epoch=epoch, capacity_bytes=1000, **stats)
    return kpb.KvStoreStatsRecord(schema_version=1, store_id="node-a", address="127.0.0.1:1", unix=1.0, stats=st).SerializeToString()


def value(c: Collector, name: str, **labels) -> float:
    fams = text_string_to_metric_families(c.metrics.exposition().decode())
    return sum(s.value for f in fams for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_stats_feed_gauges_and_counters_by_delta():
    c = Collector(5.0)
    c.feed("kvstore", record(7, used_bytes=250, occupancy=0.25, entries=3, hit_pages=4, miss_pages=1, restores=1, bytes_in=300, bytes_out=100))
    c.feed("kvstore", record(7, used_bytes=500, occupancy=0.5, entries=6, hit_pages=10, miss_pages=1, restores=2, bytes_in=600, bytes_out=200, capacity_miss_pages=2))
    assert value(c, "talaria_host_store_occupancy_ratio", store="node-a") == 0.5
    assert value(c, "talaria_host_store_used_bytes", store="node-a") == 500
    assert value(c, "talaria_host_store_capacity_bytes", store="node-a") == 1000
    assert value(c, "talaria_host_store_pages_total", store="node-a", outcome="hit") == 10
    assert value(c, "talaria_host_store_pages_total", outcome="miss") == 1
    assert value(c, "talaria_host_store_pages_total", outcome="capacity_miss") == 2
    assert value(c, "talaria_host_store_restores_total", store="node-a") == 2
    assert value(c, "talaria_host_store_bytes_total", direction="in") == 600
    assert value(c, "talaria_host_store_bytes_total", direction="out") == 200
    # the store restarted (new epoch, counters from zero): counters keep growing, never go back
    c.feed("kvstore", record(8, used_bytes=0, occupancy=0.0, restores=1, bytes_out=50))
    assert value(c, "talaria_host_store_restores_total") == 3
    assert value(c, "talaria_host_store_bytes_total", direction="out") == 250
    assert value(c, "talaria_host_store_occupancy_ratio", store="node-a") == 0.0
    s = c.summary()["stores"]["node-a"]
    assert s["epoch"] == 8 and s["restores"] == 1 and c.counts["kvstore"] == 3


def test_bad_stats_record_is_counted_not_raised():
    c = Collector(5.0)
    c.feed("kvstore", b"\xff\xff not a protobuf")
    assert value(c, "talaria_errors_total", kind="bad_kvstore") == 1


def test_subject():
    s = Subjects("ns")
    assert s.kvstore_stats("node-a") == "ns.kvstore.node-a.stats" and s.all_kvstore_stats() == "ns.kvstore.*.stats"
