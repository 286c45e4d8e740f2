"""Config files: name resolution, overrides, unknown keys; scripts/train.py end to end."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from jaxhybrid import config_flags
from jaxhybrid.config_flags import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ["biglstm_hybrid.py", "gnmt_hybrid.py", "gpt_hybrid.py", "inception_hybrid.py"]


def test_every_config_has_exactly_the_base_fields():
    assert set(CONFIGS) <= set(config_flags.available_configs())
    base = set(config_flags.config_keys(config_flags.base_config(), ""))
    for name in CONFIGS:
        keys = set(config_flags.config_keys(load_config(name), ""))
        free = {k for k in keys if k.startswith(("model.overrides.", "data.options."))}
        assert keys - free == base, name


@pytest.mark.parametrize("spelling", ["inception_hybrid.py", "inception_hybrid",
                                      str(ROOT / "configs" / "inception_hybrid.py")])
def test_bare_names_resolve_in_configs_dir(spelling):
    assert load_config(spelling).model.name == "inception_v3"


def test_missing_config_lists_the_available_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'nope.py'.*available: .*gpt_hybrid.py") as e:
        load_config("nope.py")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="neither a file"):
        load_config(str(tmp_path / "missing.py"))   # a path is never looked up in configs/


def test_overrides_dotted_and_nested_and_typed():
    c = load_config("gpt_hybrid.py", {"train.steps": 7, "mesh": {"data": 4, "pipe": 2},
                                      "train.learning_rate": 1, "pipeline.boundaries": [2]})
    assert (c.train.steps, c.mesh.data, c.mesh.pipe) == (7, 4, 2)
    assert c.train.learning_rate == 1.0 and isinstance(c.train.learning_rate, float)
    assert tuple(c.pipeline.boundaries) == (2,)
    with pytest.raises(ValueError, match=r"cannot set train.steps='ten'"):
        load_config("gpt_hybrid.py", {"train.steps": "ten"})


def test_unknown_keys_fail_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown key 'train.stepz'; valid keys under "
                                         r"'train': .*train.steps") as e:
        load_config("gpt_hybrid.py", {"train.stepz": 1})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError,
                       match=r"unknown key 'trian.steps'; valid keys: .*mesh.data.*train.steps"):
        load_config("gpt_hybrid.py", {"trian.steps": 1})


def test_configs_are_locked():
    c = load_config("gpt_hybrid.py")
    with pytest.raises(AttributeError):
        c.train.stepz = 3


def _parse(argv):
    values = flags.FlagValues()
    holder = config_flags.define_config_flag("config", flag_values=values)
    values(["prog", *argv])
    return holder.value


def test_flag_resolves_names_and_applies_overrides(monkeypatch):
    argv = ["--config=gnmt_hybrid.py", "--config.train.steps=10", "--config.mesh.pipe=2"]
    monkeypatch.setattr(sys, "argv", ["prog", *argv])    # ml_collections reads overrides here
    config = _parse(argv)
    assert config.model.name == "gnmt" and config.train.steps == 10 and config.mesh.pipe == 2


def test_flag_with_missing_config_or_unknown_key_is_a_flag_error(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "--config=nope.py"])
    with pytest.raises(flags.IllegalFlagValueError, match="available: "):
        _parse(["--config=nope.py"])
    argv = ["--config=gpt_hybrid.py", "--config.train.stepz=3"]
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    with pytest.raises(flags.IllegalFlagValueError,
                       match=r"unknown key 'train.stepz'; valid keys under 'train': .*train.steps"):
        _parse(argv)


@pytest.mark.parametrize("text,message", [
    ("def get_config(:\n", r"broken.py:1: invalid syntax; fix the config file's syntax\.$"),
    ("x = 1\n", r"broken.py has no get_config\(\) function; define get_config\(\)"),
    ("def get_config():\n    return undefined\n",
     r"broken.py:2: get_config\(\) raised NameError: name 'undefined' is not defined"),
    ("def get_config():\n    raise ValueError('bad width')\n",
     r"broken.py:2: get_config\(\) raised ValueError: bad width; fix the config file\.$"),
])
def test_a_config_file_that_fails_to_run_is_one_line_naming_where(tmp_path, monkeypatch,
                                                                    text, message):
    """A syntax error, no get_config or get_config raising ended train.py and plan.py in
    27-58 lines of traceback (ml_collections' own parser and our loader alike)."""
    path = tmp_path / "broken.py"
    path.write_text(text)
    with pytest.raises(config_flags.ConfigFileError, match=message) as e:
        load_config(str(path))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(sys, "argv", ["prog", f"--config={path}"])
    with pytest.raises(flags.IllegalFlagValueError, match=message) as e:
        _parse([f"--config={path}"])
    assert "\n" not in str(e.value)


def test_any_model_option_can_be_overridden_by_its_own_key(monkeypatch):
    # gpt_hybrid.py names only dropout_rate: num_heads was "unknown key" (the whole-dict
    # form --config.model.overrides="{...}" was the only way, and dropped dropout_rate).
    argv = ["--config=gpt_hybrid.py", "--config.model.overrides.num_heads=2",
            "--config.model.overrides.dtype=bfloat16", "--config.model.overrides.tied=false"]
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    assert dict(_parse(argv).model.overrides) == {"dropout_rate": 0.1, "num_heads": 2,
                                                  "dtype": "bfloat16", "tied": False}
    c = load_config("gpt_hybrid.py", {"model.overrides.num_heads": 2})
    assert dict(c.model.overrides) == {"dropout_rate": 0.1, "num_heads": 2}
    for key in ("model.stepz", "model.overrides.a.b"):   # only options, one level deep
        with pytest.raises(ValueError, match=f"unknown key '{key}'"):
            load_config("gpt_hybrid.py", {key: 1})


def _script_env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"     # the script must add the 8 devices itself
    return env


def test_script_trains_the_default_config_for_two_steps(tmp_path):
    """scripts/train.py end to end (also the 2-step smoke run of the Inception config)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=inception_hybrid.py",
           "--config.train.steps=2", "--config.model.size=tiny", "--config.train.batch_size=16",
           "--config.train.eval_steps=1", "--config.pipeline.boundaries=(3, 6, 11)",
           f"--workdir={tmp_path}", f"--cache_dir={tmp_path / 'cache'}"]
    # ~2-3 min on two quiet cores (compiles Inception's train and eval programs); the
    # margin is for loaded CI hosts (it took 600 s at load average 8).
    out = subprocess.run(cmd, capture_output=True, text=True, env=_script_env(), timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step=2" in out.stdout and "eval_accuracy=" in out.stdout
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 2 and 0 <= recs[-1]["eval_accuracy"] <= 1
    # The summary line's figures to 5 significant digits (the warm-up's 3.3e-4 was 0.0003).
    final = dict(f.split("=", 1) for f in out.stdout.strip().splitlines()[-1].split())
    assert float(final["learning_rate"]) == pytest.approx(recs[-1]["learning_rate"], rel=1e-4)
    assert (tmp_path / "checkpoints" / "2").is_dir()
    assert "orbax" not in out.stderr                         # its INFO chatter is filtered
    assert "start-up: plan" in out.stderr and "launch -> first step done" in out.stderr
    assert any((tmp_path / "cache" / "xla").iterdir())      # compiled programs kept


def test_script_reports_a_bad_config_in_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=gpt_hybrid.py",
           "--config.mesh.data=16", "--config.mesh.pipe=1", f"--workdir={tmp_path / 'w'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_script_env(), timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("error: mesh")
    assert "only 8 are available" in out.stderr
    assert not (tmp_path / "w").exists()


def test_a_datasets_option_the_config_file_does_not_set_is_taken():
    # data.options was locked: test_fraction (a digits option the file does not set)
    # was refused with the file's keys as the "valid keys"; a misspelt one is the
    # dataset's to refuse, naming its options.
    from jaxhybrid import train
    config = load_config("inception_hybrid.py", {"data.options.test_fraction": 0.25,
                                                 "model.size": "tiny"})
    assert config.data.options.test_fraction == 0.25
    with pytest.raises(ValueError, match="test_fractoin"):
        train.prepare(load_config("inception_hybrid.py", {"data.options.test_fractoin": 0.25}))


def test_a_factorys_own_argument_can_be_given_by_its_key():
    # model.kwargs stayed locked: --config.model.kwargs.hidden=16 for a researcher's own
    # factory (gpt_module.py's model.module) was refused with GPT's kwargs as "valid keys".
    config = load_config("gpt_module.py", {"model.kwargs.hidden": 16})
    assert config.model.kwargs.hidden == 16 and config.model.kwargs.size == "small"


def test_none_on_the_command_line_is_none(monkeypatch):
    # ml_collections parsed it by the field's type: the string 'None' ("cannot read size
    # 'None'", "unknown dataset 'None'") or the tuple (None,) for boundaries.
    argv = ["--config=gpt_module.py", "--config.pipeline.memory_budget=None",
            "--config.pipeline.boundaries", "None", "--config.model.loss=None",
            "--config.train.steps=3"]
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    config = config_flags.none_overrides(_parse(argv), argv)
    assert config.pipeline.memory_budget is None and config.pipeline.boundaries is None
    assert config.model.loss is None and config.train.steps == 3


def test_script_takes_none_from_the_command_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=gpt_module.py",
           "--config.data.name=None", f"--workdir={tmp_path / 'w'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_script_env(), timeout=300)
    assert out.returncode != 0        # the module needs a dataset: refused as None, by name
    assert out.stderr.strip().splitlines()[-1].startswith("error: model.module=")
    assert "needs data.name" in out.stderr and "unknown dataset" not in out.stderr
