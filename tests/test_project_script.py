"""scripts/project.py as users run it: JSON on stdout, a PNG, clear errors."""
import json
import os
import subprocess
import sys

from jaxhybrid.plan import hybrid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "project.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_json_png_and_errors(tmp_path):
    png = tmp_path / "p.png"
    out = _run("--model=inception_v3", "--devices=8,64,1024", "--json", f"--out={png}")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)                     # stdout is pure JSON
    assert data["devices"] == [8, 64, 1024] and len(data["summary"]) == 3
    assert data["summary"][0]["dp"]["pipe"] == 1 and data["summary"][0]["hybrid"]["pipe"] > 1
    assert data["summary"][-1]["winner"] == "hybrid" and data["crossover"] == 1024
    assert "configs" not in data and data["stat_efficiency"]["b_noise"] == 16384.0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # The script's numbers are the library's.
    proj = hybrid.project("inception_v3", [8, 64, 1024], "v100_dgx1")
    want = proj.at_scale()["speedup"]
    assert abs(data["at_scale"]["speedup"] - want) < 1e-9 * want
    bad = _run("--model=inception_v3", "--hardware=tpu", "--out=")
    assert bad.returncode != 0 and "unknown hardware 'tpu'" in bad.stderr
    bad = _run("--model=resnet", "--out=")
    assert bad.returncode != 0 and "--model='resnet' has no reference costs" in bad.stderr
    bad = _run("--model=gpt", "--out=")   # a jaxhybrid model: the flags that project it
    assert bad.returncode != 0 and "use --costs=profile --per_worker_batch=N" in bad.stderr
    bad = _run("--model=gnmt", "--devices=8,abc", "--out=")
    assert bad.returncode != 0 and "flag --devices=8,abc: 'abc' is not a whole number >= 1" in bad.stderr
    bad = _run("--model=gnmt", "--zero=2", "--out=")
    assert bad.returncode != 0 and "ZeRO settings are 0" in bad.stderr


def test_runs_from_outside_the_repository_without_the_package(tmp_path):
    # The package is installed (editable) here: take it off the import path, as on a
    # machine where it is not, then run the script from elsewhere as `python project.py`
    # would (sys.path[0] = scripts/). It imported jaxhybrid with no path of its own.
    code = (
        "import importlib.util, os, runpy, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n"
        "sys.path[:] = [p for p in sys.path\n"
        "               if p and not os.path.isdir(os.path.join(p, 'jaxhybrid'))]\n"
        "assert importlib.util.find_spec('jaxhybrid') is None, 'still importable'\n"
        f"sys.path.insert(0, {os.path.dirname(SCRIPT)!r})\n"
        f"sys.argv = [{SCRIPT!r}, '--help']\n"
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert "still importable" not in r.stderr and "No module named" not in r.stderr, r.stderr
    assert "--profile_batch" in r.stdout   # absl's --help page (exit status 1)


def test_sizes_are_refused_when_the_flags_are_parsed():
    # --profile_batch=0 profiled for ~11 s, then a ZeroDivisionError scaling the costs;
    # -2: "negative dimensions are not allowed".
    for value in ("0", "-2"):
        bad = _run("--model=inception_v3", "--devices=8", "--costs=profile", "--size=tiny",
                   f"--profile_batch={value}", "--out=")
        assert bad.returncode != 0 and "Traceback" not in bad.stderr
        assert f"flag --profile_batch={value}: {value} is not a positive integer" in bad.stderr
    bad = _run("--model=gnmt", "--devices=8", "--max_pipe=0", "--out=")
    assert bad.returncode != 0 and "flag --max_pipe=0: 0 is not a positive integer" in bad.stderr


def test_device_counts_without_a_hybrid_and_no_crossover():
    # N=1 printed a hybrid of "nan" ms and a speedup of nan, and "crossover N = None".
    bad = _run("--model=inception_v3", "--devices=1,2,3", "--out=")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--devices: N=1 has no hybrid layout to compare DP-only with" in bad.stderr
    bad = _run("--model=inception_v3", "--devices=2,8", "--max_pipe=1", "--out=")
    assert bad.returncode != 0 and "N=2,8 have no hybrid layout" in bad.stderr
    assert "raise --max_pipe" in bad.stderr
    # A model degree dividing no N named a pipe dividing N as missing (pipe 2 divides 8).
    bad = _run("--model=inception_v3", "--devices=8", "--model_degrees=3", "--out=")
    assert bad.returncode != 0 and "a model degree from --model_degrees=3 dividing N" \
        in bad.stderr
    out = _run("--model=inception_v3", "--devices=2,3", "--out=")
    assert out.returncode == 0, out.stderr
    assert "no crossover (hybrid wins at no N in 2,3)" in out.stdout
    assert "None" not in out.stdout and "nan" not in out.stdout
    out = _run("--model=inception_v3", "--devices=2,3", "--json", "--all_configs", "--out=")
    assert out.returncode == 0, out.stderr

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    data = json.loads(out.stdout, parse_constant=refuse)   # no NaN / Infinity
    assert data["crossover"] is None and all(s["winner"] == "dp" for s in data["summary"])
