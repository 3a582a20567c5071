"""``fxquant convert``: lower a calibrated run to INT8, optionally within an accuracy budget.

Plain ``convert`` lowers the run's calibrated statistics. With ``--max-accuracy-drop PTS`` or ``--max-relative-drop
PCT`` it runs the accuracy-budget search of :mod:`fxquant.tuning.budget` instead: the metric (``--metric``, as in
``fxquant report``, in its own direction: perplexity is better lower) is measured on ``--eval-data``, the fewest layers
are moved to ``--fallback`` (float, or the weight_only / dynamic scheme) that bring the drop within ``PTS`` metric
points (``fxquant regress`` uses the same unit: 0.5 = half a percentage point of top-1) or ``PCT`` percent of the
float metric, every trial starting from the ``--scheme`` recipe, and the trial table is printed. Kept-float layers go
into the run's config as ``exclude`` patterns and the run is prepared and calibrated again on ``--data`` (the
calibration data, with the same options as ``fxquant calibrate``); scheme fallbacks are recorded as the converted
model's schemes. Either way RUN_DIR holds the chosen model like any converted run (``fxquant report`` / ``export`` /
``fxquant.load`` rebuild it), and its history every trial, which ``fxquant report`` shows.

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

from fxquant.cli.common import add_trust_arguments, data_options, emit, positive_int, text_tokenizer, trust_options
from fxquant.cli.data import DataOptions, load_data
from fxquant.cli.rundir import advance, open_run, rebuild_run
from fxquant.cli.source import Source
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
                         help="run the Linears matching PATTERN on SCHEME (dynamic, dynamic_group or weight_only) "
                              "instead, without calibrating again; repeatable, the first matching pattern wins (e.g. "
                              "'*down_proj=weight_only')")
    budget = convert.add_argument_group("accuracy budget (move the fewest layers to the fallback that meet it)")
    budget.add_argument("--max-accuracy-drop", type=_points, metavar="PTS",
                        help="metric points the INT8 model may lose (top1/top5: percentage points, 0.5 = half a "
                             "point; a custom metric: its own units); needs --eval-data and --data")
    budget.add_argument("--max-relative-drop", type=_percent, metavar="PCT",
                        help="instead: percent of the float metric the INT8 model may be worse by, in the metric's "
                             "direction (perplexity: 1 allows +1%%)")
    budget.add_argument("--fallback", type=_fallback, default="float", metavar="NAME",
                        help="what a chosen layer runs instead: float (default), weight_only, dynamic or "
                             "dynamic_group (Linears); with --scheme '*=dynamic' a dynamic base with weight_only "
                             "fallback")
    budget.add_argument("--granularity", choices=("layer", "kind"), default="layer",
                        help="layer (default), or kind: a layer in every repeated block at once "
                             "(model.layers.*.mlp.down_proj)")
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
    budget.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="--data and --eval-data are text: windows of N tokens (as for fxquant calibrate)")
    budget.add_argument("--tokenizer", metavar="FOLDER", help="the tokenizer for --seq-len (default: the one saved "
                                                              "beside a transformers:FOLDER model)")
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


def _percent(text: str) -> float:
    try:
        return _points(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {text!r}") from None


def _fallback(text: str) -> str:
    from fxquant.tuning.budget import FALLBACKS

    if text not in FALLBACKS:
        why = " (static W8A8 is the base a layer falls back from)" if text == "static" else ""
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(FALLBACKS)}, got {text!r}{why}")
    return text


def _scheme(text: str) -> tuple[str, str]:
    from fxquant.api import FLOAT_IO_SCHEMES

    pattern, _, scheme = text.rpartition("=")
    if not pattern or scheme not in FLOAT_IO_SCHEMES:
        raise argparse.ArgumentTypeError("expected PATTERN=SCHEME with SCHEME dynamic, dynamic_group or weight_only, "
                                         f"got {text!r}")
    return pattern, scheme


def _convert(args: argparse.Namespace) -> int:
    if args.max_accuracy_drop is not None and args.max_relative_drop is not None:
        raise InputError("give one budget: --max-accuracy-drop (metric points) or --max-relative-drop (percent)")
    if args.max_accuracy_drop is None and args.max_relative_drop is None:
        given = [flag for flag, value in (("--eval-data", args.eval_data), ("--data", args.data),
                                          ("--fallback", args.fallback != "float"),
                                          ("--granularity", args.granularity != "layer")) if value]
        if given:
            raise InputError(f"{' and '.join(given)} only serve --max-accuracy-drop / --max-relative-drop; add one, "
                             "or drop them")
        return _plain(args)
    if args.example_inputs:
        raise InputError("--example-inputs only serves a plain convert with --backend auto; the accuracy-budget "
                         "search converts with the config's backend. Drop it, or drop --max-accuracy-drop")
    missing = [flag for flag, value in (("--eval-data", args.eval_data), ("--data", args.data)) if not value]
    if missing:
        flag = "--max-accuracy-drop" if args.max_accuracy_drop is not None else "--max-relative-drop"
        raise InputError(f"{flag} needs {' and '.join(missing)}: the data the metric is measured on "
                         "(--eval-data) and the calibration data to calibrate again with layers kept float (--data)")
    return _within_budget(args)


def _plain(args: argparse.Namespace) -> int:
    from fxquant.api import convert
    from fxquant.calibration import observers_of

    directory, manifest = open_run(args.run_dir)
    stage = "prepared" if manifest.stage == "prepared" else "calibrated"
    rebuilt = rebuild_run(directory, manifest, trust_options(args), stage=stage)
    prepared = rebuilt.graph
    if stage == "prepared" and observers_of(prepared):  # a run of dynamic or weight-only layers only needs none
        open_run(args.run_dir, needs="calibrated")  # raises, naming the step
    timing = parse_example_inputs(args.example_inputs, rebuilt.float_model) if args.example_inputs else None
    quantized = convert(prepared, backend=args.backend, example_inputs=timing, schemes=dict(args.scheme))
    _write(args, prepared, graph_of(quantized), extra={})
    return 0


def _write(args: argparse.Namespace, prepared: fx.GraphModule, quantized: fx.GraphModule,
           extra: dict[str, Any], text: str = "") -> None:
    """Record ``prepared``'s config, graph and statistics, then ``quantized``, as RUN_DIR's converted stage."""
    from fxquant.artifacts.model_io import observer_statistics, set_converted, set_graph, tensor_state
    from fxquant.inspect.graph import node_role
    from fxquant.nn.schemes import SchemeLinear
    from fxquant.report.layers import QuantizedLayer
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
    # INT8 layers wherever they are: graph nodes, inside islands, or standing in for a Linear in untraced code
    layers = [path for path, module in modules.items() if isinstance(module, (SchemeLinear, QuantizedLayer))]
    emit(args, f"{text}converted to INT8 on {manifest.backend}: {len(layers)} INT8 layers; {directory} is at stage "
               f"'converted'\nnext: fxquant report {directory} --data SPEC",
         {"run_dir": str(directory), "stage": "converted", "backend": manifest.backend, "int8_nodes": int8,
          "int8_layers": layers, **extra})


def _eval_options(args: argparse.Namespace, targets: bool) -> DataOptions:
    columns = tuple(c.strip() for c in args.eval_columns.split(",") if c.strip()) if args.eval_columns else ()
    return DataOptions(args.eval_data, args.eval_batch_size, columns, None, "test", args.seq_len, targets)


def _verdict(result: Any, drop_points: float, points: float, metric: str) -> tuple[bool, str]:
    """Whether the written model, worse than the float one by ``drop_points``, is within the search's budget, and
    the line that says so (in points for top-k metrics, in the metric's units otherwise)."""
    limit = result.max_accuracy_drop * points
    unit = " points" if points != 1 else ""
    relative = "" if result.max_relative_drop is None else f" ({result.max_relative_drop:g}%)"
    worse = "drop" if result.higher_is_better else "rise"
    if drop_points <= limit + 1e-9:
        return True, f"budget met: {metric} {worse} {drop_points:.4g}{unit} <= {limit:.4g}{unit}{relative}"
    return False, (f"budget NOT met: the closest model found is worse by a {metric} {worse} of {drop_points:.4g}"
                   f"{unit} (> {limit:.4g}{unit}{relative}); it is written all the same")


def _within_budget(args: argparse.Namespace) -> int:
    from fxquant.calibration.adapters import forward_parameters
    from fxquant.report.evaluate import score
    from fxquant.report.metrics import resolve_metric
    from fxquant.report.trials import HISTORY_KEY
    from fxquant.tuning.budget import quantize_within_budget

    directory, manifest = open_run(args.run_dir, needs="calibrated")
    metric = resolve_metric(metric_spec(args.metric))  # the same names and specs as fxquant report
    model, prepared, example = rebuild_run(directory, manifest, trust_options(args), stage="calibrated")
    tokenizer = text_tokenizer(args, Source.from_manifest(directory, manifest).model, model)
    eval_fn = functools.partial(score, data=load_data(_eval_options(args, metric.needs_target), tokenizer),
                                metric=metric, params=forward_parameters(graph_of(prepared))[0])
    calibration = load_data(data_options(args), tokenizer)
    points = metric.points_per_unit
    absolute = None if args.max_accuracy_drop is None else args.max_accuracy_drop / points
    config = manifest.quant_config()
    config = dataclasses.replace(config, backend=args.backend) if args.backend else config
    qmodel = quantize_within_budget(model, example, calibration, config, eval_fn=eval_fn,
                                    max_accuracy_drop=absolute, max_relative_drop=args.max_relative_drop,
                                    higher_is_better=getattr(metric, "higher_is_better", True),
                                    fallback=args.fallback, schemes=dict(args.scheme), granularity=args.granularity,
                                    max_trials=args.max_trials, progress=not args.quiet)
    result = graph_of(qmodel).meta["fxquant_fallback"]
    assert result.prepared is not None
    # The search's model itself: RUN_DIR records its convert-time options and rebuilds it exactly (measured again
    # here all the same: what is written is what the verdict is about).
    written_metric = eval_fn(qmodel)
    drop_points = result.drop(written_metric) * points
    met, verdict = _verdict(result, drop_points, points, metric.name)
    written_line = f"written to RUN_DIR: {metric.name} {written_metric:.4f}; {verdict}"
    section = result.section(metric.name)
    table = "" if args.json else f"{section.to_markdown()}\n\n{written_line}\n"
    _write(args, result.prepared, graph_of(qmodel), text=table,
           extra={"max_accuracy_drop": args.max_accuracy_drop, "max_relative_drop": args.max_relative_drop,
                  "metric": metric.name, "met_budget": met, "float_metric": result.float_metric,
                  "int8_metric": written_metric, "drop_points": drop_points, "fallback": result.fallback,
                  "fallback_layers": list(result.fallback_layers), "float_layers": list(result.float_layers),
                  "schemes": result.conversion().schemes, "trials": len(result.trials),
                  HISTORY_KEY: section.to_dict()})
    return 0 if met else EXIT_BUDGET_MISSED
