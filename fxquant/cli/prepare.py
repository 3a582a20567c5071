"""``fxquant prepare``: trace a model, insert observers, start RUN_DIR (``calibrate`` and ``convert`` are the next
stages: fxquant/cli/calibrate.py, fxquant/cli/convert.py).

Every handler computes everything in memory first and commits at the end (:func:`fxquant.cli.rundir.advance`), so
bad input, a crash or Ctrl-C leaves RUN_DIR as it was. Calibration additionally checkpoints its progress under
``RUN_DIR/checkpoints/`` so that ``--resume`` continues an interrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fxquant.cli.common import emit, load_config
from fxquant.cli.rundir import create_run
from fxquant.cli.source import from_command_line
from fxquant.config import CONFIG_SCHEMES


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    prepare = sub.add_parser("prepare", parents=[common], help="trace a model, insert observers, start RUN_DIR")
    prepare.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY|FOLDER",
                         help="a factory returning the float nn.Module, or a Hugging Face model: a save_pretrained "
                              "folder (transformers:FOLDER, or its path) or transformers:HUB_ID")
    prepare.add_argument("--weights", metavar="FILE", help="state dict to load into the model (weights_only)")
    prepare.add_argument("--example-inputs", metavar="SPEC",
                         help="shapes such as 1x3x224x224,1x10, tokens:1x32 (random token ids), or "
                              "PKG.MODULE:FUNCTION returning a tuple; default for a Hugging Face model: tokens:1x32")
    prepare.add_argument("--config", metavar="FILE", help="QuantConfig as .json/.yaml/.toml")
    prepare.add_argument("--scheme", choices=CONFIG_SCHEMES,
                         help="the config's scheme: static W8A8 (calibrated), dynamic (W8A8, per-token), dynamic_group "
                              "(W8A8, per group of each token's inputs), weight_only (W8A16), or auto (the default: "
                              "dynamic_group for decoder LLMs, else static)")
    prepare.add_argument("-o", "--output", required=True, metavar="RUN_DIR")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing run in RUN_DIR")
    prepare.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from fxquant.calibration import observers_of

    source, recipe = from_command_line(args.model, args.example_inputs, args.weights)
    config = load_config(args.config)
    if args.scheme:
        config = dataclasses.replace(config, scheme=args.scheme)
    manifest, prepared = create_run(Path(args.output), source, recipe, config, overwrite=args.overwrite)
    count = len(observers_of(prepared))
    step = f"fxquant calibrate {args.output} --data SPEC" if count else f"fxquant convert {args.output}"
    emit(args, f"prepared {source.model}: {count} observers inserted; {args.output} is at stage 'prepared'\n"
               f"next: {step}",
         {"run_dir": args.output, "stage": "prepared", "observers": count,
          "fingerprint": manifest.fingerprints["prepared"]})
    return 0
