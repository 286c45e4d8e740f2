"""Topology: spec grammar, errors, transfer and ring all-reduce formulas."""
import jax
import numpy as np
import pytest

from jaxhybrid.plan import Topology, parse_bandwidth, parse_bytes, parse_time


def test_node_spec_parses():
    t = Topology.from_spec("2x4:intra=300GB/s,inter=12GB/s")
    assert t.n == 8
    assert t.bandwidth[0, 3] == 300e9 and t.bandwidth[4, 7] == 300e9
    assert t.bandwidth[3, 4] == 12e9 and t.bandwidth[7, 0] == 12e9
    assert t.latency[0, 1] < t.latency[0, 4]
    assert not t.is_uniform()


def test_node_spec_latencies_and_bits():
    t = Topology.from_spec("3x2:intra=100GB/s,inter=10Gbps,intra_lat=1us,inter_lat=0.5ms")
    assert t.n == 6
    assert t.bandwidth[0, 2] == pytest.approx(1.25e9)
    assert t.latency[0, 1] == pytest.approx(1e-6) and t.latency[1, 2] == pytest.approx(5e-4)


def test_uniform_spec():
    t = Topology.from_spec("uniform:8:100GB/s")
    assert t.n == 8 and t.is_uniform()
    assert np.all(t.bandwidth[~np.eye(8, dtype=bool)] == 100e9)
    t = Topology.from_spec("uniform:4:2GiB/s:3us")
    assert t.bandwidth[0, 1] == 2 * 2 ** 30 and t.latency[2, 3] == pytest.approx(3e-6)


@pytest.mark.parametrize("spec", ["2x4:intra=300GB/s", "uniform:x:1GB/s", "3y4:intra=1GB/s,inter=1GB/s",
                                  "2x4:intra=fast,inter=1GB/s", "uniform:8:100GB/s:5parsecs",
                                  "2x4:intra=1GB/s,inter=1GB/s,speed=3", "ring:8", "uniform:0:1GB/s",
                                  "2x4:intra=0GB/s,inter=1GB/s"])
def test_bad_specs_name_the_grammar(spec):
    with pytest.raises(ValueError, match="Grammar"):
        Topology.from_spec(spec)


def test_unit_parsers():
    assert parse_bandwidth("12GB/s") == 12e9
    assert parse_bandwidth("10Gb/s") == pytest.approx(1.25e9)
    assert parse_bandwidth(5.0) == 5.0
    # The "ps" forms: B bytes, b bits ("100MBps" was read as bits, 8x too slow).
    assert parse_bandwidth("100MBps") == 1e8 and parse_bandwidth("1GiBps") == 2.0 ** 30
    assert parse_bandwidth("10Gbps") == parse_bandwidth("10gbps") == pytest.approx(1.25e9)
    assert parse_bytes("2GB") == 2e9 and parse_bytes("1.5GiB") == 1.5 * 2 ** 30 and parse_bytes(7) == 7
    assert parse_time("5us") == pytest.approx(5e-6)
    for bad, fn in (("12 furlongs", parse_bandwidth), ("2 potatoes", parse_bytes), ("-1GB", parse_bytes),
                    ("3 weeks", parse_time)):
        with pytest.raises(ValueError):
            fn(bad)


def test_transfer_time():
    t = Topology.nodes(2, 2, 100e9, 4e9, intra_latency=1e-6, inter_latency=1e-5)
    assert t.transfer_time(1, 1, 1e9) == 0.0
    assert t.transfer_time(0, 1, 1e9) == pytest.approx(1e-6 + 1e9 / 100e9)
    assert t.transfer_time(1, 2, 1e9) == pytest.approx(1e-5 + 1e9 / 4e9)
    with pytest.raises(ValueError, match="out of range"):
        t.transfer_time(0, 4, 1)


def test_ring_allreduce_formula():
    t = Topology.uniform(8, 50e9, latency=2e-6)
    for k in (2, 3, 8):
        nb = 3e8
        assert t.allreduce_time(list(range(k)), nb) == pytest.approx(
            2 * (k - 1) / k * nb / 50e9 + 2 * (k - 1) * 2e-6)
    assert t.allreduce_time([3], 1e9) == 0.0
    # Across nodes the slowest link in the ring sets the pace.
    n = Topology.nodes(2, 4, 300e9, 12e9, intra_latency=0, inter_latency=0)
    assert n.allreduce_time([0, 1, 2, 3], 1e9) == pytest.approx(1.5 * 1e9 / 300e9)
    assert n.allreduce_time([0, 1, 4, 5], 1e9) == pytest.approx(1.5 * 1e9 / 12e9)


def test_matrix_validation():
    Topology.from_matrix(np.full((3, 3), 1e9))
    with pytest.raises(ValueError, match="square"):
        Topology.from_matrix(np.ones((2, 3)))
    with pytest.raises(ValueError, match="> 0"):
        Topology.from_matrix([[1, -1], [1, 1]])
    with pytest.raises(ValueError, match="latenc"):
        Topology.from_matrix(np.ones((2, 2)), -np.ones((2, 2)))


def test_default_is_this_host():
    t = Topology.default()
    assert t.n == jax.device_count() == 8 and t.is_uniform()


@pytest.mark.parametrize("fn,value,match", [
    (parse_bytes, True, "size True is a bool"), (parse_bandwidth, True, "bandwidth True is a bool"),
    (parse_time, False, "latency False is a bool"), (parse_time, -1e-6, "must be >= 0")])
def test_bools_and_negative_latencies_are_refused(fn, value, match):
    # True read as 1 byte (a budget nothing fits), 1 B/s or 1 s before.
    with pytest.raises(ValueError, match=match):
        fn(value)
