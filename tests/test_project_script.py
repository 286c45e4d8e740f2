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
