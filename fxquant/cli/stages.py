"""``fxquant prepare`` / ``calibrate`` / ``convert``: one stage each, recorded in RUN_DIR.

Every handler computes everything in memory first and commits at the end (:func:`fxquant.cli.rundir.advance`), so
bad input, a crash or Ctrl-C leaves RUN_DIR as it was. Calibration additionally checkpoints its progress under
``RUN_DIR/checkpoints/`` so that ``--resume`` continues an interrupted run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fxquant.cli.common import add_data_arguments, data_options, emit, load_config, positive_int
from fxquant.cli.data import load_data
from fxquant.cli.rundir import Source, advance, create_run, open_run, rebuild_run

CHECKPOINT = Path("checkpoints") / "calibration.pt"


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    prepare = sub.add_parser("prepare", parents=[common], help="trace a model, insert observers, start RUN_DIR")
    prepare.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY", help="returns the float nn.Module")
    prepare.add_argument("--weights", metavar="FILE", help="state dict to load into the model (weights_only)")
    prepare.add_argument("--example-inputs", required=True, metavar="SPEC",
                         help="shapes such as 1x3x224x224,1x10, or PKG.MODULE:FUNCTION returning a tuple")
    prepare.add_argument("--config", metavar="FILE", help="QuantConfig as .json/.yaml/.toml")
    prepare.add_argument("-o", "--output", required=True, metavar="RUN_DIR")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing run in RUN_DIR")
    prepare.set_defaults(handler=_prepare)

    calibrate = sub.add_parser("calibrate", parents=[common], help="run data through the observers")
    calibrate.add_argument("run_dir", metavar="RUN_DIR")
    add_data_arguments(calibrate, split="train")
    calibrate.add_argument("--batches", type=positive_int, metavar="N", help="use at most N batches")
    calibrate.add_argument("--resume", action="store_true", help="continue an interrupted calibration")
    calibrate.add_argument("--checkpoint-every", type=positive_int, default=10, metavar="N",
                           help="checkpoint the statistics every N batches (default: 10)")
    calibrate.add_argument("--skip-nonfinite", action="store_true", help="skip batches with NaN/Inf")
    calibrate.set_defaults(handler=_calibrate)

    convert = sub.add_parser("convert", parents=[common], help="convert a calibrated run to INT8")
    convert.add_argument("run_dir", metavar="RUN_DIR")
    convert.add_argument("--backend", help="fbgemm, qnnpack, onednn, reference or auto (default: the config's)")
    convert.set_defaults(handler=_convert)


def _prepare(args: argparse.Namespace) -> int:
    from fxquant.calibration import observers_of

    source = Source.from_args(args.model, args.example_inputs, args.weights)
    manifest, prepared = create_run(Path(args.output), source, load_config(args.config), overwrite=args.overwrite)
    count = len(observers_of(prepared))
    emit(args, f"prepared {args.model}: {count} observers inserted; {args.output} is at stage 'prepared'\n"
               f"next: fxquant calibrate {args.output} --data SPEC",
         {"run_dir": args.output, "stage": "prepared", "observers": count,
          "fingerprint": manifest.fingerprints["prepared"]})
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from fxquant.artifacts.model_io import observer_statistics
    from fxquant.calibration import calibrate
    from fxquant.state import quant_state

    directory, manifest = open_run(args.run_dir)
    data = load_data(data_options(args))
    _, prepared = rebuild_run(directory, manifest, stage="prepared")
    checkpoint = directory / CHECKPOINT
    summary = calibrate(prepared, data, num_batches=args.batches, progress=not args.quiet,
                        skip_nonfinite=args.skip_nonfinite, checkpoint=checkpoint,
                        checkpoint_every=args.checkpoint_every, resume=args.resume)
    manifest.calibration_samples = quant_state(prepared).calibration_samples
    advance(directory, manifest, "calibrated", {"observers": observer_statistics(prepared)}, data=args.data,
            batches=summary.batches, samples=summary.samples, resumed_batches=summary.resumed_batches)
    checkpoint.unlink(missing_ok=True)
    if checkpoint.parent.is_dir() and not any(checkpoint.parent.iterdir()):
        checkpoint.parent.rmdir()
    emit(args, f"{summary}\n{directory} is at stage 'calibrated'; next: fxquant convert {directory}",
         {"run_dir": str(directory), "stage": "calibrated", "batches": summary.batches, "samples": summary.samples,
          "seconds": summary.seconds, "resumed_batches": summary.resumed_batches,
          "ranges": summary.ranges, "unobserved": summary.unobserved, "warnings": summary.warnings})
    return 0


def _convert(args: argparse.Namespace) -> int:
    from fxquant.api import convert
    from fxquant.artifacts.model_io import set_graph, tensor_state
    from fxquant.graph_view import node_role
    from fxquant.state import quant_state

    directory, manifest = open_run(args.run_dir, needs="calibrated")
    _, prepared = rebuild_run(directory, manifest, stage="calibrated")
    quantized = convert(prepared, backend=args.backend)
    manifest.backend = quant_state(quantized).backend
    set_graph(manifest, "converted", quantized)
    advance(directory, manifest, "converted", {"quantized": tensor_state(quantized)}, backend=manifest.backend)
    modules = dict(quantized.named_modules())
    int8 = [n.name for n in quantized.graph.nodes if node_role(n, modules).startswith("int8")]
    emit(args, f"converted to INT8 on {manifest.backend}: {len(int8)} int8 nodes; {directory} is at stage "
               f"'converted'\nnext: fxquant report {directory} --data SPEC",
         {"run_dir": str(directory), "stage": "converted", "backend": manifest.backend, "int8_nodes": int8})
    return 0
