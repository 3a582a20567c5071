"""``fxquant report`` (measure a converted run against its float model) and ``fxquant regress`` (the CI gate)."""

from __future__ import annotations

import argparse

from fxquant.cli.common import (
    add_data_arguments,
    add_trust_arguments,
    data_options,
    emit,
    positive_int,
    text_tokenizer,
    trust_options,
)
from fxquant.cli.data import load_data
from fxquant.cli.rundir import open_run, rebuild_run
from fxquant.cli.source import Source
from fxquant.cli.specs import metric_spec
from fxquant.errors import InputError
from fxquant.serialization import atomic_write

FORMATS = ("markdown", "json", "html")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    report = sub.add_parser("report", parents=[common], help="accuracy, latency, size and per-layer error")
    report.add_argument("run_dir", metavar="RUN_DIR")
    add_data_arguments(report, split="test")
    report.add_argument("--metric", default="top1",
                        help="top1, top5, perplexity (causal LMs, with --seq-len text), or "
                             "PKG.MODULE:FUNCTION(outputs, targets) -> float (default: top1)")
    report.add_argument("--format", choices=FORMATS, default="markdown", help="default: markdown")
    report.add_argument("-o", "--output", metavar="FILE", help="write the report here instead of stdout")
    report.add_argument("--batches", type=positive_int, metavar="N", help="evaluate at most N batches")
    report.add_argument("--threads", type=positive_int, help="torch threads for latency (default: torch's)")
    report.add_argument("--latency-budget", type=float, default=10.0, metavar="SECONDS",
                        help="time spent measuring latency (default: 10)")
    add_trust_arguments(report)
    report.set_defaults(handler=_report)

    regress = sub.add_parser("regress", parents=[common], help="compare a report with a baseline; exit 1 on a "
                                                               "regression")
    try:
        from fxquant.report.regress import add_regress_arguments
    except ImportError:  # the report package is optional in stripped-down installs
        regress.set_defaults(handler=_regress_unavailable)
        return
    add_regress_arguments(regress)
    regress.set_defaults(handler=_regress)


def _report(args: argparse.Namespace) -> int:
    from fxquant.report.build import report
    from fxquant.report.metrics import resolve_metric

    directory, manifest = open_run(args.run_dir, needs="converted")
    metric = metric_spec(args.metric)
    options = data_options(args, targets=resolve_metric(metric).needs_target)
    if args.seq_len is None:  # bad data fails before the (slower) rebuild
        data = load_data(options)
    float_model, quantized, _ = rebuild_run(directory, manifest, trust_options(args))
    if args.seq_len is not None:  # text: the tokenizer is the run's, opened once the run was authorized
        data = load_data(options, text_tokenizer(args, Source.from_manifest(directory, manifest).model, float_model))
    result = report(float_model, quantized, data, metric=metric, progress=not args.quiet, max_batches=args.batches,
                    threads=args.threads, latency_budget_s=args.latency_budget)
    fmt = "json" if args.json and not args.output else args.format
    text = {"markdown": result.to_markdown, "json": result.to_json, "html": result.to_html}[fmt]()
    if not args.output:
        print(text.rstrip("\n"))
        return 0
    atomic_write(args.output, text.encode())
    accuracy = result.to_dict()["accuracy"]
    emit(args, f"wrote the {fmt} report to {args.output} ({accuracy['metric']}: float {accuracy['float']:.4g}, "
               f"int8 {accuracy['quantized']:.4g})", {"output": args.output, "format": fmt, "accuracy": accuracy})
    return 0


def _regress(args: argparse.Namespace) -> int:
    from fxquant.report.regress import compare, run_regress

    if not args.json:
        return run_regress(args)
    result = compare(args.new, args.baseline, max_accuracy_drop=args.max_accuracy_drop,
                     max_latency_increase=args.max_latency_increase, max_size_increase=args.max_size_increase,
                     min_sqnr=args.min_sqnr, absolute_latency=args.absolute_latency,
                     max_relative_drop=args.max_relative_drop)
    rows = [{"metric": r.metric, "baseline": r.baseline, "new": r.new, "delta": r.delta, "limit": r.limit,
             "unit": r.unit, "passed": r.passed} for r in result.rows]
    emit(args, "", {"passed": result.passed, "rows": rows})
    return 0 if result.passed else 1


def _regress_unavailable(args: argparse.Namespace) -> int:
    raise InputError("regress is unavailable: fxquant.report.regress could not be imported in this install")
