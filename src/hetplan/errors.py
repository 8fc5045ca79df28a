"""Errors a user can fix.

Every error that comes from bad input is a `HetplanError`: its message is one line that names
the file, the item and what is allowed. The CLI prints it and exits with status 2, never with a
traceback. Anything else that escapes is a bug in hetplan and keeps its traceback.

`HetplanError` subclasses `ValueError` so that pydantic, which validates the JSON files, wraps
the checks done in the dataclasses' `__post_init__` together with the location of the item.
"""

from __future__ import annotations


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
