"""Allocator hygiene for test_trim_rss.py: fill glibc's heap, free it, trim at quiescence.

Usage: ``python trim_proc.py [--keep]``.  Allocates ``TOTAL`` bytes as
``bytes`` objects of 600 B to 4 KiB (above pymalloc's 512 B limit, so each
is a glibc heap block), keeps every ``PIN_EVERY``-th alive (the survivors
of a burst, which pin the heap around freed blocks so glibc gives nothing
back by itself), frees the rest, then calls ``Trimmer(0.0)()`` once.  The
last line on stdout is JSON: current RSS in bytes at ``start``, ``filled``,
``freed`` and ``trimmed``, and whether the trim ran (``ran``, ``calls``).

``--keep`` is the failing control of the test: nothing is freed (a leak),
so the trim has nothing to give back.
"""

import gc
import random
import sys

import orjson

from lowwater.memory import Trimmer, rss_bytes

TOTAL = 96 << 20
PIN_EVERY = 64


def main(keep: bool) -> dict:
    gc.collect()
    rng = random.Random(0)
    out = {"start": rss_bytes()}
    blocks: list[bytes] = []
    size = 0
    while size < TOTAL:
        n = rng.randrange(600, 4096)
        blocks.append(b"\x01" * n)  # written: every page resident (calloc might leave fresh pages untouched)
        size += n
    blocks.append(b"\x01" * 1024)  # a survivor on top: the heap cannot shrink from its end
    out["filled"] = rss_bytes()
    if not keep:
        survivors = blocks[::PIN_EVERY]
        survivors.append(blocks[-1])
        blocks = survivors
    gc.collect()
    out["freed"] = rss_bytes()
    trimmer = Trimmer(0.0)
    out["ran"] = trimmer()
    out["calls"] = trimmer.calls
    out["trimmed"] = rss_bytes()
    out["survivors"] = len(blocks)
    return out


if __name__ == "__main__":
    print(orjson.dumps(main("--keep" in sys.argv[1:])).decode(), flush=True)
