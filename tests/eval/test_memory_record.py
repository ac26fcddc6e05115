"""The memory record covers the whole run: a sample at t = 0, an interval
that adapts to the run's length, the end kept whatever the stride; the
plot's baseline is sampled before matplotlib is imported."""

from __future__ import annotations

import subprocess
import sys

import orjson

from lowwater.memory import MemoryRecord


def test_record_starts_at_zero_and_keeps_its_first_and_last_samples():
    record = MemoryRecord(baseline_bytes=100, max_samples=8)
    assert record.samples == [(0.0, 100, 0)]
    for i in range(1000):
        record.add(200 + i, i)
    record.add(5, 1000, keep=True)
    assert record.samples[0] == (0.0, 100, 0) and record.samples[-1][1:] == (5, 1000)
    assert len(record.samples) <= 9 and record.peak_bytes == 1199


def test_interval_grows_with_the_run():
    record = MemoryRecord(baseline_bytes=1, min_interval_s=0.05, target_samples=100)
    assert record.interval_s() == 0.05
    record._start -= 1000  # a run 1000 s old
    assert 9.9 < record.interval_s() < 10.5


def test_memory_plot_does_not_raise_the_baseline(tmp_path):
    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "lowwater", "eval", "-n", "4", "--no-progress", "--summary-json", "s.json", *extra],
            cwd=tmp_path, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return orjson.loads((tmp_path / "s.json").read_bytes())

    plain = run("--out", "a.jsonl")
    plotted = run("--out", "b.jsonl", "--memory-plot", "m.png")
    # matplotlib costs ~28 MiB when imported; the baseline is sampled before it is.
    assert plotted["rss_baseline_mb"] < plain["rss_baseline_mb"] + 8
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_labels_its_lines_and_names_env_model_and_run(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from lowwater.commands.eval import plot_memory

    seen = {}

    def savefig(self, path, *args, **kwargs):
        ax = self.axes[0]
        seen["title"] = ax.get_title()
        seen["labels"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["xlim"] = ax.get_xlim()

    monkeypatch.setattr(Figure, "savefig", savefig)
    record = MemoryRecord(baseline_bytes=50 << 20)
    record.add(60 << 20, 3)
    plot_memory(record, tmp_path / "m.png", title="lowwater eval arithmetic · model scripted · run abc")
    assert "arithmetic" in seen["title"] and "scripted" in seen["title"] and "abc" in seen["title"]
    assert seen["labels"] == ["RSS (MiB)", "RSS baseline", "rollouts finished"]
    assert seen["xlim"][0] == 0
