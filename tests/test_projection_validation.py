"""The step-time model against the real engine on the 8 simulated CPU devices.

One calibration (jaxhybrid.bench.projection_bench: C from DP scaling, engine terms
fitted on a *wider* calibration model), then held-out pipelined configs of the
validation model, end to end as `scripts/bench.py projection` runs them. How close
prediction and measurement come is a benchmark figure (docs/projection.md), not an
assertion here: wall times on a shared 2-core host move 2-3x with other processes' load
(a 3x bound failed under CI-time load while the model was unchanged). What is asserted
holds at any load: the rows' structure, that configs the model puts >= 3x apart are
measured in the same order (they are timed round robin, so load hits them alike), and that
the configs it predicts slowest and fastest are. The model itself is checked without
timing (test_model_orderings_without_timing).
"""
import numpy as np
import pytest

from jaxhybrid.bench import projection_bench as pb
from jaxhybrid.plan import hybrid
from jaxhybrid.plan.hardware import measured_device

BATCH = 16
HELD_OUT = [(1, 2, 8), (1, 4, 4), (1, 8, 8), (1, 2, 2)]


@pytest.fixture(scope="module")
def setup():
    model = pb.Model(256, 7, profile_rounds=1)
    cal = pb.Model(512, 7, profile_rounds=1)
    # Minimum of the runs: other processes on the host only ever add time.
    configs = pb.parse_cal_configs(["1x2x8@8", "1x8x4@8", "2x2x4@8", "1x2x8", "1x8x8", "2x4x4"],
                                   None, cal.width)
    # Calibration and held-out steps timed in the same rounds, as `bench projection` fits.
    hw, info, rows = pb.calibrate_and_validate(model, cal, HELD_OUT, cal_configs=configs,
                                               batch=BATCH, runs=5, reduce="min",
                                               log=lambda *a: None)
    return model, hw, info, rows


def test_held_out_rows_are_predicted_and_measured_in_the_same_order(setup):
    model, hw, info, rows = setup
    assert 1.0 <= info["compute_slots"] <= 8.0
    assert len(info["rows"]) == len(info["residuals"]) == 6 and info["dp_1x1"] > 0
    # The fitted engine terms may come out 0 on a host where the engine's per-tick cost is
    # lost in the timing noise; they are non-negative by construction (bounded fit) and the
    # model's engine terms are checked without timing in test_model_orderings_without_timing.
    assert hw.tick_overhead >= 0 and hw.tick_param_bytes >= 0
    assert [r["config"] for r in rows] == ["x".join(map(str, c)) for c in HELD_OUT]
    for r in rows:
        assert r["predicted"] > 0 and r["measured"] > 0
        assert r["rel_error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
        assert r["compute"] > 0 and r["engine"] >= 0 and r["bubble"] > 0
        assert 0 <= r["pass_spread"] < 10   # the two timing passes of the measured step
    # Where the model predicts a >= 3x difference, the engine shows the same order.
    for a in rows:
        for b in rows:
            if a["predicted"] >= 3 * b["predicted"]:
                assert a["measured"] > b["measured"], (a["config"], b["config"])
    # So the order check is never empty: the rows predicted slowest and fastest are measured
    # in that order. How far apart the model puts them moves with the calibration's fit
    # (2.7x .. 4.5x for 1x8x8 / 1x2x2 on this host; a 3x guard failed in CI), so the guard is
    # a clear separation, not the 3x above.
    slow = max(rows, key=lambda r: r["predicted"])
    fast = min(rows, key=lambda r: r["predicted"])
    assert slow["predicted"] > 1.5 * fast["predicted"], (slow["config"], fast["config"])
    assert slow["measured"] > fast["measured"], (slow["config"], fast["config"])
    s = pb.summary(rows)
    assert s["max_pass_spread"] == max(r["pass_spread"] for r in rows)


def test_validate_with_a_given_fit_predicts_at_the_boundaries_it_measured(setup):
    """`validate` (a stored calibration's path): the row's prediction is the model's at the
    boundaries the measured step ran with."""
    model, hw, _, _ = setup
    (row,) = pb.validate(model, hw, [(1, 4, 4)], batch=BATCH, runs=1, reduce="min")
    again = hybrid.step_time(model.costs, hw, data=1, pipe=4, num_microbatches=4,
                             per_worker_batch=BATCH, include_update=False,
                             boundaries=row["boundaries"])
    assert row["predicted"] == pytest.approx(again.step_time) and row["measured"] > 0
    assert len(row["boundaries"]) == 3 and "model" not in row


def test_model_orderings_without_timing():
    """Properties of the model on measured-time hardware: more microbatches, smaller
    bubble; deeper pipelines pay more engine ticks; data replicas share the cores."""
    costs = _synthetic_costs()
    hw = measured_device("t", mem_bandwidth=10e9, compute_slots=2.0, tick_overhead=50e-6,
                         tick_param_bytes=64.0)
    est = {M: hybrid.step_time(costs, hw, data=1, pipe=4, num_microbatches=M, per_worker_batch=16,
                               include_update=False) for M in (1, 2, 4, 8, 16)}
    bubbles = [est[M].bubble_fraction for M in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(bubbles, bubbles[1:]))
    assert bubbles[0] == pytest.approx(3 / 4) and bubbles[-1] == pytest.approx(3 / 19)
    ticks = lambda S, M: M + 2 * (S - 1)  # noqa: E731  (1F1B task table length)
    e = hw.tick_overhead + 2 * 100_000 * hw.tick_param_bytes / hw.mem_bandwidth  # per device
    for M, r in est.items():
        # Every tick gets longer by e (the slowest device) to 2e (4 devices on 2 slots).
        assert ticks(4, M) * e * (1 - 1e-9) <= r.engine_time <= ticks(4, M) * 2 * e * (1 + 1e-9)
    four = hybrid.step_time(costs, hw, data=4, pipe=2, num_microbatches=4, per_worker_batch=16,
                            include_update=False)
    one = hybrid.step_time(costs, hw, data=1, pipe=2, num_microbatches=4, per_worker_batch=16,
                           include_update=False)
    # 8 devices on 2 slots: every tick lasts 4 replicas' work / 2, all devices' work
    # (compute of M microbatches per stage + the engine's cost in every tick) serialised.
    e2 = hw.tick_overhead + 4 * 100_000 * hw.tick_param_bytes / hw.mem_bandwidth
    work = 4 * sum(f + b for f, b in zip(one.stage_fwd, one.stage_bwd)) + ticks(2, 4) * 2 * e2
    assert four.compute_time + four.engine_time == pytest.approx(4 * work / 2)
    assert four.compute_time + four.engine_time > 2 * (one.compute_time + one.engine_time)
    assert four.allreduce_time > 0 == one.allreduce_time


def _synthetic_costs():
    from jaxhybrid.plan.costs import LayerCost
    return [LayerCost(f"l{i}", 16, 1e6, 2e6, 0.0, 0.0, 400_000, 100_000, 4096, 4096, 8192, 4096,
                      1e-3, 2e-3, measured=True) for i in range(8)]


def test_parse_configs_rejects_bad_input():
    assert pb.parse_configs(["2x4x8", "1X2X2"]) == [(2, 4, 8), (1, 2, 2)]
    for bad in ("2x4", "0x1x1", "ax1x1"):
        with pytest.raises(ValueError, match="data x pipe x microbatches"):
            pb.parse_configs([bad])


def test_rank_correlation():
    assert pb.rank_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert pb.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isfinite(pb.rank_correlation([1, 3, 2, 4], [1, 2, 3, 4]))


def test_calibration_is_stored_per_device_kind_and_reused(tmp_path):
    from jaxhybrid.plan import calibration
    hw = measured_device("fit", mem_bandwidth=5e9, compute_slots=1.5, tick_overhead=12e-6,
                         tick_param_bytes=17.0, devices_per_node=8)
    path = calibration.save(hw, tmp_path, {"residuals": [0.05, -0.02]})
    assert path.name == calibration.device_key() + ".json" and "cpu" in path.name
    loaded, doc = calibration.load(tmp_path)
    for f in calibration.FIELDS:
        assert getattr(loaded, f) == getattr(hw, f), f
    assert loaded.uses_measured_times and doc["info"]["residuals"] == [0.05, -0.02]
    assert calibration.load(tmp_path, key="gpu-other-8dev") is None   # another device kind
    path.write_text("{broken")
    assert calibration.load(tmp_path) is None


def test_validation_configs_name_schedule_and_width():
    assert pb.parse_val_configs(["zb-h1:2x4x8@384", "1x2x2", "gpipe:1x4x4"], "1f1b", 256) == [
        ("zb-h1", 2, 4, 8, 384), ("1f1b", 1, 2, 2, 256), ("gpipe", 1, 4, 4, 256)]
    assert pb.parse_configs(["2x4x8"]) == [(2, 4, 8)]
    for bad in ("nope:1x2x2", "1x2", "1x2x2@w", "0x2x2"):
        with pytest.raises(ValueError, match="config"):
            pb.parse_val_configs([bad], "1f1b", 256)


def test_tick_latency_is_waiting_not_shared_work():
    """The engine's waiting per tick (`tick_latency`) lengthens every tick once, however
    many replicas share the cores; its per-device work (`tick_overhead`) serialises."""
    from jaxhybrid.schedules import make_schedule
    costs = _synthetic_costs()
    base = measured_device("t", mem_bandwidth=10e9, compute_slots=2.0)
    kw = dict(pipe=4, num_microbatches=4, per_worker_batch=16, include_update=False)
    ticks = make_schedule("1f1b", 4, 4).num_ticks
    for data in (1, 4):
        plain = hybrid.step_time(costs, base, data=data, **kw)
        waits = hybrid.step_time(costs, base.replace(tick_latency=30e-6), data=data, **kw)
        work = hybrid.step_time(costs, base.replace(tick_overhead=30e-6), data=data, **kw)
        assert waits.engine_time - plain.engine_time == pytest.approx(ticks * 30e-6)
        assert work.engine_time >= (ticks * 30e-6 * (2 * data if data > 1 else 1)) * (1 - 1e-9)
    one = hybrid.step_time(costs, base.replace(tick_latency=30e-6), data=1, pipe=1,
                           num_microbatches=4, per_worker_batch=16, include_update=False)
    assert one.engine_time == 0.0   # no pipeline, no ticks


def test_calibration_recovers_known_engine_terms():
    """`fit_engine_terms` on steps priced by a device with known engine terms (no
    timing): it gives those terms back, so what the bench fits is what the host does."""
    from jaxhybrid.plan.costs import LayerCost

    def layers(width):
        p = width * width
        return [LayerCost(f"l{i}", 1, 0, 0, 0, 0, 4 * p, p, 4 * width, 4 * width, 8 * width,
                          4 * width, 20e-6 * width / 64, 40e-6 * width / 64, measured=True)
                for i in range(8)]
    models = {w: hybrid.cost_fn(layers(w)) for w in (8, 128, 512, 2048)}
    true = measured_device("true", mem_bandwidth=20e9, compute_slots=1.5, lockstep_slots=1.2,
                           lockstep_contention=0.2, launch_overhead=200e-6, tick_overhead=15e-6,
                           tick_param_bytes=20.0, task_overhead=8e-6, weight_task_overhead=12e-6,
                           collective_overhead=10e-6, tick_latency=5e-6)

    def predict(hw, c):
        sched, d, p, M, w, mb = c
        return hybrid.step_time(models[w], hw, data=d, pipe=p, num_microbatches=M,
                                per_worker_batch=M * mb, schedule=sched,
                                include_update=False).step_time
    configs = pb.parse_cal_configs(pb.FLAGS["cal_configs"].default, "1f1b", 512)
    configs += pb.parse_cal_configs(["1x2x4@2048", "2x4x2@2048/4"], "1f1b", 512)
    measured = [(c, predict(true, c)) for c in configs]
    base = true.replace(**{f: 0.0 for f, *_ in pb.ENGINE_TERMS})
    hw, res = pb.fit_engine_terms(base, measured, predict, max_slots=2.0)
    assert max(abs(r) for r in res) < 1e-3
    for f, *_ in pb.ENGINE_TERMS:
        assert getattr(hw, f) == pytest.approx(getattr(true, f), rel=0.05, abs=1e-8), f


def test_calibration_configs_take_a_microbatch():
    assert pb.parse_cal_configs(["zb-h1:1x4x4@8/4", "1x2x8"], None, 512) == [
        ("zb-h1", 1, 4, 4, 8, 4), (None, 1, 2, 8, 512, 1)]
    with pytest.raises(ValueError, match="microbatch"):
        pb.parse_cal_configs(["1x2x8/x"], None, 512)
