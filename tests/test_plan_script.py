"""scripts/plan.py end to end: summary, chart, JSON that Plan.from_json reads, errors."""
import os
import subprocess
import sys

from jaxhybrid.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_plan_script_writes_summary_chart_and_json(tmp_path):
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    r = _run("--config=gpt_hybrid.py", "--size=tiny", "--stages=2", "--data=1",
             "--microbatches=2", "--batch_size=8", f"--plot={png}", f"--json={js}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 stages" in r.stdout and "bottleneck" in r.stdout
    assert png.stat().st_size > 1000
    plan = Plan.from_json(js.read_text())
    assert plan.num_stages == 2 and len(plan.boundaries) == 1
    assert plan.num_layers == len(plan.remat)


def test_plan_script_errors_are_one_line():
    r = _run("--model=gpt", "--size=tiny", "--stages=2", "--data=1", "--microbatches=2",
             "--batch_size=8", "--memory_budget=1KB", "--plot=")
    assert r.returncode != 0
    assert "over the" in r.stderr and "memory budget" in r.stderr
    r = _run("--size=tiny", "--plot=")
    assert r.returncode != 0 and "--model" in r.stderr
    # A model.module config said "give --config=<name>", which was given.
    r = _run("--config=gpt_module.py", "--plot=")
    assert r.returncode != 0 and "names model.module=" in r.stderr
    # Zero sizes are named (--stages=0 divided by zero; --microbatches=0 took a modulo by 0).
    r = _run("--model=gpt", "--size=tiny", "--stages=0", "--plot=")
    assert r.returncode != 0 and "mesh.pipe (--stages)=0 must be >= 1" in r.stderr
    r = _run("--model=gpt", "--size=tiny", "--stages=2", "--data=1", "--microbatches=0",
             "--plot=")
    assert r.returncode != 0 and "num_microbatches=0 must be >= 1" in r.stderr


def test_plan_script_refuses_batch_size_below_one():
    # 0 planned microbatches of 0 examples (every time 0.000); -32 failed in numpy with
    # "negative dimensions are not allowed", naming nothing.
    for size in ("0", "-32"):
        r = _run("--model=gpt", "--size=tiny", "--stages=2", "--data=1", "--microbatches=2",
                 f"--batch_size={size}", "--plot=")
        assert r.returncode != 0
        assert f"error: plan_from_config: train.batch_size={size} (--batch_size) must be >= 1" \
            in r.stderr and "Traceback" not in r.stderr


def test_plan_script_names_virtual_stages_and_plot_suffixes(tmp_path):
    # GPT tiny has 4 layers; interleaved runs 2 stages per device by default.
    r = _run("--model=gpt", "--size=tiny", "--stages=4", "--schedule=interleaved", "--plot=")
    assert r.returncode != 0
    assert ("8 stages (pipe 4 x 2 virtual stages per device, interleaved) but the model has "
            "only 4 layers" in r.stderr and "--virtual_stages" in r.stderr)
    r = _run("--model=gpt", "--size=tiny", "--stages=2", "--virtual_stages=2", "--plot=")
    assert r.returncode != 0 and "an option of --schedule=interleaved" in r.stderr
    r = _run("--model=gpt", "--size=tiny", "--stages=2", f"--plot={tmp_path / 'c.jpg'}")
    assert r.returncode != 0 and "the charts are PNGs" in r.stderr
    # --plot without a suffix: matplotlib wrote chart.png while "chart" was printed, and
    # the memory chart was printed nowhere. Every file written is printed now. The fix it
    # names works: virtual_stages=1 was planned with the builder's default 2.
    chart, js = tmp_path / "chart", tmp_path / "p.json"
    r = _run("--model=gpt", "--size=tiny", "--stages=4", "--data=1", "--schedule=interleaved",
             "--virtual_stages=1", "--microbatches=4", "--batch_size=8", f"--plot={chart}",
             f"--json={js}")
    assert r.returncode == 0, r.stderr[-2000:]
    written = [tmp_path / "chart.png", tmp_path / "chart_memory.png"]
    assert f"chart: {written[0]}" in r.stdout and f"memory chart: {written[1]}" in r.stdout
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png", "chart_memory.png",
                                                           "p.json"]
    plan = Plan.from_json(js.read_text())
    assert plan.num_stages == 4 and plan.virtual_stages == 1


def test_chart_title_gives_the_bars_span_and_the_step_by_part(monkeypatch, tmp_path):
    # The title said "step X ms" (compute + engine + transfers) over bars of the layer
    # work alone, which ended far earlier (27.7 ms over an axis ending at 6.9 ms, zbv).
    import dataclasses

    from jaxhybrid.plan import make_plan
    from jaxhybrid.plan.costs import LayerCost
    from jaxhybrid.schedules import gantt
    drawn = []
    monkeypatch.setattr(gantt, "draw", lambda path, bars, n, **kw: drawn.append((bars, kw)))
    costs = [LayerCost(f"l{i}", 1, 1e9, 2e9, 1e7, 2e7, 4000, 1000, 4096, 4096, 4096, 4096,
                       1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3)) for i in range(8)]
    for schedule in ("1f1b", "zbv"):
        p = make_plan(costs, num_stages=2, num_microbatches=4, schedule=schedule)
        p = dataclasses.replace(p, tick_overhead=1e-2, transfer_per_tick=2e-3,
                                compute_slots=1.5)
        drawn.clear()
        paths = p.plot(str(tmp_path / "chart"))   # the Gantt chart is recorded, not drawn
        (bars, kw), = drawn[:1]
        span = max(b.start + b.length for b in bars)
        step = p.predicted_step
        assert step.total == p.predicted_step_time and 1e3 * step.total > 1.5 * span
        title = kw["title"]
        assert f"bars = layer work, {span:.3g} ms" in title
        assert f"predicted step {1e3 * step.total:.3g} ms = bars" in title
        assert f"+ {1e3 * step.compute - span:.3g} shared cores" in title
        assert f"+ {1e3 * step.engine:.3g} engine" in title
        assert f"+ {1e3 * step.transfer:.3g} transfers" in title
        assert paths == [str(tmp_path / "chart.png"), str(tmp_path / "chart_memory.png")]


def test_a_folder_for_the_chart_is_refused_and_the_plan_kept(tmp_path):
    # "--plot=outdir/" wrote the hidden outdir/.png.png (printed as outdir/.png); an
    # unwritable chart ended in a traceback after planning and the --json was lost.
    tiny = ["--config=gpt_hybrid.py", "--size=tiny", "--stages=2", "--data=1",
            "--microbatches=2", "--batch_size=8"]
    r = _run(*tiny, f"--plot={tmp_path}{os.sep}")
    assert r.returncode != 0 and "is a folder" in r.stderr
    # A folder for the JSON failed with "[Errno 21] Is a directory" after planning.
    r = _run(*tiny, f"--json={tmp_path}", "--plot=")
    assert r.returncode != 0 and "--json=" in r.stderr and "is a folder" in r.stderr
    assert "bottleneck" not in r.stdout
    assert not list(tmp_path.iterdir())
    js = tmp_path / "p.json"
    r = _run(*tiny, f"--json={js}", "--plot=/proc/p.png")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error:")
    assert Plan.from_json(js.read_text()).num_stages == 2


def test_a_plan_for_more_devices_than_the_host_says_so():
    # Planned for 16 devices on an 8-device host without a word; train.py refuses the mesh.
    r = _run("--model=gpt", "--size=tiny", "--stages=4", "--data=4", "--microbatches=2",
             "--batch_size=16", "--plot=")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: this plan is for 16 devices (data 4 x pipe 4); this host has" in r.stdout
    r = _run("--model=gpt", "--size=tiny", "--stages=2", "--data=1", "--microbatches=2",
             "--batch_size=8", "--plot=")
    assert r.returncode == 0 and "note:" not in r.stdout
