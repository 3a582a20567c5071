"""``fxquant.report`` is the public function (API.md) and the package of report modules at once."""

from __future__ import annotations

import importlib
import inspect

import fxquant
from fxquant.report import build, schema


def test_the_package_is_the_function_and_keeps_its_names() -> None:
    assert fxquant.report.Report is schema.Report
    assert inspect.signature(fxquant.report) == inspect.signature(build.report)
    html = importlib.import_module("fxquant.report.html")  # a submodule imported later rebinds nothing
    assert callable(fxquant.report) and fxquant.report.html is html

