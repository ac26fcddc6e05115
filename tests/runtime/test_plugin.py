"""The built-in runtime registers through the ``lowwater`` entry-point group like any plugin."""

import sys

import trio

from lowwater.plugins import load
from lowwater.runtime import RuntimeConfig, RuntimePool, SubprocessRuntime


def test_subprocess_runtime_is_registered_through_entry_points():
    plugins = load(disabled=())
    assert plugins.runtimes["subprocess"] is SubprocessRuntime
    assert any(i.name == "runtime-subprocess" and "register_runtimes" in i.hooks for i in plugins.infos)


def test_a_pool_built_from_the_registry_runs_programs():
    plugins = load(disabled=())

    async def main():
        async with RuntimePool(plugins.runtimes, max_size=1) as pool:
            async with pool.acquire(RuntimeConfig(kind="subprocess", persistent=True)) as rt:
                result = await rt.run([sys.executable, "-c", "print('hi')"])
                assert result.stdout == b"hi\n"
        assert pool.stats()["idle"] == 0

    trio.run(main)
