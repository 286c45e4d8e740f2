"""Command-line details of scripts/project.py, burst.py, launch_local.py and
`bench.py sharding`: their documented examples run as written, and misuse is one line
naming the fix, before any work."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
ENV = {**os.environ, "PYTHONPATH": ROOT,
       "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
LOG = re.compile(r"^[IWEF]\d{4} ")   # absl/jax log lines (e.g. "no libtpu"), not messages


def run(script, *args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args],
                          capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def message_lines(stderr):
    return [l for l in stderr.strip().splitlines() if l.strip() and not LOG.match(l)]


def assert_one_line_error(r, text):
    lines = message_lines(r.stderr)
    assert r.returncode != 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and text in lines[0], r.stderr[-2000:]


def example(text, marker):
    """The arguments of the first example line holding `marker`, with its backslash
    continuations and without the trailing comment or `python scripts/x.py`."""
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if marker in l)
    cmd = lines[i]
    while cmd.rstrip().endswith("\\"):
        i += 1
        cmd = cmd.rstrip()[:-1] + " " + lines[i]
    args = shlex.split(cmd.strip().strip("`"), comments=True)
    return args[2:]   # drop "python", "scripts/x.py"


# --- 1. project.py: the --help GPT example ---------------------------------------------

def test_project_help_gpt_example_runs(tmp_path):
    help_text = run("project.py", "--help").stdout
    # A single backslash in the (non-raw) docstring swallowed the line break.
    assert not re.search(r"--per_worker_batch=8 +--model_degrees", help_text), help_text[:800]
    args = example(help_text, "--model=gpt")
    assert "--model_degrees=1,2,4" in args and any(a.startswith("--stat_points=") for a in args)
    # The docs' version is the same command.
    with open(os.path.join(ROOT, "docs", "projection.md")) as f:
        docs = f.read()
    quoted = re.search(r"`python scripts/project.py (--model=gpt[^`]*)`", docs).group(1)
    assert shlex.split(quoted) == args
    r = run("project.py", *args, "--devices=8,16", "--out=", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best hybrid" in r.stdout or "crossover" in r.stdout, r.stdout[-2000:]


# --- 2. burst.py: the --plot examples ------------------------------------------------

@pytest.mark.parametrize("source", ["help", "docs"])
def test_burst_plot_examples_run(tmp_path, source):
    if source == "help":
        text = run("burst.py", "--help").stdout
    else:
        with open(os.path.join(ROOT, "docs", "burst.md")) as f:
            text = f.read()
    args = example(text, "--plot=")
    assert any(a.startswith("--hardware=") for a in args), args
    plot = str(tmp_path / "chart.png")
    args = [f"--plot={plot}" if a.startswith("--plot=") else a for a in args]
    r = run("burst.py", *args, "--size=tiny", f"--cache_dir={tmp_path / 'cache'}",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isfile(plot) and f"wrote {plot}" in r.stderr, r.stderr[-2000:]


def test_burst_plot_default_hardware_names_the_fix(tmp_path):
    r = run("burst.py", "--model=inception_v3", "--devices=8", f"--plot={tmp_path / 'p.png'}")
    assert_one_line_error(r, "--hardware=v100_dgx1")
    # An explicit list of clusters is still refused, without the hint about the default.
    r = run("burst.py", "--model=inception_v3", "--devices=8",
            "--hardware=v100_dgx1,h100_dgx", f"--plot={tmp_path / 'p.png'}")
    assert_one_line_error(r, "give one --model and one --hardware, not 1 x 2.")


# --- 3. stray positional arguments -----------------------------------------------------

@pytest.mark.parametrize("script,args", [("project.py", ["extra", "--out="]),
                                         ("burst.py", ["--model=inception_v3", "extra"])])
def test_unexpected_arguments_refused(tmp_path, script, args):
    r = run(script, *args, cwd=tmp_path)
    assert_one_line_error(r, "unexpected arguments ['extra']")
    assert r.stdout == ""


# --- 4. the PNG paths ------------------------------------------------------------------

@pytest.mark.parametrize("script,args", [
    ("project.py", ["--out=x.jpg"]),
    ("burst.py", ["--model=inception_v3", "--devices=8", "--hardware=v100_dgx1",
                  "--plot=x.jpg"])])
def test_chart_suffix_other_than_png_refused(tmp_path, script, args):
    r = run(script, *args, cwd=tmp_path)
    assert_one_line_error(r, "=x.jpg: the charts are PNGs")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script,args", [
    ("project.py", ["--out={}"]),
    ("burst.py", ["--model=inception_v3", "--devices=8", "--hardware=v100_dgx1",
                  "--plot={}"])])
def test_chart_path_folder_refused(tmp_path, script, args):
    r = run(script, *[a.format(str(tmp_path) + os.sep) for a in args], cwd=tmp_path)
    assert_one_line_error(r, "is a folder, or names a folder")


def test_project_out_without_suffix_writes_and_prints_png(tmp_path):
    r = run("project.py", "--devices=8", f"--out={tmp_path / 'noext'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.listdir(tmp_path) == ["noext.png"]
    assert f"wrote {tmp_path / 'noext.png'}" in r.stderr, r.stderr[-2000:]


def test_burst_plot_without_suffix_writes_and_prints_png(tmp_path):
    r = run("burst.py", "--model=inception_v3", "--devices=8", "--hardware=v100_dgx1",
            "--nobranches", f"--plot={tmp_path / 'noext'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.listdir(tmp_path) == ["noext.png"]
    assert f"wrote {tmp_path / 'noext.png'}" in r.stderr, r.stderr[-2000:]


# --- 5. project.py: statistical-efficiency flags named --------------------------------

@pytest.mark.parametrize("flag", ["--e_min=inf", "--b_noise=inf", "--max_batch=inf",
                                  "--dataset_size=inf", "--e_min=nan", "--e_min=-1"])
def test_project_stat_flags_checked_by_name(tmp_path, flag):
    r = run("project.py", flag, "--out=", cwd=tmp_path)
    assert_one_line_error(r, f"{flag} must be a finite number > 0")
    assert "StatEfficiency" not in r.stderr


# --- 6. bench.py sharding: flags of the other mode ------------------------------------

@pytest.mark.parametrize("args,text", [
    (["--layouts=3x3x3"], "--layouts: only with --largest"),
    (["--largest", "--meshes=2x2x1"], "--meshes: only without --largest")])
def test_sharding_bench_flags_of_the_other_mode_refused(args, text):
    r = run("bench.py", "sharding", *args)
    assert_one_line_error(r, text)
    assert r.stdout == ""


def test_sharding_bench_layouts_help_names_largest():
    r = run("bench.py", "sharding", "--help")
    flat = " ".join(r.stdout.split())
    assert "--layouts: data x pipe x model (z: ZeRO) layouts for --largest" in flat, flat[-3000:]


# --- 7. launch_local.py: --script checked before starting ------------------------------

def test_launch_local_missing_script_refused_before_start(tmp_path):
    missing = str(tmp_path / "nonexistent.py")
    r = run("launch_local.py", "--processes=2", f"--script={missing}", "--", "--x=1",
            timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "pid" not in r.stdout and "can't open file" not in r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]   # argparse's style: usage, then the error
    assert last.startswith("launch_local.py: error: --script=") and missing in last, r.stderr
