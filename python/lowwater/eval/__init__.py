"""``lowwater eval``: the runner (:mod:`~lowwater.eval.runner`), the results
file (:mod:`~lowwater.eval.results`) and the job each env worker runs
(:mod:`~lowwater.eval.job`).  See ``docs/eval.md``."""

from lowwater.eval.results import ResultsFileError, ResultsWriter, read_rows
from lowwater.eval.runner import SUMMARY_KEYS, EvalConfig, EvalReport, Totals, run_eval

__all__ = [
    "SUMMARY_KEYS",
    "EvalConfig",
    "EvalReport",
    "ResultsFileError",
    "ResultsWriter",
    "Totals",
    "read_rows",
    "run_eval",
]
