"""Introspection that reads models and never changes them: Linear/Conv coverage (:mod:`~fxquant.inspect.coverage`)
and the graph as a table (:mod:`~fxquant.inspect.graph`)."""
