"""The compiled training step's memory against the device and the budget
(`train.check_step_memory`): a step that cannot fit the device is refused with the fix
before the first step; one over `pipeline.memory_budget` (the planner's model fell
short) gets a warning with the figures."""
import logging
import types

import jax
import jax.numpy as jnp
import pytest

from jaxhybrid import train


def fake(argument=0, output=0, temp=0, alias=0):
    stats = types.SimpleNamespace(argument_size_in_bytes=argument, output_size_in_bytes=output,
                                  temp_size_in_bytes=temp, alias_size_in_bytes=alias)
    return types.SimpleNamespace(memory_analysis=lambda: stats)


def test_the_compiled_bytes_are_arguments_outputs_and_temporaries_less_aliases():
    line = train.check_step_memory(fake(4_000_000, 1_000_000, 6_000_000, 1_000_000),
                                   None, 9_500_000, None)
    assert line == ("memory per device: the compiled step needs 10MB "
                    "(the planner's model: 9.5MB)")


def test_a_step_over_the_device_memory_is_refused_naming_the_fix():
    with pytest.raises(train.ConfigError, match=r"needs 12MB per device, more than the "
                                                r"device's 8MB; set pipeline.remat='full'") as e:
        train.check_step_memory(fake(temp=12_000_000), None, None, 8_000_000)
    assert "\n" not in str(e.value)


def test_a_step_over_the_budget_is_a_warning_with_the_figures(caplog):
    with caplog.at_level(logging.WARNING):
        line = train.check_step_memory(fake(temp=3_000_000), "2MB", 1_900_000, None)
    assert line.startswith("memory per device: the compiled step needs 3MB")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("over pipeline.memory_budget=2MB (the planner's model: 1.9MB); lower the "
               "budget by 1MB" in m for m in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.check_step_memory(fake(temp=1_000_000), "2MB", 900_000, 8_000_000)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_real_compiled_step_and_a_backend_without_the_analysis():
    compiled = jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((64, 64))).compile()
    ma = compiled.memory_analysis()
    need = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)
    assert need >= 2 * 64 * 64 * 4
    with pytest.raises(train.ConfigError):
        train.check_step_memory(compiled, None, None, need - 1)
    assert train.check_step_memory(object(), "1MB", None, None) == \
        "memory per device: not reported by this backend"
    assert train.device_memory_limit() is None   # CPU: no allocation limit to check
