"""Build configuration beyond pyproject.toml: the optional C loop of the histogram observers.

``optional=True``: where no C compiler is available the install still succeeds and
:mod:`fxquant.observers.counting` uses its pure-torch path (same counts, about 3x slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fxquant._native", ["fxquant/_native.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"])])
