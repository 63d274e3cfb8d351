"""Reading and replacing leaves of a params tree (nested mappings: Flax or Haiku style) without
modifying it; shared by ``apply_to_params`` (``sigprop.client.jax``) and its calibration
(``calibration``)."""

from __future__ import annotations

from collections.abc import Mapping

_MISSING = object()


def _get(tree, path: tuple):
    node = tree
    for k in path:
        if not isinstance(node, Mapping) or k not in node:
            return _MISSING
        node = node[k]
    return node


def _rebuild(node: Mapping, items: dict):
    """A mapping like ``node`` (same type where it can be built from a dict) holding ``items``."""
    if type(node) is dict:
        return items
    try:
        return type(node)(items)
    except Exception:  # noqa: BLE001 - a Mapping type that cannot be built from a dict: fall back to dict
        return items


def _set(tree, path: tuple, value):
    """A new tree equal to ``tree`` with the leaf at ``path`` replaced; ``tree`` is not modified
    (only the mappings along ``path`` are copied, everything else is shared)."""
    if not path:
        return value
    items = dict(tree)
    items[path[0]] = _set(tree[path[0]], path[1:], value)
    return _rebuild(tree, items)
