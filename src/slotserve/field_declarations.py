"""Declarations carried by dataclass fields: what an option (``options.py``) or a sampling field
(``engine/sampling_fields.py``) says of itself, kept in its field's metadata and read back with
the field's own name, default and type. Imports nothing of slotserve's: both are declared with
it, the engine's configuration included."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A declaration: a dataclass with ``name``, ``default`` and ``kind`` fields, left for its field.
_D = TypeVar("_D", bound="DataclassInstance")


def field_declarations(
    cls: type[DataclassInstance], key: str, declaration: type[_D]
) -> dict[str, _D]:
    """The ``declaration`` each field of ``cls`` carries under ``key`` in its metadata, by field
    name, in declaration order, with the field's name, default and kind (its type without None)
    filled in."""
    hints = typing.get_type_hints(cls)
    found: dict[str, _D] = {}
    for field in dataclasses.fields(cls):
        declared = field.metadata.get(key)
        if isinstance(declared, declaration):
            found[field.name] = dataclasses.replace(
                declared,
                name=field.name,
                default=field.default,
                kind=_without_none(hints[field.name]),
            )
    return found


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    kinds = [k for k in typing.get_args(hint) if k is not type(None)]
    return kinds[0] if len(kinds) == 1 else typing.Union[tuple(kinds)]  # noqa: UP007
