"""``fxquant convert``: lower a calibrated run to INT8, optionally within an accuracy budget.

Plain ``convert`` lowers the run's calibrated statistics. With ``--max-accuracy-drop PTS`` it runs the
accuracy-budget search of :mod:`fxquant.tuning.budget` instead: the metric (``--metric``, as in ``fxquant report``) is
measured on ``--eval-data``, the fewest layers are kept float that bring the drop within ``PTS`` metric points
(``fxquant regress`` uses the same unit: 0.5 = half a percentage point of top-1), and the trial table is printed.
The kept-float layers go into the run's config as ``exclude`` patterns and the run is prepared and calibrated again
on ``--data`` (the calibration data, with the same options as ``fxquant calibrate``), so RUN_DIR holds the chosen
model like any converted run: ``fxquant report`` / ``export`` / ``fxquant.load`` rebuild it.

Exit status: 0 when the written model is within the budget; :data:`EXIT_BUDGET_MISSED` (3) when no trial met it
(the closest model found is written all the same, and the message says so); 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any

from torch import fx

from fxquant.cli.common import add_trust_arguments, data_options, emit, positive_int, trust_options
from fxquant.cli.data import DataOptions, load_data
from fxquant.cli.rundir import advance, open_run, rebuild_run
from fxquant.cli.specs import metric_spec, parse_example_inputs
from fxquant.errors import InputError
from fxquant.state import graph_of

EXIT_BUDGET_MISSED = 3
DEFAULT_MAX_TRIALS = 16


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    convert = sub.add_parser("convert", parents=[common], help="convert a calibrated run to INT8")
    convert.add_argument("run_dir", metavar="RUN_DIR")
    convert.add_argument("--backend", help="fbgemm, qnnpack, onednn, reference or auto (default: the config's)")
    convert.add_argument("--example-inputs", metavar="SPEC",
                         help="backend auto only: the inputs it times kernels on, shaped like your deployment "
                              "batches (32x3x224x224, or PKG.MODULE:FUNCTION; default: shaped like prepare's)")
    convert.add_argument("--scheme", action="append", default=[], type=_scheme, metavar="PATTERN=SCHEME",
                         help="run the Linears matching PATTERN on SCHEME (dynamic or weight_only) instead, without "
                              "calibrating again; repeatable, the first matching pattern wins (e.g. "
                              "'*down_proj=weight_only')")
    budget = convert.add_argument_group("accuracy budget (keep the fewest layers float that meet it)")
    budget.add_argument("--max-accuracy-drop", type=_points, metavar="PTS",
                        help="metric points the INT8 model may lose (top1/top5: percentage points, 0.5 = half a "
                             "point; a custom metric: its own units); needs --eval-data and --data")
    budget.add_argument("--eval-data", metavar="SPEC", help="(inputs, target) batches the metric is measured on; "
                                                            "same forms as --data")
    budget.add_argument("--eval-columns", metavar="A,B", help="dataset columns / .npz arrays of --eval-data, in "
                                                              "order (e.g. images,labels)")
    budget.add_argument("--eval-batch-size", type=positive_int, default=256, help="default: 256")
    budget.add_argument("--metric", default="top1",
                        help="top1, top5, or PKG.MODULE:FUNCTION(outputs, targets) -> float (default: top1)")
    budget.add_argument("--max-trials", type=positive_int, default=DEFAULT_MAX_TRIALS,
                        help=f"conversions the search may evaluate (default: {DEFAULT_MAX_TRIALS})")
    budget.add_argument("--data", metavar="SPEC", help="calibration data (as for fxquant calibrate): the search "
                                                       "calibrates on it, with layers kept float too")
    budget.add_argument("--batch-size", type=positive_int, default=32, help="rows per --data batch (default: 32)")
    budget.add_argument("--columns", metavar="A,B", help="dataset columns / .npz arrays of --data to feed")
    budget.add_argument("--transform", metavar="PKG.MODULE:FUNCTION", help="applied to each --data batch")
    budget.add_argument("--split", default="train", help="dataset split of --data (default: train)")
    add_trust_arguments(convert)
    convert.set_defaults(handler=_convert)


def _points(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of metric points >= 0, got {text!r}")
    return value


def _scheme(text: str) -> tuple[str, str]:
    from fxquant.config import SCHEMES

    pattern, _, scheme = text.rpartition("=")
    if not pattern or scheme not in SCHEMES or scheme == "static":
        raise argparse.ArgumentTypeError(f"expected PATTERN=SCHEME with SCHEME dynamic or weight_only, got {text!r}")
    return pattern, scheme


def _convert(args: argparse.Namespace) -> int:
    if args.scheme and args.max_accuracy_drop is not None:
        raise InputError("--scheme is for a plain convert; the accuracy-budget search keeps layers float instead. "
                         "Drop one of --scheme and --max-accuracy-drop")
    if args.max_accuracy_drop is None:
        given = [flag for flag, value in (("--eval-data", args.eval_data), ("--data", args.data)) if value]
        if given:
            raise InputError(f"{' and '.join(given)} only serve --max-accuracy-drop; add it, or drop them")
        return _plain(args)
    if args.example_inputs:
        raise InputError("--example-inputs only serves a plain convert with --backend auto; the accuracy-budget "
                         "search converts with the config's backend. Drop it, or drop --max-accuracy-drop")
    missing = [flag for flag, value in (("--eval-data", args.eval_data), ("--data", args.data)) if not value]
    if missing:
        raise InputError(f"--max-accuracy-drop needs {' and '.join(missing)}: the data the metric is measured on "
                         "(--eval-data) and the calibration data to calibrate again with layers kept float (--data)")
    return _within_budget(args)


def _plain(args: argparse.Namespace) -> int:
    from fxquant.api import convert
    from fxquant.calibration import observers_of

    directory, manifest = open_run(args.run_dir)
    stage = "prepared" if manifest.stage == "prepared" else "calibrated"
    prepared = rebuild_run(directory, manifest, trust_options(args), stage=stage).graph
    if stage == "prepared" and observers_of(prepared):  # a run of dynamic or weight-only layers only needs none
        open_run(args.run_dir, needs="calibrated")  # raises, naming the step
    timing = parse_example_inputs(args.example_inputs) if args.example_inputs else None
    quantized = convert(prepared, backend=args.backend, example_inputs=timing, schemes=dict(args.scheme))
    _write(args, prepared, graph_of(quantized), extra={})
    return 0


def _write(args: argparse.Namespace, prepared: fx.GraphModule, quantized: fx.GraphModule,
           extra: dict[str, Any], text: str = "") -> None:
    """Record ``prepared``'s config, graph and statistics, then ``quantized``, as RUN_DIR's converted stage."""
    from fxquant.artifacts.model_io import observer_statistics, set_converted, set_graph, tensor_state
    from fxquant.inspect.graph import node_role
    from fxquant.state import quant_state

    directory, manifest = open_run(args.run_dir)
    state = quant_state(prepared)
    manifest.config = state.config.to_dict()
    set_graph(manifest, "prepared", prepared)
    manifest.calibration_samples = state.calibration_samples
    set_converted(manifest, quantized)
    tensors = {"observers": observer_statistics(prepared), "quantized": tensor_state(quantized)}
    advance(directory, manifest, "converted", tensors, backend=manifest.backend, **extra)
    modules = dict(quantized.named_modules())
    int8 = [n.name for n in quantized.graph.nodes if node_role(n, modules).startswith("int8")]
    emit(args, f"{text}converted to INT8 on {manifest.backend}: {len(int8)} int8 nodes; {directory} is at stage "
               f"'converted'\nnext: fxquant report {directory} --data SPEC",
         {"run_dir": str(directory), "stage": "converted", "backend": manifest.backend, "int8_nodes": int8,
          **extra})


def _eval_options(args: argparse.Namespace) -> DataOptions:
    columns = tuple(c.strip() for c in args.eval_columns.split(",") if c.strip()) if args.eval_columns else ()
    return DataOptions(args.eval_data, args.eval_batch_size, columns, None, "test")


def _within_budget(args: argparse.Namespace) -> int:
    from fxquant.calibration.adapters import forward_parameters
    from fxquant.report.evaluate import score
    from fxquant.report.metrics import resolve_metric
    from fxquant.tuning.budget import quantize_within_budget

    directory, manifest = open_run(args.run_dir, needs="calibrated")
    model, prepared, example = rebuild_run(directory, manifest, trust_options(args), stage="calibrated")
    metric = resolve_metric(metric_spec(args.metric))  # the same names and specs as fxquant report
    eval_fn = functools.partial(score, data=load_data(_eval_options(args)), metric=metric,
                                params=forward_parameters(graph_of(prepared))[0])
    calibration = load_data(data_options(args))
    budget = args.max_accuracy_drop / metric.points_per_unit
    config = manifest.quant_config()
    config = dataclasses.replace(config, backend=args.backend) if args.backend else config
    qmodel = quantize_within_budget(model, example, calibration, config, eval_fn=eval_fn,
                                    max_accuracy_drop=budget, max_trials=args.max_trials, progress=not args.quiet)
    result = graph_of(qmodel).meta["fxquant_fallback"]
    assert result.prepared is not None
    # The search's model itself: RUN_DIR records its convert-time keep_float and rebuilds it exactly (measured again
    # here all the same: what is written is what the verdict is about).
    written = qmodel
    written_metric = eval_fn(written)
    drop_points = (result.float_metric - written_metric) * metric.points_per_unit
    met = drop_points <= args.max_accuracy_drop + 1e-9
    verdict = (f"budget met: {metric.name} drop {drop_points:.3f} points <= {args.max_accuracy_drop:g}" if met else
               f"budget NOT met: the closest model found drops {metric.name} by {drop_points:.3f} points "
               f"(> {args.max_accuracy_drop:g}); it is written all the same")
    written_line = f"written to RUN_DIR: {metric.name} {written_metric:.4f}; {verdict}"
    table = "" if args.json else f"{result.to_markdown()}\n\n{written_line}\n"
    float_layers = list(result.float_layers)
    _write(args, result.prepared, graph_of(written), text=table,
           extra={"max_accuracy_drop": args.max_accuracy_drop, "metric": metric.name, "met_budget": met,
                  "float_metric": result.float_metric, "int8_metric": written_metric, "drop_points": drop_points,
                  "float_layers": float_layers, "trials": len(result.trials)})
    return 0 if met else EXIT_BUDGET_MISSED
