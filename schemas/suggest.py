"""Suggestions ("did you mean") for names a user typed: activations, templates, template parameters.

ML engineers write names the way their framework spells them (``LeakyReLU``, ``GELU``, ``SiLU``)
or with a typo (``resnett``, ``widht``). The wire names stay fixed (contract: one spelling per
name, so keys and answers never depend on how a request spelled it); errors name the closest one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean"]


def _folded(name: str) -> str:
    """Case, underscores and dashes folded away: ``LeakyReLU``, ``leaky-relu`` -> ``leakyrelu``."""
    return name.lower().replace("_", "").replace("-", "")


def closest(name: object, choices: Iterable[str]) -> str | None:
    """The choice ``name`` most likely meant, or None when none is close.

    A choice equal to ``name`` up to case, underscores and dashes wins (PyTorch's class names
    ``LeakyReLU``, ``SiLU`` against ``leaky_relu``, ``silu``); else the closest spelling by
    difflib's ratio, case folded, so ``resnett`` finds ``resnet`` and ``widht`` finds ``width``; two
    letters swapped find the name however short it is (``tta`` finds ``tat``).
    """
    if not isinstance(name, str) or not name:
        return None
    options = list(choices)
    folded = {_folded(c): c for c in reversed(options)}  # the first spelling of a folded name wins
    if _folded(name) in folded:
        return folded[_folded(name)]
    # two letters swapped ("tta" for "tat"): short names are too short for difflib's ratio to find
    swapped = [c for f, c in folded.items() if len(f) == len(_folded(name)) and sorted(f) == sorted(_folded(name))]
    if len(swapped) == 1 and sum(a != b for a, b in zip(_folded(name), _folded(swapped[0]), strict=True)) == 2:
        return swapped[0]
    match = difflib.get_close_matches(_folded(name), list(folded), n=1, cutoff=0.7)
    return folded[match[0]] if match else None


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    match = closest(name, choices)
    return f"; did you mean '{match}'?" if match is not None and match != name else ""
