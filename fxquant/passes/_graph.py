"""Small graph-edit helpers shared by the passes (the torch.fx 'Writing Transformations' recipe)."""

from __future__ import annotations

from torch import fx, nn


def modules_of(gm: fx.GraphModule) -> dict[str, nn.Module]:
    return dict(gm.named_modules())


def replace_submodule(gm: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` (a dotted module path), keeping the user's module names."""
    parent_path, _, name = path.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, name, new)


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def nodes_of(gm: fx.GraphModule) -> list[fx.Node]:
    """A snapshot of the graph's nodes, safe to iterate while the graph is edited."""
    return list(gm.graph.nodes)


def only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None
