"""Registry and protocol-path clashes name both plugins; `lowwater plugins` lists them and exits 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from lowwater.interception import OpenAIChat
from lowwater.plugins import PluginError, load


class Redacting(OpenAIChat):
    name = "redacting.chat"  # a new name on the built-in path


def _plugin(protocol):
    class P:
        from lowwater.hookspecs import hookimpl

        @staticmethod
        @hookimpl
        def register_protocols(register):
            register(protocol)

    return P()


def test_protocol_path_clash_names_both_plugins():
    with pytest.raises(PluginError) as info:
        load(extra=[("my-redactor", _plugin(Redacting()))])
    message = str(info.value)
    assert "'redacting.chat' of 'my-redactor'" in message and "'openai.chat' of 'protocols'" in message
    assert "intercept_request" in message


def test_name_clash_names_both_plugins_and_non_strict_keeps_the_first():
    plugins = load(extra=[("mine", _plugin(OpenAIChat()))], strict=False)
    assert plugins.clashes == ["protocol 'openai.chat' registered by both 'protocols' and 'mine'"]
    assert type(plugins.protocols["openai.chat"]) is OpenAIChat


def test_lowwater_plugins_flags_clashes(tmp_path: Path):
    (tmp_path / "clashing_plugin.py").write_text(
        "from lowwater.hookspecs import hookimpl\n"
        "from lowwater.interception import OpenAIChat\n"
        "class Other(OpenAIChat):\n    name = 'other.chat'\n"
        "@hookimpl\ndef register_protocols(register):\n    register(Other())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "LOWWATER_PLUGINS": "clashing_plugin"}
    out = subprocess.run(
        [sys.executable, "-m", "lowwater", "plugins", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stderr
    (clash,) = orjson.loads(out.stdout)["clashes"]
    assert "'other.chat' of 'clashing_plugin'" in clash and "'openai.chat' of 'protocols'" in clash
