"""Keys fxquant stores in ``fx.Node.meta`` (values are dataclasses, never ad-hoc dicts)."""

LAYER_SETTINGS = "fxquant_layer_settings"
"""On a Linear/Conv node after prepare: the resolved :class:`fxquant.config.LayerSettings` for that layer."""
