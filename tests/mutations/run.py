"""Known-bad mutations of the product, and the tests that must kill them.

Usage (from the repository root)::

    .venv/bin/python tests/mutations/run.py            # every mutation
    .venv/bin/python tests/mutations/run.py --list
    .venv/bin/python tests/mutations/run.py --only malloc-trim-noop --only consumer-mmap-threshold
    .venv/bin/python tests/mutations/run.py --head     # the last commit, not the working tree

Each mutation is applied to a scratch copy of the repository (the working
tree's files, tracked and new, with the built ``lowwater/_native`` extension;
``--head``: the files of ``HEAD``), never to the tree itself.  Its command
runs once on the unmutated copy, which must pass (otherwise a failure would
prove nothing), then once mutated, which must fail: the mutation is
*killed*.  Python commands run with the scratch copy's ``python/`` first on
``PYTHONPATH`` (subprocesses the tests start inherit it).  Exit status: 0 if
every mutation was killed; 1 if one survived, timed out, no longer applies
(its exact text is gone from the file: update the list) or its command
failed unmutated.  Not collected by pytest (no ``test_`` prefix): it runs the
slow tests it names, on demand.  tests/mutations/README.md: how to add one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTEST = ["{python}", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
#: Cargo's build directory for the Rust mutations, kept across runs so dependencies build once.
CARGO_TARGET = Path(
    os.environ.get("LOWWATER_MUTATIONS_TARGET", Path(tempfile.gettempdir()) / "lowwater-mutations-target")
)


@dataclass(frozen=True)
class Mutation:
    """One known-bad change.

    Attributes:
        name: short id (``--only``).
        why: what the mutation breaks, in one line.
        edits: ``(path from the repository root, exact old text, new text)``;
            the old text must occur exactly once.
        command: what must fail once mutated; ``{python}`` is replaced by
            this interpreter.
        env: extra environment variables for the command.
        timeout_s: per run of the command (seconds).
    """

    name: str
    why: str
    edits: tuple[tuple[str, str, str], ...]
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 1800.0


MUTATIONS = (
    Mutation(
        name="intercept-fences",
        why="both SeqCst fences of the intercept table's insert-vs-close protocol removed, `closed` made Relaxed",
        edits=(
            (
                "rust/core/src/intercept.rs",
                "            rollout.closed.store(true, Ordering::SeqCst);\n            fence(Ordering::SeqCst);\n",
                "            rollout.closed.store(true, Ordering::Relaxed);\n",
            ),
            (
                "rust/core/src/intercept.rs",
                "            fence(Ordering::SeqCst);\n            if rollout.closed.load(Ordering::SeqCst) {\n",
                "            if rollout.closed.load(Ordering::Relaxed) {\n",
            ),
        ),
        command=("cargo", "test", "-p", "lowwater-core", "--release", "--test", "loom"),
        env={"RUSTFLAGS": "--cfg loom", "CARGO_TARGET_DIR": str(CARGO_TARGET / "loom")},
        timeout_s=3600.0,
    ),
    Mutation(
        name="malloc-trim-noop",
        why="malloc_trim never called while Trimmer.calls still counts",
        edits=(("python/lowwater/memory.py", "        fn(0)\n        self.calls += 1\n", "        self.calls += 1\n"),),
        command=(*PYTEST, "tests/memory/test_trim_rss.py::test_trim_at_quiescence_returns_freed_pages"),
    ),
    Mutation(
        name="consumer-mmap-threshold",
        why="the consumer's mmap threshold raised to 1 TiB: drained shards stay on the heap",
        edits=(
            (
                "python/lowwater/trainer/shards.py",
                "CONSUMER_MMAP_THRESHOLD = 64 * 1024\n",
                "CONSUMER_MMAP_THRESHOLD = 1 << 40\n",
            ),
        ),
        command=(*PYTEST, "tests/memory/test_consumer_rss.py::test_consumer_rss_falls_after_clear_batch"),
    ),
)


def scratch_copy(dest: Path, head: bool) -> None:
    """The repository's files into ``dest``: the working tree's (tracked and
    new, not ignored) or, with ``head``, ``HEAD``'s; plus the built extension."""
    if head:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        for rel in filter(None, listed.decode().split("\0")):
            src = ROOT / rel
            if src.is_file():  # listed but deleted in the working tree: skipped
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    for native in (ROOT / "python" / "lowwater").glob("_native*.so"):
        shutil.copy2(native, dest / "python" / "lowwater" / native.name)


def run_command(m: Mutation, scratch: Path, python: str, log: Path) -> tuple[int | None, float]:
    """Run ``m.command`` in ``scratch``; returns (exit status or None on timeout, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(scratch / "python"), env.get("PYTHONPATH")) if p)
    env.update(m.env)
    argv = [python if a == "{python}" else a for a in m.command]
    started = time.monotonic()
    with open(log, "wb") as out:
        try:
            done = subprocess.run(argv, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=m.timeout_s)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - started
    return done.returncode, time.monotonic() - started


def apply(m: Mutation, scratch: Path) -> dict[Path, str] | str:
    """Apply ``m``'s edits; returns the original texts, or why it does not apply."""
    originals: dict[Path, str] = {}
    for rel, old, new in m.edits:
        path = scratch / rel
        if not path.exists():
            return f"{rel} does not exist"
        text = path.read_text()
        originals.setdefault(path, text)
        if text.count(old) != 1:
            return f"{rel}: the old text occurs {text.count(old)} times, not once"
        path.write_text(text.replace(old, new))
    return originals


def check_imports(scratch: Path, python: str) -> None:
    """The scratch copy's package is the one the commands import (not the tree's)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(scratch / "python"), os.environ.get("PYTHONPATH"))))
    )
    where = subprocess.run(
        [python, "-c", "import lowwater; print(lowwater.__file__)"], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(scratch.resolve()):
        sys.exit(f"the scratch copy's lowwater is not the one imported ({where}): is PYTHONPATH overridden?")


def evidence(log: Path, lines: int = 6) -> list[str]:
    """The log's lines that say what failed (pytest's and cargo's summaries), else its last lines."""
    text = log.read_text(errors="replace").splitlines()
    marks = ("FAILED", "AssertionError", "E   ", "panicked", "test result:", "error:")
    picked = [line for line in text if any(mark in line for mark in marks)]
    return (picked or text)[-lines:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", metavar="NAME", help="run this mutation (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--head", action="store_true", help="mutate HEAD's files instead of the working tree's")
    p.add_argument("--skip-baseline", action="store_true", help="do not run each command unmutated first")
    p.add_argument("--python", default=sys.executable, help="interpreter for {python} (default: this one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch copy (the logs are always kept)")
    a = p.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.why}\n    {' '.join(m.command)}")
        return 0
    unknown = sorted(set(a.only or ()) - set(known))
    if unknown:
        p.error(f"unknown mutation(s) {unknown}; known: {sorted(known)}")
    chosen = [known[n] for n in a.only] if a.only else list(MUTATIONS)
    scratch = Path(tempfile.mkdtemp(prefix="lowwater-mutations-"))
    logs = Path(tempfile.mkdtemp(prefix="lowwater-mutations-logs-"))
    results: list[tuple[str, str, float]] = []
    try:
        scratch_copy(scratch, a.head)
        check_imports(scratch, a.python)
        for m in chosen:
            print(f"--- {m.name}: {m.why}", flush=True)
            if not a.skip_baseline:
                code, seconds = run_command(m, scratch, a.python, logs / f"{m.name}.baseline.log")
                if code != 0:
                    verdict = "timed out unmutated" if code is None else f"fails unmutated (exit {code})"
                    results.append((m.name, verdict, seconds))
                    print(f"    {verdict}: see {logs / f'{m.name}.baseline.log'}", flush=True)
                    continue
            originals = apply(m, scratch)
            if isinstance(originals, str):
                results.append((m.name, f"does not apply: {originals}", 0.0))
                continue
            try:
                code, seconds = run_command(m, scratch, a.python, logs / f"{m.name}.log")
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            verdict = "timed out" if code is None else "killed" if code != 0 else "SURVIVED"
            results.append((m.name, verdict, seconds))
            print(f"    {verdict} ({seconds:.0f} s); log: {logs / f'{m.name}.log'}", flush=True)
            for line in evidence(logs / f"{m.name}.log"):
                print(f"    | {line}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    width = max(len(name) for name, _, _ in results) if results else 0
    for name, verdict, seconds in results:
        print(f"{name:<{width}}  {verdict}  ({seconds:.0f} s)")
    survived = [name for name, verdict, _ in results if verdict != "killed"]
    if survived:
        print(f"{len(survived)} of {len(results)} not killed: {', '.join(survived)}")
        return 1
    print(f"all {len(results)} killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
