"""The real ``fxquant`` command, run as a subprocess the way users and CI run it."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fxquant", *args], capture_output=True, text=True, timeout=300)


def test_graph_prints_the_prepared_table_with_observers() -> None:
    result = run("graph", "--model", "fxquant.models:conv_bn_net", "--example-inputs", "1x3x32x32")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs", "quant"]
    assert sum(line.rstrip().endswith("observer") for line in lines) == 3


def test_debug_shows_the_traceback() -> None:
    result = run("--debug", "graph", "--model", "fxquant.models:nope", "--example-inputs", "1x4")
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_demo_quantizes_the_bundled_model_and_prints_the_report() -> None:
    result = run("--quiet", "demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for row in ("test accuracy", "latency, batch 64", "size (state dict)"):
        assert row in out, out
    fp32, int8 = (float(v.rstrip("%")) for v in out.split("test accuracy")[1].split()[:2])
    assert int8 >= fp32 - 1.0, out


def test_coverage_command_lists_layers_and_breaks() -> None:
    result = run("coverage", "--model", "fxquant.models:control_flow_net", "--example-inputs", "2x3x32x32")
    assert result.returncode == 0, result.stderr
    assert "4/4 Linear/Conv layers INT8" in result.stdout
    assert "graph break: inside untraceable block 'gated'" in result.stdout and "control_flow.py" in result.stdout
