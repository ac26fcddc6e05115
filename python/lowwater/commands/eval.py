"""``lowwater eval [ENV]``: run rollouts of an environment against a model.

With no arguments it runs the embedded default: the ``arithmetic``
environment (seeded word problems solved with a calculator tool over
several turns) against ``--model scripted``, with no network and no data.
Results stream to ``--out`` (JSONL); a rich progress bar shows rollouts,
errors, rollouts/s and RSS; a summary table follows.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import orjson
import trio

from lowwater.cli import UsageError
from lowwater.commands.signals import until_signal

DEFAULT_OUT_DIR = Path("runs")

T = TypeVar("T")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="run rollouts of an environment against a model and stream results to disk",
        description="Run rollouts of ENV (default: the embedded arithmetic environment) against a model.",
    )
    p.add_argument("env", nargs="?", default="arithmetic", help="environment name (see `lowwater plugins`)")
    p.add_argument("--model", default="scripted", help="scripted, replay:PATH#COLUMN, or a model NAME with --model-url")
    p.add_argument("--model-url", help="base URL of an OpenAI-compatible server (ending in /v1)")
    p.add_argument("--api-key-env", help="environment variable holding the model server's API key")
    p.add_argument("--data", help="dataset file for environments that read one (e.g. gsm8k)")
    p.add_argument(
        "--env-option", action="append", default=[], metavar="KEY=VALUE", help="environment option (repeatable)"
    )
    p.add_argument(
        "-n", "--rollouts", type=int, help="tasks to run from the start of the taskset (default: all); --limit N"
    )
    p.add_argument(
        "--limit",
        metavar="N|START-END",
        help="tasks to run: the first N, or positions START to END of the taskset (1-based, inclusive, as in "
        "inspect: --limit 11-20 runs task ids 10 to 19 of a dataset)",
    )
    p.add_argument(
        "--task-ids", metavar="ID,...", help="run exactly these tasks, by id (comma-separated; see the results rows)"
    )
    p.add_argument("--group-size", type=int, default=1, help="rollouts per task (default 1)")
    p.add_argument("-c", "--concurrency", type=int, default=32, help="rollouts in flight (default 32)")
    p.add_argument("--max-turns", type=int, default=16, help="model calls per rollout (default 16)")
    p.add_argument("--timeout", type=float, default=600.0, help="whole-rollout deadline in seconds (default 600)")
    p.add_argument(
        "--harness",
        choices=("inprocess", "program"),
        default="inprocess",
        help="inprocess: the agent is a coroutine in this process; program: an agent program in a runtime "
        "(default inprocess)",
    )
    p.add_argument(
        "--program",
        metavar="'CMD ARGS'",
        help="with --harness program: run this command as the agent instead of the environment's own (task JSON "
        "on stdin; OPENAI_/ANTHROPIC_ BASE_URL and API_KEY and LOWWATER_MODEL in its environment; its last JSON "
        "line on stdout is the answer)",
    )
    p.add_argument(
        "--runtime",
        metavar="NAME",
        help="the runtime agent programs and scripts run in (default: the environment's, else subprocess; see "
        "`lowwater plugins`)",
    )
    p.add_argument(
        "--runtime-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="runtime option (repeatable; VALUE is JSON, else a string): --runtime-option cpus=2",
    )
    p.add_argument("--temperature", type=float, help="sampling temperature sent with every model call")
    p.add_argument("--top-p", type=float, help="nucleus sampling top_p sent with every model call")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="completion token limit sent with every model call (max_output_tokens for the responses API)",
    )
    p.add_argument(
        "-S",
        "--sampling",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sampling argument sent with every model call (repeatable; VALUE is JSON, else a string): "
        "-S seed=1 -S stop='[\"##\"]'; a key the agent sets itself keeps the agent's value",
    )
    p.add_argument(
        "--persistent", action=argparse.BooleanOptionalAction, default=True, help="runtimes from a pool (default on)"
    )
    p.add_argument("--out", type=Path, help="results JSONL (default runs/<env>-<time>.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue --out: skip finished tasks, re-run errored ones")
    p.add_argument("--max-attempts", type=int, default=3, help="runs that may attempt an errored task (default 3)")
    p.add_argument(
        "--no-samples",
        action="store_true",
        help="do not write transcripts (by default each rollout's goes to OUT's .samples.jsonl as it finishes)",
    )
    p.add_argument(
        "--max-error-rate",
        type=float,
        default=0.0,
        metavar="RATE",
        help="exit 1 when more than this share (0 to 1) of rollouts ended in an error (default 0: any error)",
    )
    p.add_argument("--summary-json", type=Path, help="write the summary figures as JSON here")
    p.add_argument("--memory-plot", type=Path, metavar="PATH.png", help="plot RSS over the run as a PNG")
    p.add_argument("--seed", type=int, default=0, help="seed for generated tasksets (default 0)")
    p.add_argument(
        "--workers", type=int, default=0, help="env worker processes (default 0: every rollout in this process)"
    )
    p.add_argument(
        "--backend",
        default="local",
        metavar="NAME",
        help="where the --workers run: local (this machine, the default) or a plugin's backend such as ray "
        "(--workers per node; see `lowwater plugins`)",
    )
    p.add_argument("--address", help="the cluster the backend joins (ray: auto or HOST:PORT)")
    p.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="HOST",
        help="where the model server this run starts binds (default 127.0.0.1); beyond loopback needs "
        "LOWWATER_ADMIN_KEY (a remote --backend needs a reachable model server)",
    )
    p.add_argument("--advertise", metavar="HOST", help="host in the model server's URL (default: from --bind)")
    p.add_argument(
        "--max-tasks-per-worker",
        type=int,
        default=500,
        help="a worker retires after this many tasks, jittered (default 500)",
    )
    p.add_argument("--max-rss-mb", type=float, help="a worker retires past this current RSS in MiB (default: never)")
    p.add_argument(
        "--high-water-mb",
        type=float,
        help="a worker above this RSS in MiB gets no new rollouts until it drops to 80 %% of it",
    )
    p.add_argument(
        "--pass-env",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this host variable (or fnmatch pattern) to agent programs and scripts (repeatable); "
        "by default they get only PATH, HOME, LANG, LANGUAGE, LC_*, TMPDIR and TZ",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def parse_limit(text: str) -> tuple[int, int | None]:
    """``--limit N`` -> ``(0, N)``; ``--limit START-END`` (1-based, inclusive) -> ``(START - 1, END - START + 1)``.

    Raises:
        UsageError: not of either form, or ``START > END`` or ``START < 1``.
    """
    first, sep, last = text.partition("-")
    try:
        if not sep:
            return 0, int(first)
        start, end = int(first), int(last)
    except ValueError:
        raise UsageError(f"--limit {text!r}: expected N or START-END (e.g. 10 or 11-20)") from None
    if start < 1 or end < start:
        raise UsageError(f"--limit {text!r}: START-END needs 1 <= START <= END")
    return start - 1, end - start + 1


def parse_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling arguments of ``--temperature``, ``--top-p``, ``--max-tokens`` and ``-S KEY=VALUE``.

    Raises:
        UsageError: an ``-S`` item without ``=``.
    """
    from lowwater.runtime_choice import parse_options

    sampling = _usage(parse_options, args.sampling, "-S")
    for key, value in (("temperature", args.temperature), ("top_p", args.top_p), ("max_tokens", args.max_tokens)):
        if value is not None:
            sampling[key] = value
    return sampling


def env_options(args: argparse.Namespace) -> dict[str, Any]:
    """The environment options of ``--data`` and ``--env-option KEY=VALUE``
    (values stay strings; a later one wins), as ``eval`` and ``score`` take them.

    Raises:
        UsageError: an ``--env-option`` item without ``=``.
    """
    from lowwater.runtime_choice import parse_options

    options: dict[str, Any] = {"data": args.data} if args.data else {}
    return {**options, **_usage(parse_options, args.env_option, "--env-option", json=False)}


def _usage(parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``parse(*args, **kwargs)``, its ``ValueError`` as a :class:`UsageError` (one line, exit status 2)."""
    try:
        return parse(*args, **kwargs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_config(args: argparse.Namespace) -> Any:
    from lowwater.eval import EvalConfig
    from lowwater.eval.runner import parse_task_id
    from lowwater.runtime_choice import parse_options
    from lowwater.upstream.spec import UpstreamError, parse_model

    options = {"seed": args.seed, **env_options(args)}
    try:
        model = parse_model(args.model, args.model_url, args.api_key_env)
    except UpstreamError as exc:
        raise UsageError(str(exc)) from None
    out = args.out or DEFAULT_OUT_DIR / f"{args.env}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    if args.resume and args.out is None:
        raise UsageError("--resume needs --out (the results file to continue)")
    selectors = (("-n", args.rollouts), ("--limit", args.limit), ("--task-ids", args.task_ids))
    given = [flag for flag, value in selectors if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both select tasks; give one of them")
    start, rollouts, task_ids = 0, args.rollouts, None
    if args.limit is not None:
        start, rollouts = parse_limit(args.limit)
    if args.task_ids is not None:
        task_ids = tuple(parse_task_id(t) for t in args.task_ids.split(",") if t.strip())
        if not task_ids:
            raise UsageError("--task-ids: give at least one id")
    try:
        return EvalConfig(
            env=args.env,
            env_options=options,
            model=model,
            sampling=parse_sampling(args),
            rollouts=rollouts,
            start=start,
            task_ids=task_ids,
            group_size=args.group_size,
            concurrency=args.concurrency,
            max_turns=args.max_turns,
            timeout_s=args.timeout,
            harness=args.harness,
            persistent=args.persistent,
            out=out,
            resume=args.resume,
            max_attempts=args.max_attempts,
            seed=args.seed,
            workers=args.workers,
            backend=args.backend,
            address=args.address,
            bind=args.bind,
            advertise=args.advertise,
            max_tasks_per_worker=args.max_tasks_per_worker,
            max_rss_mb=args.max_rss_mb,
            high_water_mb=args.high_water_mb,
            pass_env=tuple(args.pass_env),
            samples=not args.no_samples,
            max_error_rate=args.max_error_rate,
            runtime=args.runtime,
            runtime_options=parse_options(args.runtime_option),
            program=args.program,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lowwater import eval as eval_mod
    from lowwater.eval.results import ResultsFileError
    from lowwater.excgroups import sole_error
    from lowwater.plugins import UnknownName
    from lowwater.upstream.spec import UpstreamError

    if args.memory_plot is not None:
        _check_plotting()  # without importing it: the baseline is sampled before matplotlib's 28 MiB
    config = build_config(args)
    console = Console(stderr=True)
    progress = None if args.no_progress or not console.is_terminal else _Progress(console)
    user_errors = (UnknownName, ResultsFileError, UpstreamError, ValueError, OSError)
    on_progress = None if progress is None else progress.update
    user_error: Exception | None = None
    try:
        if progress is None:
            report, signum = trio.run(until_signal, lambda: eval_mod.run_eval(config))
        else:
            with progress:
                report, signum = trio.run(until_signal, lambda: eval_mod.run_eval(config, on_progress=on_progress))
    except* user_errors as group:
        # Environment options and data files: a missing file or a malformed
        # line is reported by the environment with its path and line number,
        # before the run or inside its nurseries (a data line read mid-run):
        # one user error is one line, not a tree of tracebacks.
        user_error = sole_error(group)
        if user_error is None:
            raise
    if user_error is not None:
        raise UsageError(str(user_error))
    if report is None:
        import signal

        name = signal.Signals(signum).name
        if config.out.exists():
            message = (
                f"interrupted by {name}; finished rows are in {config.out}, "
                "in-flight ones were written as cancelled; add --resume to continue"
            )
        else:  # stopped before its first row: the run left no file
            message = f"interrupted by {name} before any rollout finished; nothing was written"
        print(f"lowwater eval: {message}", file=sys.stderr)
        return 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    _print_summary(Console(), report, config)
    if report.tasks_available is not None:
        print(
            f"lowwater eval: -n {config.rollouts} asked for more tasks than the {config.env} taskset has; "
            f"ran all {report.tasks_available} (an environment option may size the taskset, "
            f"e.g. --env-option size=N for arithmetic; see `lowwater plugins`)",
            file=sys.stderr,
        )
    if args.summary_json is not None:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_bytes(orjson.dumps(report.summary, option=orjson.OPT_INDENT_2) + b"\n")
    if args.memory_plot is not None:
        plot_memory(report.memory, args.memory_plot, title=_plot_title(config, report))
    return _exit_status(report.summary, config.max_error_rate)


def _exit_status(summary: dict[str, Any], max_error_rate: float) -> int:
    """0, or 1 (with a line saying why) when the rollouts that ended in an
    error exceed ``--max-error-rate``: an eval whose every rollout failed
    (a model URL without ``/v1``, a harness missing a package) used to exit 0."""
    rate = summary["error_rate"]
    if rate <= max_error_rate:
        return 0
    top = summary["top_errors"][0] if summary["top_errors"] else None
    common = f"; most common: {top['class']}: {top['message']} ({top['count']}x)" if top else ""
    print(
        f"lowwater eval: {summary['errors']} of {summary['rollouts']} rollouts ({100 * rate:.1f} %) ended in an "
        f"error, above --max-error-rate {max_error_rate:g}{common}",
        file=sys.stderr,
    )
    return 1


class _Progress:
    """A rich progress bar: rollouts done of the total, percent, ETA, errors,
    the running mean reward, rollouts/s and current RSS."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]eval"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[errors]} errors"),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[rate]:.1f}/s"),
            TextColumn("RSS {task.fields[rss_mb]:.0f} MiB"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("eval", total=None, errors=0, reward=0.0, rate=0.0, rss_mb=0.0)
        self.started = time.perf_counter()

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.progress.__exit__(exc_type, exc, traceback)

    def update(self, totals: Any, rss: int) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.progress.update(
            self.task,
            total=totals.planned,
            completed=totals.this_run,
            errors=sum(totals.errors.values()),
            reward=totals.reward_mean,
            rate=totals.this_run / elapsed,
            rss_mb=rss / (1 << 20),
        )


def _print_summary(console: Any, report: Any, config: Any) -> None:
    from rich.table import Table

    from lowwater.rollout import ERROR_CLASSES

    s = report.summary
    table = Table(title=f"lowwater eval {config.env} ({config.model.name})", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    errors = (
        ", ".join(f"{c} {report.errors_by_class[c]}" for c in ERROR_CLASSES if report.errors_by_class.get(c)) or "none"
    )
    for label, value in (
        ("rollouts", s["rollouts"]),
        ("completed", s["completed"]),
        ("errors", f"{s['errors']} ({errors})"),
        ("accuracy", _accuracy(s)),
        ("mean reward", f"{s['reward_mean']:.4f}"),
        ("mean turns", f"{s['turns_mean']:.2f}"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("rollouts/s", f"{s['rollouts_per_s']:.2f}"),
        (
            "RSS baseline / peak / resting",
            f"{s['rss_baseline_mb']:.1f} / {s['rss_peak_mb']:.1f} / {s['rss_resting_mb']:.1f} MiB",
        ),
        ("results", str(report.out)),
    ):
        table.add_row(label, str(value))
    if report.pool is not None:
        p = report.pool
        table.add_row(
            "workers started / recycled", f"{p['workers_started']} / {p['recycled_by_count'] + p['recycled_by_rss']}"
        )
        table.add_row(
            "worker crashes / tasks re-run",
            f"{p['replaced_after_crash'] + p['replaced_after_heartbeat_timeout']} / {p['retried_tasks']}",
        )
        table.add_row("admission held rollouts back", f"{p['admission_wait_s']:.2f} s ({p['admission_holds']} holds)")
        table.add_row("worker RSS peak", f"{p['worker_rss_peak_mb']:.1f} MiB")
        if "node_pools" in p:  # a multi-node backend (ray): its node pools and the memory Ray keeps
            table.add_row("node pools started / crashed", f"{p['node_pools']} / {p['node_pool_crashes']}")
            table.add_row(
                "object store peak / host Shmem peak",
                f"{p['object_store_peak_mb']:.1f} / {p['shmem_peak_mb']:.1f} MiB",
            )
    if s["pass_at_k"]:
        for label, key in (("pass@k", "pass_at_k"), ("pass^k", "pass_hat_k")):
            values = ", ".join(f"{label[:-1]}{k} {100 * v:.2f} %" for k, v in s[key].items() if v is not None)
            table.add_row(f"{label} ({s['tasks']} tasks)", values)
    for e in s["top_errors"]:
        table.add_row(f"  {e['count']}x {e['class']}", e["message"][:120])
    left = s.get("leftovers") or {}
    table.add_row("left alive after the run", ", ".join(f"{k} {v}" for k, v in sorted(left.items())) or "nothing")
    console.print(table)


def _accuracy(s: dict[str, Any]) -> str:
    text = f"{100 * s['accuracy']:.2f} %"
    if s["accuracy_stderr"] is not None:
        low, high = s["accuracy_ci95"]
        text += f" +- {100 * s['accuracy_stderr']:.2f} (95 % CI {100 * low:.1f}-{100 * high:.1f})"
    return text


def _check_plotting() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--memory-plot needs matplotlib: pip install 'lowwater[plot]'")


def _plot_title(config: Any, report: Any) -> str:
    return f"lowwater eval {config.env} · model {config.model.name} · run {report.run_id}"


def plot_memory(record: Any, path: Path, *, title: str = "lowwater eval: RSS over the run") -> None:
    """Draw RSS (MiB) over the whole run, from the baseline at t = 0, with
    rollouts finished on a second axis (PNG); both lines are in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record.samples or [(0.0, record.baseline_bytes, 0)]
    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    (rss_line,) = ax.plot(t, [s[1] / (1 << 20) for s in samples], color="tab:blue", label="RSS (MiB)")
    base_line = ax.axhline(
        record.baseline_bytes / (1 << 20), color="tab:blue", linestyle=":", linewidth=1, label="RSS baseline"
    )
    ax.set_xlabel("seconds since the baseline sample")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    ax.set_xlim(0, max(t[-1], 1e-3))
    ax2 = ax.twinx()
    (done_line,) = ax2.plot(t, [s[2] for s in samples], color="tab:orange", label="rollouts finished")
    ax2.set_ylabel("rollouts finished", color="tab:orange")
    top = max((s[1] for s in samples), default=record.baseline_bytes) / (1 << 20)
    ax.set_ylim(0, math.ceil(top * 1.1) or 1)
    ax2.set_ylim(0, max(1, max(s[2] for s in samples) * 1.1))
    ax.legend(handles=[rss_line, base_line, done_line], loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"memory plot: {path}", file=sys.stderr)
