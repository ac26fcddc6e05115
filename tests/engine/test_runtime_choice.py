"""Choosing a runtime: --runtime / --runtime-option, an environment's declared need, the header."""

from __future__ import annotations

import pytest

from lowwater.environment import Environment, EnvOption
from lowwater.eval.header import build_header
from lowwater.eval.runner import EvalConfig
from lowwater.plugins import UnknownName, load
from lowwater.runtime_choice import choose_runtime, freeze, parse_options


class _Fake:
    def __init__(self, config):
        self.config = config


_Fake.options = {"cpus": EnvOption(1, "CPUs per runtime"), "image": EnvOption(None, "image", required=False)}


class _Plugin:
    from lowwater.hookspecs import hookimpl

    @staticmethod
    @hookimpl
    def register_runtimes(register):
        register("fake", _Fake)


@pytest.fixture(scope="module")
def plugins():
    return load(extra=[("fake-runtime", _Plugin())])


def test_options_parse_as_json_else_string():
    assert parse_options(["cpus=2", "image=python:3.12", "mounts=[1,2]", "on=true"]) == {
        "cpus": 2,
        "image": "python:3.12",
        "mounts": [1, 2],
        "on": True,
    }
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_options(["cpus"])
    assert freeze({"a": [1, {"b": 2}]}) == (("a", (1, (("b", 2),))),)


def test_default_named_and_unknown(plugins):
    assert choose_runtime(plugins, None, {}) == ("subprocess", {})
    assert choose_runtime(plugins, "fake", {"cpus": 2}) == ("fake", {"cpus": 2})
    with pytest.raises(UnknownName, match=r"unknown runtime 'nope' \(installed: fake, .*subprocess"):
        choose_runtime(plugins, "nope", {})


def test_undeclared_option_refused_with_suggestion(plugins):
    with pytest.raises(ValueError, match="no option 'cpu'; did you mean 'cpus'"):
        choose_runtime(plugins, "fake", {"cpu": 2})
    with pytest.raises(ValueError, match="'subprocess' has no option 'x'"):
        choose_runtime(plugins, None, {"x": 1})


def test_environment_declares_its_runtime(plugins):
    class NeedsFake(Environment):
        name = "needs-fake"
        runtime = "fake"
        runtime_options = {"cpus": 4, "image": "a"}

    env = NeedsFake()
    # The environment's runtime when the caller names none; the caller's options win key by key.
    assert choose_runtime(plugins, None, {"cpus": 8}, env) == ("fake", {"cpus": 8, "image": "a"})
    assert choose_runtime(plugins, "fake", {}, env) == ("fake", {"cpus": 4, "image": "a"})
    with pytest.raises(ValueError, match="--runtime 'subprocess' conflicts with environment 'needs-fake'"):
        choose_runtime(plugins, "subprocess", {}, env)


def test_header_records_runtime_and_its_options():
    plain = build_header(EvalConfig(), "r")
    assert plain["runtime"] == {"kind": "subprocess", "persistent": True, "pass_env": []}
    assert plain["program"] is None
    chosen = build_header(
        EvalConfig(runtime="fake", runtime_options={"cpus": 2}, harness="program", program="python a.py"), "r"
    )
    assert chosen["runtime"]["kind"] == "fake"
    assert chosen["runtime"]["options"] == {"cpus": 2}
    assert chosen["program"] == "python a.py"


def test_program_needs_program_harness():
    with pytest.raises(ValueError, match="give --harness program"):
        EvalConfig(program="python a.py")


def test_engine_runtime_config_carries_kind_and_options(plugins):
    from lowwater.assembly import EngineConfig, engine_runtime_config

    config = engine_runtime_config(
        EngineConfig(runtime="fake", runtime_options={"cpus": 2, "image": "x"}), None, plugins
    )
    assert config.kind == "fake"
    assert config.option("cpus") == 2
