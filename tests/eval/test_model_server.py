"""The serve-model child lives exactly as long as its run: past Trio's
spawning thread (which idles out after 10 s), and no longer than the block
(or its parent's life: tests/eval/test_eval_e2e.py SIGKILLs the eval)."""

from __future__ import annotations

import httpx
import psutil
import trio

from lowwater.upstream.spec import ModelSpec, model_server


def test_the_child_outlives_the_thread_that_spawned_it():
    async def main():
        async with model_server(ModelSpec("scripted", "scripted")) as url:
            (child,) = [c for c in psutil.Process().children() if "serve-model" in c.cmdline()]
            # Trio's worker thread that forked the child exits after 10 s idle;
            # PR_SET_PDEATHSIG tied the child's life to that thread.
            await trio.sleep(12)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{url}/models")).status_code == 200
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert not alive

    trio.run(main)
