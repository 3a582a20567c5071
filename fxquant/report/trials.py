"""The accuracy-budget search's trials as a report section: every conversion it evaluated and which one is the model.

:func:`fxquant.tuning.budget.quantize_within_budget` puts a :class:`BudgetTrials` on the model it returns
(``graph_of(qmodel).meta[TRIALS_KEY]``), and ``fxquant convert --max-accuracy-drop`` records it in RUN_DIR's
history with the converted stage, so a report shows how its model was chosen whether it measures a Python model
or a run directory. The search prints the same table (``FallbackResult.to_markdown`` renders this section): one
table, one place. See docs/accuracy.md "Accuracy-budget fallback".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fxquant.errors import ArtifactError
from fxquant.report._validate import items, number, read
from fxquant.state import graph_of

TRIALS_KEY = "fxquant_budget_trials"  # in the chosen model's GraphModule ``meta``: a BudgetTrials
HISTORY_KEY = "budget_search"  # in RUN_DIR's manifest history entry of the converted stage: BudgetTrials.to_dict()


@dataclass(frozen=True)
class Trial:
    """One conversion the search evaluated."""

    step: str  # "all INT8" (or "base schemes"), "leave-one-out", "greedy", "prune", "final ..."
    layers: tuple[str, ...]  # layers (or patterns of layers) on the fallback: kept float, or on the fallback scheme
    metric: float
    drop: float  # how much worse than the float model, in metric units, whichever way the metric improves
    latency_ms: float
    met_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layers": list(self.layers), "metric": self.metric, "drop": self.drop,
                "latency_ms": self.latency_ms, "met_budget": self.met_budget}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Trial:
        layers = items(data, "layers", where)
        if not all(isinstance(layer, str) for layer in layers):
            raise ArtifactError(f"{where}.layers: expected a list of layer names, got {layers!r}")
        return cls(read(data, "step", str, where), tuple(layers), number(data, "metric", where),
                   number(data, "drop", where), number(data, "latency_ms", where),
                   read(data, "met_budget", bool, where))


@dataclass(frozen=True)
class BudgetTrials:
    """Every trial of one accuracy-budget search, the budget, and which trial the model is (``chosen``)."""

    float_metric: float
    max_drop: float  # the budget in metric units (a relative budget times the float metric)
    float_latency_ms: float
    trials: tuple[Trial, ...]
    chosen: int
    fallback: str = "float"  # what a layer falls back to: "float", "weight_only" or "dynamic"
    higher_is_better: bool = True
    max_relative_drop: float | None = None  # the budget as given, in percent of the float metric, when relative
    metric: str = "metric"
    schemes: dict[str, str] = field(default_factory=dict)  # the convert(schemes=...) every trial starts from

    def header(self) -> list[str]:
        where = "kept float" if self.fallback == "float" else f"on {self.fallback}"
        return ["#", "step", f"layers {where}", self.metric, "drop" if self.higher_is_better else "increase",
                "latency ms", "within budget"]

    def rows(self) -> list[list[str]]:
        """The table's cells, one row per trial in the order they ran (plain text: renderers escape them)."""
        return [[f"{index}{' (returned)' if index == self.chosen else ''}", trial.step,
                 ", ".join(trial.layers) or "(none)", f"{trial.metric:.4f}", self._drop(trial.drop),
                 f"{trial.latency_ms:.3f}", "yes" if trial.met_budget else "no"]
                for index, trial in enumerate(self.trials)]

    def _drop(self, drop: float) -> str:
        if self.max_relative_drop is None or not self.float_metric:
            return f"{drop:+.4f}"
        return f"{drop:+.4f} ({drop / abs(self.float_metric):+.2%})"

    def summary(self) -> str:
        """The line above the table: float metric, direction, budget, and the schemes every trial starts from."""
        relative = "" if self.max_relative_drop is None else f" ({self.max_relative_drop:g}% of the float metric)"
        base = f"; every trial converts with schemes {self.schemes}" if self.schemes else ""
        return (f"float {self.metric} {self.float_metric:.4f} ({'higher' if self.higher_is_better else 'lower'} is "
                f"better), budget: {self.header()[4]} <= {self.max_drop:.4g}{relative}, float latency "
                f"{self.float_latency_ms:.3f} ms{base}")

    def verdict(self) -> str:
        best = self.trials[self.chosen]
        where = "kept float" if self.fallback == "float" else f"on {self.fallback}"
        text = (f"budget met with {len(best.layers)} layer(s) {where}" if best.met_budget else
                "budget NOT met: returning the closest model found")
        return f"{text} (trial {self.chosen})."

    def to_markdown(self) -> str:
        from fxquant.report.markdown import table

        return "\n".join([self.summary(), "", table(self.header(), self.rows()), "", self.verdict()])

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "float_metric": self.float_metric, "max_drop": self.max_drop,
                "max_relative_drop": self.max_relative_drop, "higher_is_better": self.higher_is_better,
                "float_latency_ms": self.float_latency_ms, "fallback": self.fallback, "schemes": dict(self.schemes),
                "chosen": self.chosen, "trials": [trial.to_dict() for trial in self.trials]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "budget_search") -> BudgetTrials:
        """Read a dict of :meth:`to_dict`; ``ArtifactError`` names the offending key."""
        trials = tuple(Trial.from_dict(t, f"{where}.trials[{i}]") for i, t in enumerate(items(data, "trials", where)))
        chosen = read(data, "chosen", int, where)
        if not 0 <= chosen < len(trials):
            raise ArtifactError(f"{where}.chosen: {chosen} is not the index of one of its {len(trials)} trials")
        relative = data.get("max_relative_drop")
        schemes = read(data, "schemes", dict, where) if "schemes" in data else {}
        return cls(number(data, "float_metric", where), number(data, "max_drop", where),
                   number(data, "float_latency_ms", where), trials, chosen, read(data, "fallback", str, where),
                   read(data, "higher_is_better", bool, where),
                   None if relative is None else number(data, "max_relative_drop", where),
                   read(data, "metric", str, where), {str(k): str(v) for k, v in schemes.items()})


def recorded_trials(history: list[dict[str, Any]]) -> BudgetTrials | None:
    """The trials a RUN_DIR's manifest history records with its converted stage (``fxquant convert
    --max-accuracy-drop`` writes them under :data:`HISTORY_KEY`), if its last stage was chosen by a search."""
    last = history[-1] if history else {}
    data = last.get(HISTORY_KEY) if last.get("stage") == "converted" else None
    return None if data is None else BudgetTrials.from_dict(data, f"the manifest's history {HISTORY_KEY}")


def budget_trials(model: nn.Module) -> BudgetTrials | None:
    """The trials of the search that chose ``model`` (a converted model, drop-in or GraphModule), if one did."""
    trials = graph_of(model).meta.get(TRIALS_KEY)
    return trials if isinstance(trials, BudgetTrials) else None
