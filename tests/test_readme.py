"""README.md's two set-up commands stay true: CI runs the test one, the main job exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
    text = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    main_job, tests = cmds
    assert "scripts/train.py --config=inception_hybrid.py" in main_job
    assert (ROOT / "scripts" / "train.py").exists()
    assert (ROOT / "configs" / "inception_hybrid.py").exists()
    assert tests in (ROOT / ".ci" / "run").read_text()
