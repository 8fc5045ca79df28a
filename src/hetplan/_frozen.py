"""An immutable, hashable mapping for the fields of frozen dataclasses.

Frozen dataclasses hash their fields; a plain dict field would make them unhashable and
mutable through the back door. `FrozenMap` keeps insertion order, compares equal to a dict with
the same items and prints like one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

# What a file's fields may be, for the dataclasses written to JSON (`hetplan.io.serde`): a field
# the class does not have is a mistake to name, not to drop (pydantic reads this attribute).
FILE_SCHEMA = {"extra": "forbid"}

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V], Generic[K, V]):
    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._data: dict[K, V] = dict(items or {})
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._data)

    def to_dict(self) -> dict[K, V]:
        return dict(self._data)


def freeze(value: Any) -> Any:
    """Turn dicts into FrozenMaps and lists into tuples, recursively (for `meta` fields)."""
    if isinstance(value, Mapping):
        return FrozenMap({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value
