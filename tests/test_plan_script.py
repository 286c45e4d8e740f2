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
    # Zero sizes are named (--stages=0 divided by zero; --microbatches=0 took a modulo by 0).
    r = _run("--model=gpt", "--size=tiny", "--stages=0", "--plot=")
    assert r.returncode != 0 and "mesh.pipe (--stages)=0 must be >= 1" in r.stderr
    r = _run("--model=gpt", "--size=tiny", "--stages=2", "--data=1", "--microbatches=0",
             "--plot=")
    assert r.returncode != 0 and "num_microbatches=0 must be >= 1" in r.stderr
