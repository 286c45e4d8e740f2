"""scripts/bench.py pipeline end to end on a tiny model: every table prints, with numbers."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "scripts", "bench.py")


def test_pipeline_bench_prints_every_table():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "pipeline", "--blocks=3",
         "--width=64", "--microbatch=4", "--repeats=1", "--memory_m=4,8",
         "--memory_schedules=gpipe,1f1b,zb-h1", "--padding_models=gpt", "--speed_widths=64",
         "--speed_schedules=1f1b,zb-h1", "--speed_microbatches=4,8", "--speed_m=8"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    # Memory table: every schedule at both M, and the growth line of each.
    assert len(re.findall(r"^(gpipe|1f1b|zb-h1)\s+4\s+(4|8)\s", out, re.M)) == 6
    assert re.search(r"1f1b: temp memory M=8 / M=4 = \d+\.\d\dx", out)
    assert re.search(r"zb-h1: temp memory M=8 / M=4 = \d+\.\d\dx", out)
    assert re.search(r"gpt\s+layers=\s*4 boundaries=\[\d+, \d+, \d+\] .*padding=\d+\.\d%", out)
    for schedule in ("1f1b", "zb-h1"):     # the Dense+tanh stack at both microbatch sizes
        for mb in (4, 8):
            assert re.search(schedule + rf" M=8 tanh w=64 mb={mb}\s+[\d.]+ ms\s+[\d.]+ ms\s+"
                             r"[\d.]+x\s+[\d.]+ ms\s+[\d.]+x", out)
    assert re.search(r"1x1 pipeline vs plain jax.jit \(mlp\): CPU-seconds .* ratio [\d.]+x; wall", out)


def test_async_bench_prints_the_study_table(tmp_path):
    # The smallest study: GPT on text at S=2, the synchronous baseline and SpecTrain,
    # a few microbatches of 4 (the figures themselves are docs/async.md's, not tested);
    # then the same table again from the saved rows (--from_json).
    bench = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "async",
             f"--cache_dir={tmp_path / 'cache'}"]
    saved = tmp_path / "rows.jsonl"
    r = subprocess.run(bench + ["--tasks=text", "--stages=2", "--schedules=1f1b,spectrain-1t",
                                "--microbatch=4", "--async_microbatches=4", "--examples=32",
                                "--eval_examples=16", f"--json={saved}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    again = subprocess.run(bench + [f"--from_json={saved}"], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    num = r"-?[\d.]+"
    for out in (r.stdout, again.stdout):
        for name in ("1f1b", "spectrain-1t"):   # 8 updates of 4 examples, 32 examples
            assert re.search(rf"^text\s+2 {name}\s+{num}\s+8\s+4\s+32\s+{num}\s+{num}\s+\S+\s+"
                             rf"\S+\s+{num}\s+\S+\s+{num}\s+{num}", out, re.M), out
    assert re.search(r"staleness per stage \[1, 0\]", r.stdout)


def test_plan_bench_prints_the_policy_table():
    r = subprocess.run([sys.executable, BENCH, "plan", "--sections=policy", "--policy_width=16",
                        "--policy_microbatch=8", "--repeats=1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    num = r"[\d.]+"
    assert re.search(rf"^\s+none\s+{num}\s+1\.000\s+1\.000\s+-$", r.stdout, re.M), r.stdout
    # nothing_saveable runs each stage's forward again, as full does (priced alike, but
    # for the last Dense, whose output no backward reads).
    again = re.search(rf"^\s+nothing_saveable\s+{num}\s+{num}\s+({num})\s+(.+)$", r.stdout, re.M)
    full = re.search(rf"^\s+full\s+{num}\s+{num}\s+({num})\s+-$", r.stdout, re.M)
    assert again and full and float(full.group(1)) > 1.2
    assert abs(float(again.group(1)) / float(full.group(1)) - 1) < 0.02
    assert re.search(rf"^\s+dots_saveable\s+{num}\s+{num}\s+{num}\s+0\.\d\d, ", r.stdout, re.M)
    # remat="auto" under the budget: the policy on the stages the layers-only plan
    # recomputes layers in, every step exact.
    auto = re.search(r"^\s+auto (\d), dots_saveable, dots_saveable, (\d) .* True$", r.stdout, re.M)
    layers = re.search(r"^\s+auto, layers only (\d), [1-9]\d*, [1-9]\d*, (\d) .* True$",
                       r.stdout, re.M)
    assert auto and layers and auto.groups() == layers.groups() == ("0", "0"), r.stdout
    assert re.search(r"^\s+none 0, 0, 0, 0 .* True$", r.stdout, re.M)


def test_collectives_bench_prints_every_variant():
    r = subprocess.run([sys.executable, BENCH, "collectives", "--devices=2", "--widths=16",
                        "--microbatches=2,4", "--ticks=3", "--repeats=1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cell = r"\s+(-?[\d.]+) \[\s*(-?[\d.]+)\]\s*"
    for mb in (2, 4):   # six variants per row; `none` is the zero of the extra column
        row = re.search(rf"^\s+16\s+{mb} \|" + r"\|".join([cell] * 6) + "$",
                        r.stdout, re.M)
        assert row, r.stdout
        assert float(row.group(2)) == 0.0 and all(float(x) > 0 for x in row.groups()[::2])


def test_breakdown_bench_sorts_the_pipelined_steps_thunks():
    r = subprocess.run([sys.executable, BENCH, "breakdown", "--width=16", "--microbatch=4",
                        "--blocks=3", "--speed_m=4", "--trace_steps=2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(matmuls|elementwise, other|row reads|row writes|fills|copies|collectives)\s+"
        r"([\d.]+)\s+([\d.]+%)?\s+([\d.]+)\s*([\d.]+%)?\s*$", r.stdout, re.M)}
    assert len(rows) == 7, r.stdout
    assert float(rows["matmuls"][0]) > 0 and float(rows["matmuls"][2]) > 0
    assert float(rows["collectives"][0]) > 0 and rows["collectives"][1] is None
    # Only the pipelined step reads stash and inbox rows (data parallelism keeps none).
    assert float(rows["row reads"][0]) > 0 and float(rows["row reads"][2]) == 0
    moved = re.search(r"data movement .*: ([\d.]+)% of the pipelined step's .*, ([\d.]+)% of "
                      r"DP's", r.stdout)
    assert moved and float(moved.group(1)) > float(moved.group(2)), r.stdout


def test_breakdown_categories_from_compiled_hlo():
    from jaxhybrid.bench.thunk_profile import hlo_categories
    hlo = """HloModule m

%fused_computation.1 (p0: f32[7,8], p1: s32[]) -> f32[8] {
  %p0 = f32[7,8]{1,0} parameter(0)
  %ds = f32[1,8]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={1,8}
  ROOT %b = f32[8]{0} bitcast(%ds)
}

%fused_computation.2 (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %d = f32[4,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_broadcast_computation (p: f32[]) -> f32[7,8] {
  %p = f32[] parameter(0)
  ROOT %b = f32[7,8]{1,0} broadcast(%p), dimensions={}
}

ENTRY %main (a: f32[7,8], i: s32[], w: f32[8,8]) -> f32[4,8] {
  %a = f32[7,8]{1,0} parameter(0)
  %ds_fusion.3 = f32[8]{0} fusion(%a, %i), kind=kLoop, calls=%fused_computation.1
  %ynn_fusion.4 = f32[4,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_computation.2
  %wrapped_broadcast.5 = f32[7,8]{1,0} fusion(%z), kind=kLoop, calls=%wrapped_broadcast_computation
  %copy.6 = f32[7,8]{1,0} copy(%wrapped_broadcast.5)
  %ppermute.7 = f32[8]{0} collective-permute(%ds_fusion.3), source_target_pairs={{0,1}}
  %add.8 = f32[4,8]{1,0} add(%ynn_fusion.4, %ynn_fusion.4)
  %w.9 = (s32[]) while(%t), condition=%c, body=%b
  ROOT %gte = f32[4,8]{1,0} get-tuple-element(%w.9), index=0
}
"""
    assert hlo_categories(hlo) == {
        "ds_fusion.3": "row reads", "ynn_fusion.4": "matmuls", "wrapped_broadcast.5": "fills",
        "copy.6": "copies", "ppermute.7": "collectives", "add.8": "elementwise, other"}


@pytest.mark.parametrize("args,message", [
    (["pipeline", "--speed_widths=abc"], "flag --speed_widths=abc: 'abc' is not a whole number"),
    (["async", "--tasks=foo"], "bench async: --tasks: unknown ['foo']; choose from digits, text."),
    (["sharding", "--meshes=1x2"], "bench sharding: layout '1x2': write data x pipe x model"),
    (["projection", "--val_configs=2x4"], "write [schedule:]data x pipe x microbatches"),
    (["collectives", "--devices=1"], "bench collectives: --devices=1 must be 2..8"),
    (["breakdown", "--speed_m=6"], "bench breakdown: --speed_m=6 must be a multiple of 4"),
    # Its DP-accumulating column was the plain DP program, printed as another figure.
    (["pipeline", "--speed_m=2"], "bench pipeline: --speed_m=2 must be a multiple of 4"),
    # A traceback (FileNotFoundError), and --json over its own --from_json rewrote it.
    (["async", "--from_json=/nonexistent/rows.jsonl"], "bench async: [Errno 2]"),
])
def test_bench_modes_reject_bad_flags_in_one_line(args, message):
    """Before any figure is measured: a bad list entry stops flag parsing; the modes'
    own checks end in one 'bench MODE: ...' line (tracebacks and KeyErrors before)."""
    r = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr + r.stdout


def test_async_refuses_to_write_over_the_rows_it_reads(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(open(os.path.join(ROOT, "docs", "async_study.jsonl"), "rb").read())
    before = rows.read_bytes()
    r = subprocess.run([sys.executable, BENCH, "async", f"--from_json={rows}",
                        f"--json={rows}", "--hardware=h100_dgx"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode != 0 and "is the file --from_json reads" in r.stderr
    assert rows.read_bytes() == before


def test_a_modes_help_lists_its_flags():
    # absl lists only the main module's flags: --help showed none of the mode's.
    r = subprocess.run([sys.executable, BENCH, "pipeline", "--help"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "--speed_m:" in r.stdout + r.stderr


def test_bench_modules_the_tests_import_share_one_process():
    # pytest-xdist may collect test_memory_model.py and test_projection_validation.py in
    # one worker: their bench modules' absl flags must not collide (a 'schedule' flag in
    # both made both files' collection fail with DuplicateFlagError; 'size' from
    # pipeline_bench, when this file imported the breakdown bench, failed a test here).
    code = ("from jaxhybrid.bench import memory_bench, projection_bench, mlp, thunk_profile\n"
            "from jaxhybrid.bench import projection_bench as b; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_projection_refuses_a_stored_fit_of_another_profile_timing(tmp_path):
    # A fit's engine terms are relative to how its layers were timed: reusing a fit made
    # with --profile_timing=loop for layers timed alone would mis-predict every row.
    import jax

    from jaxhybrid.plan import calibration
    from jaxhybrid.plan.hardware import measured_device
    assert jax.device_count() == 8   # the same device key as the bench's process
    calibration.save(measured_device("fit", mem_bandwidth=5e9, devices_per_node=8), tmp_path,
                     {"profile_timing": "loop"})
    r = subprocess.run([sys.executable, BENCH, "projection", "--calibration=stored",
                        f"--cache_dir={tmp_path}", "--profile_timing=alone"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert ("the stored calibration was fitted with --profile_timing=loop; pass that, or "
            "--calibration=fit") in r.stderr + r.stdout
