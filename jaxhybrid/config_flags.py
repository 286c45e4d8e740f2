"""Config files: `get_config()` modules under the repository's `configs/` directory.

    from jaxhybrid import config_flags
    _CONFIG = config_flags.define_config_flag()        # --config=inception_hybrid.py
    config = config_flags.load_config("gpt_hybrid.py", {"train.steps": 10})

A config is named by a path, or by a bare file name ("inception_hybrid.py" or just
"inception_hybrid") looked up in `configs/`. Configs are locked after loading, so a
misspelt override (`--config.train.stepz=3`, `{"train.stepz": 3}`) fails instead of
adding a field nobody reads.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import sys
import traceback
from typing import Any, Mapping

import ml_collections
from absl import flags
from ml_collections.config_dict import placeholder
from ml_collections.config_flags import config_flags as _ml_impl

# configs/ sits beside the package in the repository (an editable install keeps it there).
CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def base_config() -> ml_collections.ConfigDict:
    """Every field a training config has, with neutral defaults; config files start
    from this and set what their recipe needs (docs/training.md describes each field)."""
    c = ml_collections.ConfigDict()
    c.model = dict(name="", size="small", overrides={},
                   # One Flax module by import path instead of a registered name (the
                   # pipeline splits it): "package.module:factory", called with kwargs;
                   # loss: "classification", "token" or "package.module:loss_fn".
                   module=placeholder(str), kwargs={}, loss=placeholder(str))
    c.mesh = dict(data=-1, pipe=1,                 # one of them may be -1: the rest
                  model=1)                         # tensor parallel degree (docs/training.md)
    c.pipeline = dict(schedule="1f1b", num_microbatches=1, remat="auto",
                      virtual_stages=2,                   # stages per device ("interleaved")
                      memory_budget=placeholder(str),     # e.g. "8GB"; None: no budget
                      boundaries=placeholder(tuple))      # None: the planner decides
    c.train = dict(steps=100, batch_size=32, learning_rate=1e-3, warmup_steps=0,
                   weight_decay=0.0, optimizer="adamw", momentum=0.9, grad_clip_norm=0.0,
                   log_every=10, eval_every=0, eval_steps=0, seed=0,
                   zero=0)                          # 1: optimizer state sharded over data
    c.data = dict(name=placeholder(str), options={})      # name None: the model's dataset
    c.checkpoint = dict(every=0, keep=2)            # every 0: only at the end
    c.profile = dict(enabled=False, start_step=10, num_steps=5)
    return c


def available_configs() -> list[str]:
    """File names of the config files in `configs/`."""
    if not CONFIG_DIR.is_dir():
        return []
    return sorted(p.name for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))


def resolve_config_path(name_or_path: str) -> str:
    """An existing path as is; otherwise the name (".py" optional) inside `configs/`.
    Neither -> ValueError listing the available configs."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isfile(path):
        return path
    if os.path.dirname(path) == "":            # a bare name: look in configs/
        for candidate in (CONFIG_DIR / path, CONFIG_DIR / f"{path}.py"):
            if candidate.is_file():
                return str(candidate)
    raise ValueError(f"config {name_or_path!r} is neither a file nor a config in {CONFIG_DIR}; "
                     f"available: {', '.join(available_configs()) or 'none'}.")


class ConfigFileError(ValueError):
    """A config file that cannot be read or run; one line naming the file (and line)."""


@contextlib.contextmanager
def config_file_errors(file: str):
    """Turns what a config file raises while it loads and runs get_config() into one
    ConfigFileError line: what and where (a syntax error or the user's own exception
    ended train.py and plan.py in a 27-58 line traceback)."""
    try:
        yield
    except ConfigFileError:
        raise
    except SyntaxError as e:
        raise ConfigFileError(f"{file}:{e.lineno}: {e.msg}; fix the config file's "
                              f"syntax.") from None
    except AttributeError as e:
        if "get_config" in str(e):   # ml_collections' loader calls it unchecked
            raise ConfigFileError(_no_get_config(file)) from None
        raise ConfigFileError(_raised(file, e)) from None
    except Exception as e:   # noqa: BLE001  (get_config raised; ml_collections re-raises
        # TypeError / ValueError with the whole traceback in the message)
        raise ConfigFileError(_raised(file, e.__context__ if isinstance(
            e, (TypeError, ValueError)) and str(e).startswith("Error whilst parsing")
            and e.__context__ else e)) from None


def _no_get_config(file: str) -> str:
    return (f"config file {file} has no get_config() function; define get_config() "
            f"returning an ml_collections.ConfigDict (examples in {CONFIG_DIR}).")


def _raised(file: str, error: BaseException) -> str:
    """What get_config() raised, at the innermost line of the config file itself."""
    where = [f for f in traceback.extract_tb(error.__traceback__)
             if os.path.abspath(f.filename) == os.path.abspath(file)]
    at = f"{file}:{where[-1].lineno}" if where else file
    return f"{at}: get_config() raised {type(error).__name__}: {error}; fix the config file."


def _load_module(path: str):
    module_name = "jaxhybrid_config_" + pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigFileError(_no_get_config(path))
    return module


def config_keys(node: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field of `node` ("train.steps", ...)."""
    out = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.extend(config_keys(value, full + "."))
        else:
            out.append(full)
    return out


def _parent_of(config: ml_collections.ConfigDict, key: str):
    """(the ConfigDict holding dotted `key`, its last part); unknown -> ValueError."""
    parts = key.split(".")
    node = config
    for depth, part in enumerate(parts):
        # An open group (model.overrides, see `open_model_options`) takes new keys.
        new_in_open = (depth == len(parts) - 1 and isinstance(node, ml_collections.ConfigDict)
                       and not node.is_locked)
        if not new_in_open and (not isinstance(node, ml_collections.ConfigDict)
                                or part not in node):
            prefix = ".".join(parts[:depth])
            valid = (config_keys(node, prefix + "." if prefix else "")
                     if isinstance(node, ml_collections.ConfigDict) else [])
            raise ValueError(f"config: unknown key {key!r}; valid keys"
                             f"{' under ' + repr(prefix) if prefix else ''}: "
                             f"{', '.join(valid) or '(none: ' + prefix + ' is a value)'}.")
        if depth < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def open_model_options(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Unlocks config.model.overrides, model.kwargs and data.options in a locked config: they
    hold any of the model's or dataset's options (`--config.model.overrides.num_heads=2`
    for one the config file does not name); the model and the dataset refuse unknown
    ones, naming their valid options."""
    for group, field in (("model", "overrides"), ("model", "kwargs"), ("data", "options")):
        # data.options too: a dataset's option the config file does not set was refused
        # with the file's keys as "valid keys"; the dataset checks the names itself. And
        # model.kwargs: the arguments of a researcher's own factory (model.module).
        node = config.get(group) if isinstance(config, ml_collections.ConfigDict) else None
        if isinstance(node, ml_collections.ConfigDict) and isinstance(
                node.get(field), ml_collections.ConfigDict):
            node[field].unlock()
    return config


def set_dotted(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """config[a][b][c] = value for key "a.b.c"; an unknown key or a value of the wrong
    type -> ValueError in one line naming the valid keys / the expected type."""
    node, last = _parent_of(config, key)
    try:
        node[last] = value
    except (TypeError, ValueError) as e:
        raise ValueError(f"config: cannot set {key}={value!r}: "
                         f"{str(e).splitlines()[0]}") from None


def none_overrides(config: ml_collections.ConfigDict, args, name: str = "config"
                   ) -> ml_collections.ConfigDict:
    """Applies `--<name>.a.b=None` of the command line `args` as None: ml_collections
    parses it by the field's type, as the string 'None' or the tuple (None,), so a config
    file's budget, boundaries, dataset or loss could not be set back to "none given"."""
    prefix, args = f"--{name}.", list(args)
    for i, arg in enumerate(args):
        if not arg.startswith(prefix):
            continue
        key, eq, value = arg[len(prefix):].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value == "None":
            set_dotted(config, key, None)
    return config


def load_config(name_or_path: str, overrides: Mapping[str, Any] | None = None
                ) -> ml_collections.ConfigDict:
    """The locked ConfigDict of a config file, with dotted-key `overrides` applied, e.g.
    {"train.steps": 10, "model.size": "tiny", "mesh": {"data": 4, "pipe": 2}} (a dict
    value for a group sets the keys it names, nothing else)."""
    path = resolve_config_path(name_or_path)
    with config_file_errors(path):
        config = _load_module(path).get_config()
    if not isinstance(config, ml_collections.ConfigDict):
        raise ValueError(f"config file {path}: get_config() returned "
                         f"{type(config).__name__}; return an ml_collections.ConfigDict.")
    open_model_options(config.lock())
    for key, value in _flatten(overrides or {}).items():
        set_dotted(config, key, value)
    return config


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> dict:
    out = {}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and not isinstance(value, ml_collections.ConfigDict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _ResolvingParser(_ml_impl.ConfigFileFlagParser):
    """ml_collections' config-file parser that first resolves bare names in configs/
    and reports a missing file in one line (ml_collections defers a multi-line
    IOError until the config is first read)."""

    def parse(self, path):
        if not isinstance(path, str):
            return path   # already a config (e.g. a default set programmatically)
        name, colon, arg = path.partition(":")
        file = resolve_config_path(name)
        # ml_collections runs the file in sys.modules' "<flag>_config" module if one is
        # there: a file without get_config() then ran the previous config's.
        sys.modules.pop(f"{self.name}_config", None)
        with config_file_errors(file):
            config = super().parse(file + colon + arg)
        return open_model_options(config)


class _CheckedConfigFlag(_ml_impl._ConfigFlag):  # pylint: disable=protected-access
    """ml_collections' config flag; an unknown `--config.a.b=` key is reported as a flag
    error in one line naming the valid keys (ml_collections raises a bare
    AttributeError with a traceback)."""

    def _parse(self, argument):
        try:
            config = self.parser.parse(argument)
        except ValueError as e:
            raise flags.IllegalFlagValueError(f"flag --{self.name}={argument}: {e}") from None
        if isinstance(config, ml_collections.ConfigDict):
            for key in self._GetOverrides(self._GetArgv()):
                try:
                    _parent_of(config, key)
                except ValueError as e:
                    raise flags.IllegalFlagValueError(f"flag --{self.name}.{key}: {e}") from None
        return super()._parse(argument)


def define_config_flag(name: str = "config", default: str | None = None,
                       help_string: str | None = None,
                       flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
    """`--<name>=<config file or name in configs/>` with `--<name>.a.b=value` overrides
    (ml_collections config_flags). The config is locked: unknown keys are flag errors."""
    help_string = help_string or (f"config file, or a name in {CONFIG_DIR} "
                                  f"({', '.join(available_configs())}); override fields "
                                  f"with --{name}.train.steps=10 etc.")
    # ml_collections builds its parser inside DEFINE_config_file; this is the same flag
    # class, given our resolving parser (ml_collections is pinned <2 in setup.py). New
    # attributes are accepted only where _CheckedConfigFlag lets them (model.overrides):
    # their values are parsed as Python literals (else strings).
    flag = _CheckedConfigFlag(
        parser=_ResolvingParser(name=name, lock_config=True),
        serializer=flags.ArgumentSerializer(), name=name, default=default,
        help_string=help_string, flag_values=flag_values, accept_new_attributes=True)
    return flags.DEFINE_flag(flag, flag_values)


class IntListParser(flags.ListParser):
    """absl parser of a comma-separated list of whole numbers >= `minimum`: a bad entry
    stops flag parsing with one line naming the flag, the entry and the form to use."""

    def __init__(self, minimum: int = 1):
        super().__init__()
        self.minimum = minimum

    def parse(self, argument) -> list[int]:
        out = []
        for item in super().parse(argument):
            text = str(item).strip()
            if not (text.lstrip("-").isdigit() and int(text) >= self.minimum):
                raise ValueError(f"{item!r} is not a whole number >= {self.minimum}; write e.g. "
                                 f"{self.minimum},{2 * max(self.minimum, 1)}")
            out.append(int(text))
        return out

    def flag_type(self) -> str:
        return "comma-separated list of ints"


def define_int_list(name: str, default, help: str, minimum: int = 1) -> None:   # noqa: A002
    """absl's DEFINE_list for whole numbers: `FLAGS.<name>` is a list of ints, checked
    when the flags are parsed (`IntListParser`)."""
    # Filed under the caller's module, so the script's `--help` lists it (absl lists the
    # main module's flags, and files a flag under the module that called DEFINE: here).
    caller = sys._getframe(1).f_globals.get("__name__", "")
    flags.DEFINE(IntListParser(minimum), name, default, help,
                 serializer=flags.CsvListSerializer(","),
                 module_name=sys.argv[0] if caller == "__main__" else caller)


__all__ = ["CONFIG_DIR", "IntListParser", "available_configs", "base_config", "config_keys",
           "define_config_flag", "define_int_list", "load_config", "open_model_options",
           "resolve_config_path", "set_dotted"]
