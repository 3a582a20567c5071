"""The regression gate: compare a new report with a baseline report and fail when a limit is crossed.

Units of the limits:

* ``max_accuracy_drop``: metric points the quantized metric may lose against the baseline's quantized metric.
  For ``top1``/``top5`` (stored as fractions) a point is a percentage point: ``0.5`` allows 97.8% -> 97.3%. For a
  custom metric a point is one unit of the metric itself.
* ``max_relative_drop``: percent by which the quantized metric may be worse than the baseline's quantized metric,
  in the metric's own direction: ``1`` allows a perplexity of 22.36 -> 22.58, or a top-1 of 80% -> 79.2%.
* ``max_latency_increase``: percent. By default the *speed-up ratios* are compared (float and int8 were timed side
  by side in each run, so the ratio survives a different or busier machine): increase = baseline speed-up / new
  speed-up - 1. With ``absolute_latency=True`` the int8 median milliseconds are compared instead.
* ``max_size_increase``: percent growth of the serialized int8 model.
* ``min_sqnr``: dB floor on the new report's output SQNR (quantized vs float outputs).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxquant.errors import ArtifactError, FxQuantError
from fxquant.report.schema import Report
from fxquant.report.sections import LatencyPoint

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT = 0, 1, 2
WORSE = "% worse"  # the unit of the relative accuracy row: percent worse in the metric's own direction
ReportSource = Report | Mapping[str, Any] | str | Path


@dataclass(frozen=True)
class Limits:
    """The limits of one gate (None: not checked, the row is shown for information)."""

    max_accuracy_drop: float | None = None
    max_latency_increase: float | None = None
    max_size_increase: float | None = None
    min_sqnr: float | None = None
    absolute_latency: bool = False
    max_relative_drop: float | None = None


@dataclass(frozen=True)
class Row:
    """One compared figure: ``delta`` and ``limit`` are in ``unit``; ``passed`` is None when no limit applies."""

    metric: str
    baseline: float
    new: float
    delta: float
    limit: float | None
    unit: str
    value_unit: str
    passed: bool | None

    @property
    def verdict(self) -> str:
        return {None: "-", True: "ok", False: "FAIL"}[self.passed]

    def cells(self) -> list[str]:
        limit = "-" if self.limit is None else _limit_text(self)
        return [self.metric, _fmt(self.baseline, self.value_unit), _fmt(self.new, self.value_unit),
                _fmt(self.delta, self.unit, signed=True), limit, self.verdict]


def _fmt(value: float, unit: str, *, signed: bool = False) -> str:
    if math.isinf(value):
        return "exact" if value > 0 else "-inf"
    sign = "+" if signed else ""
    if unit == "B":
        return f"{value:{sign},.0f} B"
    if unit == "x":
        return f"{value:{sign}.2f}x"
    if unit in ("%", WORSE):
        return f"{value:{sign}.2f}%"
    return f"{value:{sign}.2f} {unit}" if unit else f"{value:{sign}.4g}"


def _limit_text(row: Row) -> str:
    assert row.limit is not None
    if row.unit == "dB":
        return f">= {row.limit:g} dB"
    if row.unit == WORSE:
        return f"<= {row.limit:g}% worse"
    what = "drop" if row.unit == "pts" else "increase"
    suffix = "%" if row.unit == "%" else f" {row.unit}".rstrip()
    return f"{what} <= {row.limit:g}{suffix}"


@dataclass(frozen=True)
class Result:
    """All rows of one comparison; ``passed`` is False when any limit was crossed."""

    rows: tuple[Row, ...]

    @property
    def passed(self) -> bool:
        return all(row.passed is not False for row in self.rows)

    def to_table(self) -> str:
        """A plain-text table: metric, baseline, new, delta, limit, verdict."""
        lines = [["metric", "baseline", "new", "delta", "limit", "verdict"], *(r.cells() for r in self.rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(6)]
        text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        failed = sum(row.passed is False for row in self.rows)
        text.append(f"\n{'FAILED: ' + str(failed) + ' limit(s) crossed' if failed else 'passed'}")
        return "\n".join(text)


def load_report(source: ReportSource, what: str = "report") -> Report:
    """A :class:`Report` from a Report, a report dict or a JSON file path; ``ArtifactError`` when unreadable."""
    if isinstance(source, Report):
        return source
    if isinstance(source, Mapping):
        return Report.from_dict(source, source=what)
    if isinstance(source, (str, Path)):
        return Report.from_json(Path(source))
    raise ArtifactError(f"{what}: expected a Report, a report dict or a JSON path, got {type(source).__name__}")


def _increase_pct(baseline: float, new: float) -> float:
    if baseline == 0:
        return 0.0 if new == 0 else math.inf
    return (new / baseline - 1) * 100


def _check(value: float, limit: float | None, *, upper: bool) -> bool | None:
    if limit is None:
        return None
    return value <= limit if upper else value >= limit


def _accuracy_rows(new: Report, base: Report, limits: Limits) -> list[Row]:
    acc, old = new.accuracy, base.accuracy
    if acc.metric != old.metric:
        raise ArtifactError(f"the reports measure different metrics ({old.metric!r} in the baseline, {acc.metric!r} "
                            "in the new report); compare reports made with the same metric")
    points = acc.points_per_unit
    unit = "pts" if points == 100 else ""
    drop = (old.quantized_value - acc.quantized_value) * points * (1 if acc.higher_is_better else -1)
    value_unit = "%" if points == 100 else ""
    quantized = Row(f"{acc.metric} (int8)", old.quantized_value * points, acc.quantized_value * points,
                    (acc.quantized_value - old.quantized_value) * points, limits.max_accuracy_drop, unit, value_unit,
                    _check(drop, limits.max_accuracy_drop, upper=True))
    floating = Row(f"{acc.metric} (float)", old.float_value * points, acc.float_value * points,
                   (acc.float_value - old.float_value) * points, None, unit, value_unit, None)
    if limits.max_relative_drop is None:
        return [quantized, floating]
    worse = _increase_pct(old.quantized_value, acc.quantized_value) * (-1 if acc.higher_is_better else 1)
    relative = Row(f"{acc.metric} (int8, relative)", old.quantized_value * points, acc.quantized_value * points,
                   worse, limits.max_relative_drop, WORSE, value_unit,
                   _check(worse, limits.max_relative_drop, upper=True))
    return [quantized, relative, floating]


def _latency_points(new: Report, base: Report) -> tuple[LatencyPoint, LatencyPoint]:
    """The new headline latency and the baseline's at the same batch size (speed-ups depend on batch size)."""
    head = new.latency.headline
    same = [p for p in base.latency.points if p.batch_size == head.batch_size]
    if same or head.batch_size == 0 or base.latency.headline.batch_size == 0:  # 0: a report that did not say
        return head, (same or [base.latency.headline])[0]
    sizes = ", ".join(str(p.batch_size) for p in base.latency.points)
    raise ArtifactError(f"the baseline has no latency at batch size {head.batch_size} (it has {sizes}); measure "
                        "both reports with the same batch_sizes")


def _latency_row(new: Report, base: Report, limits: Limits) -> Row:
    limit = limits.max_latency_increase
    head, old = _latency_points(new, base)
    label = f"batch {head.batch_size}" if head.batch_size else "headline"
    if limits.absolute_latency:
        increase = _increase_pct(old.quantized_ms.median, head.quantized_ms.median)
        return Row(f"int8 latency median, {label}", old.quantized_ms.median, head.quantized_ms.median, increase,
                   limit, "%", "ms", _check(increase, limit, upper=True))
    increase = _increase_pct(head.speedup, old.speedup)  # latency grows as the speed-up shrinks
    return Row(f"speed-up, {label} (latency +%)", old.speedup, head.speedup, increase, limit, "%", "x",
               _check(increase, limit, upper=True))


def _sqnr_row(new: Report, base: Report, limits: Limits) -> Row | None:
    if new.fidelity is None:
        if limits.min_sqnr is not None:
            raise ArtifactError("the new report has no fidelity section (output SQNR); --min-sqnr needs a report "
                                "made by fxquant.report()")
        return None
    old_db = base.fidelity.sqnr_db if base.fidelity is not None else math.nan
    new_db = new.fidelity.sqnr_db
    delta = new_db - old_db if math.isfinite(new_db) and math.isfinite(old_db) else 0.0
    return Row("output SQNR", old_db, new_db, delta, limits.min_sqnr, "dB", "dB",
               _check(new_db, limits.min_sqnr, upper=False))


def compare(new: ReportSource, baseline: ReportSource, *, max_accuracy_drop: float | None = None,
            max_latency_increase: float | None = None, max_size_increase: float | None = None,
            min_sqnr: float | None = None, absolute_latency: bool = False,
            max_relative_drop: float | None = None) -> Result:
    """Compare ``new`` with ``baseline`` under the limits (units in the module docstring); None skips a check."""
    limits = Limits(max_accuracy_drop, max_latency_increase, max_size_increase, min_sqnr, absolute_latency,
                    max_relative_drop)
    new_report, base_report = load_report(new, "new report"), load_report(baseline, "baseline report")
    old_size, new_size = base_report.size.quantized_bytes, new_report.size.quantized_bytes
    size_increase = _increase_pct(old_size, new_size)
    rows = [*_accuracy_rows(new_report, base_report, limits), _latency_row(new_report, base_report, limits),
            Row("int8 size", old_size, new_size, size_increase, max_size_increase, "%", "B",
                _check(size_increase, max_size_increase, upper=True))]
    sqnr = _sqnr_row(new_report, base_report, limits)
    return Result(tuple(rows + ([sqnr] if sqnr is not None else [])))


def assert_no_regression(new: ReportSource, baseline: ReportSource, **limits: Any) -> Result:
    """``compare`` for test suites: raise ``AssertionError`` carrying the table when a limit is crossed.

    Example (a pytest test in a training repository)::

        def test_int8_model_did_not_regress(tmp_path):
            report = fxquant.report(model, qmodel, test_loader, threads=1)
            fxquant.assert_no_regression(report, "baselines/report.json", max_accuracy_drop=0.5,
                                         max_latency_increase=15)
    """
    result = compare(new, baseline, **limits)
    if not result.passed:
        raise AssertionError("quantized model regressed against the baseline:\n" + result.to_table())
    return result


def add_regress_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``regress`` subcommand's arguments (shared by ``fxquant regress`` and :func:`main`)."""
    parser.add_argument("new", metavar="NEW_REPORT.json", help="report to check")
    parser.add_argument("--baseline", required=True, metavar="OLD_REPORT.json", help="report to compare against")
    parser.add_argument("--max-accuracy-drop", type=float, metavar="PTS",
                        help="metric points the int8 metric may lose (percentage points for top1/top5)")
    parser.add_argument("--max-relative-drop", type=float, metavar="PCT",
                        help="percent the int8 metric may be worse, in its own direction (perplexity: increase)")
    parser.add_argument("--max-latency-increase", type=float, metavar="PCT",
                        help="percent latency increase allowed (speed-up ratios unless --absolute-latency)")
    parser.add_argument("--max-size-increase", type=float, metavar="PCT", help="percent int8 size growth allowed")
    parser.add_argument("--min-sqnr", type=float, metavar="DB", help="floor on the new output SQNR in dB")
    parser.add_argument("--absolute-latency", action="store_true",
                        help="compare int8 median milliseconds instead of speed-up ratios (same machine only)")


def run_regress(args: argparse.Namespace) -> int:
    """Print the comparison table; return 1 when a limit is crossed, else 0 (``ArtifactError`` on bad input)."""
    result = compare(args.new, args.baseline, max_accuracy_drop=args.max_accuracy_drop,
                     max_latency_increase=args.max_latency_increase, max_size_increase=args.max_size_increase,
                     min_sqnr=args.min_sqnr, absolute_latency=args.absolute_latency,
                     max_relative_drop=args.max_relative_drop)
    print(result.to_table())
    return EXIT_OK if result.passed else EXIT_REGRESSION


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxquant.report.regress NEW.json --baseline OLD.json ...``: exit 0 ok, 1 regression, 2 bad input."""
    parser = argparse.ArgumentParser(prog="fxquant regress", description="Compare a report with a baseline.")
    add_regress_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_regress(args)
    except FxQuantError as exc:
        print(f"fxquant regress: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
