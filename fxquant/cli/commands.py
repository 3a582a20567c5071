"""``fxquant graph`` / ``inspect`` / ``export`` / ``demo``: look at a run or an export, ship it, or try the bundled
example."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fxquant.artifacts.export import FORMATS as EXPORT_FORMATS
from fxquant.cli.common import TRUST_SPEC_HELP, add_trust_arguments, emit, load_config, printable, trust_options
from fxquant.cli.rundir import open_run, rebuild_run
from fxquant.cli.specs import build_model, parse_example_inputs
from fxquant.errors import InputError


def _model_source(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help=f"show the {what} of the run's latest stage")
    parser.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                        help=f"or: prepare this model and show its {what}; with RUN_DIR: the run's model factory, "
                             "named again (docs/cli.md, Trust)")
    parser.add_argument("--weights", metavar="FILE", help="state dict to load into the model (with RUN_DIR: the "
                                                          "one it was prepared with)")
    parser.add_argument("--example-inputs", metavar="SPEC", help="e.g. 1x3x224x224,1x10")
    parser.add_argument("--config", metavar="FILE", help="QuantConfig as .json/.yaml/.toml")
    parser.add_argument("--trust-model-spec", action="store_true", help=f"with RUN_DIR: {TRUST_SPEC_HELP}")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    graph = sub.add_parser("graph", parents=[common], help="print a run's (or a model's prepared) FX graph as a table")
    _model_source(graph, "graph")
    graph.set_defaults(handler=_graph)

    coverage = sub.add_parser("coverage", parents=[common],
                              help="every Linear/Conv: INT8 or not, why not, backend; graph breaks")
    _model_source(coverage, "coverage")
    coverage.set_defaults(handler=_coverage)

    inspect = sub.add_parser("inspect", parents=[common],
                             help="what each stage of a run produced, versions, config; or what an export holds")
    inspect.add_argument("run_dir", metavar="RUN_DIR|EXPORT", help="a run directory, or a file fxquant export wrote")
    inspect.set_defaults(handler=_inspect)

    export = sub.add_parser("export", parents=[common],
                            help="write a converted run as ONNX (QDQ), a torch.export .pt2 or TorchScript (legacy)")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--format", choices=tuple(EXPORT_FORMATS),
                        help="default: from the output's suffix (.onnx, .pt2, .pt)")
    export.add_argument("-o", "--output", required=True, metavar="FILE")
    export.add_argument("--overwrite", action="store_true", help="replace FILE (and its manifest) if they exist")
    export.add_argument("--backend", help="export for this backend instead of the one the run was converted for")
    add_trust_arguments(export)
    export.set_defaults(handler=_export)

    demo = sub.add_parser("demo", parents=[common],
                          help="train a small CNN on scikit-learn's digits, quantize it, print the report")
    demo.add_argument("--threads", type=int, default=1, help="torch threads for the latency measurement")
    demo.add_argument("--backend", help="default: the machine's default backend (onednn on x86-64)")
    demo.set_defaults(handler=_demo)


def _graph_model(args: argparse.Namespace) -> Any:
    from fxquant.api import prepare

    if args.run_dir is not None:
        if args.example_inputs or args.config:
            raise InputError("give either RUN_DIR or --model with --example-inputs/--config, not both (with RUN_DIR, "
                             "--model only names the run's own model again)")
        directory, manifest = open_run(args.run_dir)
        return rebuild_run(directory, manifest, trust_options(args)).model
    if args.trust_model_spec:
        raise InputError("--trust-model-spec is for a RUN_DIR; without one, the model is the --model you give")
    if not args.model or not args.example_inputs:
        raise InputError("give RUN_DIR, or --model PKG.MODULE:FACTORY with --example-inputs SPEC")
    model = build_model(args.model, args.weights)
    return prepare(model, parse_example_inputs(args.example_inputs, model), load_config(args.config))


def _graph(args: argparse.Namespace) -> int:
    from fxquant.inspect.graph import format_graph, node_role
    from fxquant.state import graph_of

    gm = graph_of(_graph_model(args))  # a drop-in model: the GraphModule behind it
    modules = dict(gm.named_modules())
    rows = [{"op": n.op, "name": n.name, "target": str(n.target), "role": node_role(n, modules)}
            for n in gm.graph.nodes]
    emit(args, format_graph(gm), {"nodes": rows})
    return 0


def _coverage(args: argparse.Namespace) -> int:
    from fxquant.inspect.coverage import coverage

    report = coverage(_graph_model(args))
    data = {"layers": report.rows(), "quantize_nodes": report.quantize_nodes,
            "dequantize_nodes": report.dequantize_nodes, "graph_breaks": list(report.graph_breaks)}
    emit(args, str(report), data)
    return 0


def _trusted_here(directory: Path, manifest: Any) -> str:
    from fxquant.cli.source import Source, trust_status
    from fxquant.errors import ArtifactError

    if not manifest.source:
        return "- (saved with fxquant.save: names no model; fxquant.load(path, model) takes yours)"
    try:
        return trust_status(directory, Source.from_manifest(directory, manifest))
    except ArtifactError as exc:
        return f"BAD: {exc}"


def _inspect_text(directory: Path, manifest: Any, files: dict[str, str]) -> str:
    from fxquant._version import __version__

    source = manifest.source if isinstance(manifest.source, dict) else {}
    lines = [f"run directory  {directory}", f"stage          {manifest.stage}",
             f"made with      fxquant {manifest.fxquant_version}, torch {manifest.torch_version} (now: fxquant "
             f"{__version__})", f"model          {source.get('model', '(saved with fxquant.save)')}",
             f"weights        {source.get('weights') or '-'}",
             f"example inputs {source.get('example_inputs') or manifest.example_inputs}",
             f"trusted here   {_trusted_here(directory, manifest)}",
             f"backend        {manifest.backend or '-'}", f"calibrated on  {manifest.calibration_samples} samples",
             "config         " + ", ".join(f"{k}={v}" for k, v in manifest.config.items() if k != "version"),
             "files"]
    lines += [f"  {role:<12} {manifest.files[role]['name']}  {status}" for role, status in files.items()]
    lines.append("history")
    for step in manifest.history:
        details = ", ".join(f"{k}={v}" for k, v in step.items() if k not in ("stage", "at", "fxquant_version"))
        lines.append(f"  {step.get('at')}  {step.get('stage')!s:<10} {details}")
    return printable("\n".join(lines))


def _inspect_export(path: Path, args: argparse.Namespace) -> int:
    from fxquant.artifacts.export.sidecar import read_sidecar

    manifest, status = read_sidecar(path)
    lines = [f"export         {path}", f"file           {manifest.get('file')}  {status}"]
    lines += [f"{key:<14} {value}" for key, value in manifest.items() if key not in ("file", "format", "sha256")]
    emit(args, printable("\n".join(lines)), {**manifest, "file_status": status})
    if not status.startswith("ok"):
        print(f"fxquant inspect: error: {status.removeprefix('BAD: ')}", file=sys.stderr)
    return 0 if status.startswith("ok") else 2


def _inspect(args: argparse.Namespace) -> int:
    from fxquant.artifacts.manifest import read_manifest, verify_file
    from fxquant.errors import ArtifactError

    directory = Path(args.run_dir)
    if directory.is_file():
        return _inspect_export(directory, args)
    manifest = read_manifest(directory)
    files: dict[str, str] = {}
    for role in manifest.files:
        try:
            verify_file(directory, manifest, role)
            files[role] = "ok (SHA-256 verified)"
        except ArtifactError as exc:
            files[role] = f"BAD: {exc}"
    data = {k: v for k, v in manifest.to_dict().items() if k != "graphs"}
    emit(args, _inspect_text(directory, manifest, files), {**data, "file_status": files})
    bad = [role for role, status in files.items() if not status.startswith("ok")]
    if bad:
        print(f"fxquant inspect: error: {', '.join(bad)} file(s) do not match the manifest", file=sys.stderr)
    return 2 if bad else 0


_LOAD_WITH = {"onnx": "onnxruntime.InferenceSession", "export": "torch.export.load", "torchscript": "torch.jit.load"}


def _export(args: argparse.Namespace) -> int:
    from fxquant.api import convert
    from fxquant.artifacts.export import export, export_format
    from fxquant.artifacts.export.sidecar import sidecar_path

    output = Path(args.output)
    chosen = export_format(output, args.format)  # before the run is rebuilt: a bad name costs nothing
    for target in (output, sidecar_path(output)):
        if target.exists() and not args.overwrite:
            raise InputError(f"{target} exists; remove it or pass --overwrite")
    directory, manifest = open_run(args.run_dir, needs="calibrated" if args.backend else "converted")
    if args.backend and args.backend != manifest.backend:
        prepared = rebuild_run(directory, manifest, trust_options(args), stage="calibrated").graph
        quantized = convert(prepared, backend=args.backend)
    else:
        quantized = rebuild_run(directory, manifest, trust_options(args)).model
    path = export(quantized, output, format=chosen, overwrite=args.overwrite)
    size = path.stat().st_size
    emit(args, f"wrote {path} ({size / 1024:.1f} KiB, {chosen}) and {sidecar_path(path).name}; load it with "
               f"{_LOAD_WITH[chosen]}, no fxquant needed",
         {"output": str(path), "format": chosen, "bytes": size, "manifest": str(sidecar_path(path))})
    return 0


def _demo(args: argparse.Namespace) -> int:
    from fxquant.cli.demo import run_demo

    run_demo(threads=args.threads, backend=args.backend, progress=not args.quiet)
    return 0
