"""Subcommand definitions and their handlers."""

from __future__ import annotations

import argparse

from fxquant.cli.specs import build_model, parse_example_inputs
from fxquant.config import QuantConfig


def register(sub: argparse._SubParsersAction) -> None:
    graph = sub.add_parser("graph", help="print the prepared model's FX graph as a table")
    graph.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY")
    graph.add_argument("--weights", metavar="FILE", help="state dict to load into the model")
    graph.add_argument("--example-inputs", required=True, metavar="SPEC", help="e.g. 1x3x224x224,1x10")
    graph.add_argument("--config", metavar="FILE", help="QuantConfig as .json/.yaml/.toml")
    graph.set_defaults(handler=_graph)

    demo = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits, quantize it, print the report")
    demo.add_argument("--threads", type=int, default=1, help="torch threads for the latency measurement")
    demo.add_argument("--backend", default="fbgemm")
    demo.set_defaults(handler=_demo)


def _config(path: str | None) -> QuantConfig:
    return QuantConfig.from_file(path) if path else QuantConfig()


def _graph(args: argparse.Namespace) -> int:
    from fxquant.api import prepare
    from fxquant.graph_view import print_graph

    model = build_model(args.model, args.weights)
    print_graph(prepare(model, parse_example_inputs(args.example_inputs), _config(args.config)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from fxquant.demo import run_demo

    run_demo(threads=args.threads, backend=args.backend, progress=not args.quiet)
    return 0
