"""``lowwater envs`` lists environments with their declared options and defaults."""

from __future__ import annotations

import subprocess
import sys

import orjson


def test_envs_json_lists_options_and_defaults(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lowwater", "envs", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    envs = {e["name"]: e for e in orjson.loads(out.stdout)["environments"]}
    options = {o["name"]: o for o in envs["arithmetic"]["options"]}
    assert options["size"]["default"] == 64 and options["seed"]["default"] == 0 and options["size"]["help"]
    if "gsm8k" in envs:
        data = envs["gsm8k"]["options"][0]
        assert data["name"] == "data" and data["required"] is True
    table = subprocess.run([sys.executable, "-m", "lowwater", "envs"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "arithmetic" in table.stdout and "size" in table.stdout


def test_undeclared_factories_accept_any_option():
    from lowwater.environment import declared_options
    from lowwater.eval.runner import check_options

    def make(options):
        return None

    assert declared_options(make) is None
    check_options("x", make, {"anything": 1})  # no declaration: nothing refused
