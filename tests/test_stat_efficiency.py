"""Statistical efficiency curves: the McCandlish form, fitting, critical batch."""
import numpy as np
import pytest

from jaxhybrid.plan.stat_efficiency import MODEL_DEFAULTS, StatEfficiency, default_for, fit


def test_fit_recovers_parameters_from_noisy_points():
    true = StatEfficiency(s_min=2000.0, b_noise=3000.0)
    rng = np.random.RandomState(0)
    batches = [64, 128, 256, 512, 1024, 4096, 16384]
    pts = [(b, true.steps(b) * (1 + 0.002 * rng.randn())) for b in batches]
    got = fit(pts)
    assert got.s_min == pytest.approx(2000.0, rel=0.02)
    assert got.b_noise == pytest.approx(3000.0, rel=0.03)
    assert got.max_batch is None


def test_fit_from_epochs_matches_fit_from_steps():
    true = StatEfficiency.from_epochs(10.0, 5000.0, 1e6)
    pts = [(b, true.epochs(b)) for b in (100, 1000, 10000, 100000)]
    got = fit(pts, kind="epochs", dataset_size=1e6)
    assert got.e_min == pytest.approx(10.0, rel=1e-6)
    assert got.b_noise == pytest.approx(5000.0, rel=1e-6)


def test_fit_auto_finds_critical_batch():
    true = StatEfficiency(s_min=1000.0, b_noise=4096.0, max_batch=16384)
    pts = [(b, true.steps(b)) for b in (256, 1024, 4096, 16384, 65536, 262144)]
    got = fit(pts, max_batch="auto")
    assert got.max_batch == 16384
    assert got.s_min == pytest.approx(1000.0, rel=1e-6)
    assert got.b_noise == pytest.approx(4096.0, rel=1e-6)
    # Without a cap the same points fit worse.
    plain = fit(pts)
    res = lambda s: sum((s.steps(b) - y) ** 2 for b, y in pts)  # noqa: E731
    assert res(plain) > res(got) + 1.0


def test_critical_batch_makes_steps_flat_and_epochs_linear():
    s = StatEfficiency(s_min=100.0, b_noise=1000.0, dataset_size=1e5, max_batch=4000)
    assert s.steps(4000) == s.steps(8000) == s.steps(1e6)
    assert s.epochs(8000) == pytest.approx(2 * s.epochs(4000))


@pytest.mark.parametrize("name", sorted(MODEL_DEFAULTS))
def test_curves_are_monotone(name):
    s = default_for(name)
    b = np.logspace(0, 7, 200)
    assert np.all(np.diff(s.steps(b)) <= 0)        # more batch never needs more steps
    assert np.all(np.diff(s.epochs(b)) >= 0)       # ... nor fewer epochs
    assert np.all(np.diff(s.samples(b)) >= 0)


def test_imagenet_default_anchor():
    # Documented anchor: 90 epochs at batch 8192 (Goyal et al. 2017), E_min = 60.
    s = default_for("inception_v3")
    assert s.epochs(8192) == pytest.approx(90.0)
    assert s.e_min == pytest.approx(60.0)


def test_fit_errors_are_clear():
    with pytest.raises(ValueError, match="two or more different batch"):
        fit([(64, 100), (64, 90)])
    with pytest.raises(ValueError, match="steps should fall"):
        fit([(64, 100), (128, 200), (256, 400)])
    with pytest.raises(ValueError, match="dataset_size"):
        fit([(64, 1.0), (128, 1.5)], kind="epochs")
    with pytest.raises(ValueError, match="no statistical-efficiency default"):
        default_for("resnet")
    with pytest.raises(ValueError, match="global batch must be > 0"):
        StatEfficiency(1.0, 1.0).steps(0)


def test_projection_from_a_fitted_curve_matches_the_true_one():
    # A user measures steps-to-target at a few global batches; the fitted curve must give
    # the projection the true curve gives.
    from jaxhybrid.plan import hybrid
    true = default_for("gnmt")
    rng = np.random.RandomState(1)
    pts = [(b, true.steps(b) * (1 + 0.001 * rng.randn())) for b in (1024, 4096, 16384, 65536)]
    fitted = fit(pts, dataset_size=true.dataset_size)
    assert fitted.b_noise == pytest.approx(true.b_noise, rel=0.02)
    n = [64, 256, 1024]
    a = hybrid.project("gnmt", n, stat=true).at_scale()
    b = hybrid.project("gnmt", n, stat=fitted).at_scale()
    assert b["speedup"] == pytest.approx(a["speedup"], rel=0.01)
    assert (b["dp"].devices, b["hybrid"].data, b["hybrid"].pipe) == (
        a["dp"].devices, a["hybrid"].data, a["hybrid"].pipe)
