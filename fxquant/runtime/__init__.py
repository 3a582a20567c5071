"""How a converted model runs: the graph walk that replaces torch.fx's generated code (:mod:`~fxquant.runtime.runner`),
runs of oneDNN layers replayed as recorded primitive calls (:mod:`~fxquant.runtime.replay`), and the timed choice
behind ``backend="auto"`` (:mod:`~fxquant.runtime.auto_backend`)."""
