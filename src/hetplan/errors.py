"""Errors a user can fix.

Every error that comes from bad input is a `HetplanError`: its message is one line that names
the file, the item and what is allowed. The CLI prints it and exits with status 2, never with a
traceback. Anything else that escapes is a bug in hetplan and keeps its traceback.

`HetplanError` subclasses `ValueError` so that pydantic, which validates the JSON files, wraps
the checks done in the dataclasses' `__post_init__` together with the location of the item.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable


class HetplanError(ValueError):
    """Bad input: the message tells the user what is wrong and what to do."""


class GraphError(HetplanError):
    """A graph that is not a valid DAG of nodes with finite, non-negative numbers."""


class ClusterError(HetplanError):
    """A cluster description that names unknown types, bad units or duplicate devices."""


class PlanError(HetplanError):
    """A plan that does not cover the graph, breaks convexity or order, or names unknown devices."""


class InputError(HetplanError):
    """A file that is missing, unreadable or malformed."""


class InfeasibleError(HetplanError):
    """A problem with no valid answer: the model fits nowhere, a floor cannot be met."""


# Bounds on how much of a value an error message quotes: a message is one line, and the value may
# be a megabyte of text or a YAML alias bomb whose full repr would take hours to build.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 3
_SHOWN.maxlevel = 2


def shown(value: object) -> str:
    """A short repr of a user's value for an error message (`reprlib`, cut at about 60 characters)."""
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an int with more digits than Python converts to text
        return f"a {type(value).__name__} too long to show"


def listing(names: Iterable[object], limit: int = 8) -> str:
    """`a, b, c` for a message; past `limit` names, the first ones and how many there are in all."""
    names = [str(n) for n in names]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])}, ... ({len(names)} in all)"


def first_line(exc: BaseException) -> str:
    """An exception's first line, at most 200 characters (its type's name when it says nothing):
    what a one-line error quotes of a failure in code hetplan does not own."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
