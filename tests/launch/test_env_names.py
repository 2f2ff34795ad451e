"""env= names and values that no environment can hold are refused when the function is
decorated (or overridden), naming the variable, not later by the agent."""

from __future__ import annotations

import pytest

from gpulaunch import distributed, errors

pytestmark = pytest.mark.unit


def f():
    return 1


@pytest.mark.parametrize("env,says", [
    ({"A=B": "1"}, "'A=B' contains '='"),
    ({"": "1"}, "'' is empty"),
    ({"A\0B": "1"}, "contains a NUL byte"),
    ({"GOOD": "va\0lue"}, "value of GOOD contains a NUL byte"),
])
def test_bad_env_is_refused_at_decoration_and_override(env, says):
    with pytest.raises(errors.ConfigurationError, match=says):
        distributed(gpus=2, env=env)(f)
    ok = distributed(gpus=2, env={"FINE": "x=y"})(f)
    with pytest.raises(errors.ConfigurationError, match=says):
        ok.with_overrides(env=env)


def test_the_command_line_env_flag_is_checked_too():
    from gpulaunch import cli
    assert cli.main(["run", "--no-tracking", "--env", "=x", "--", "true"]) == 2
