"""Sampling fields: a field of ``SamplingParams`` that carries its own valid range and doc.

A field made with :func:`sampling_field` is declared once, and the rest is derived from it:
``SamplingParams``' validation, the validity of a model's or a flag's default
(``sampling_defaults``), the request models' bounds and descriptions on every API
(``server/sampling_schema.py``), the help of ``--temperature`` and its siblings, and
``docs/sampling.md``. The declaration speaks the engine's vocabulary: nothing here knows an
API's request model, so an API that narrows a range (Anthropic's temperature stops at 1) says so
where its request is declared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, TypeVar

from slotserve.field_declarations import field_declarations

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_KEY = "slotserve.sampling_field"
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class SamplingField:
    """One sampling field. ``ge``/``gt``/``le``/``lt``: the valid range's bounds (None: open
    that side), pydantic's names for them; ``doc``: one line on what the field does;
    ``message``: the text of the error for a value out of range, when the range's own wording
    (``must be between 0 and 2``, ``must be in (0, 1]``) is not the one to show; ``option``:
    the name of the server's option that defaults the field (``repeat_penalty`` for
    ``--repeat-penalty``; None: a request's field only).

    ``name``, ``default`` and ``kind`` (the field's type without None: ``int`` or ``float``)
    are the field's own: :func:`sampling_fields` fills them in."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    message: str | None = None
    option: str | None = None
    name: str = ""
    default: Any = None
    kind: type = float

    @property
    def bounds(self) -> dict[str, float]:
        """The range as pydantic's ``Field`` keyword arguments (``{"gt": 0.0, "le": 1.0}``)."""
        named = {"ge": self.ge, "gt": self.gt, "le": self.le, "lt": self.lt}
        return {k: v for k, v in named.items() if v is not None}

    def accepts(self, value: float) -> bool:
        """Whether ``value`` lies in the range (a NaN or an infinity never does; an int field
        takes only whole numbers, as a model file may write ``40.0`` for ``top_k``)."""
        # An int is compared as it is: a seed may be too large for a float.
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.kind is int and value != int(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    @property
    def range_text(self) -> str:
        """The range in words: ``0 to 2``, ``(0, 1]``, ``>= 1``; empty when unbounded."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if high is None:
            return "" if low is None else f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        if low is None:
            return f"{'<=' if self.le is not None else '<'} {_num(high)}"
        if self.ge is not None and self.le is not None:
            return f"{_num(low)} to {_num(high)}"
        opening = "[" if self.ge is not None else "("
        closing = "]" if self.le is not None else ")"
        return f"{opening}{_num(low)}, {_num(high)}{closing}"

    @property
    def error(self) -> str:
        """What an out-of-range value's error says after the field's name."""
        if self.message is not None:
            return self.message
        text = self.range_text
        if " to " in text:
            return "must be between " + text.replace(" to ", " and ")
        return f"must be {text}" if text[:1] in "<>" else f"must be in {text}"


def _num(value: float) -> str:
    # 2**31 reads better as itself than as 2147483648.0.
    if value == int(value) and abs(value) >= 2**20:
        exponent = int(math.log2(abs(value)))
        if 2**exponent == abs(value):
            return f"{'-' if value < 0 else ''}2**{exponent}"
    return f"{value:g}"


def sampling_field(
    default: _T,
    *,
    doc: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    message: str | None = None,
    option: str | None = None,
) -> _T:
    """A dataclass field declared as a sampling field (see :class:`SamplingField`)."""
    declared = SamplingField(doc, ge, gt, le, lt, message, option)
    return dataclasses.field(default=default, metadata={_KEY: declared})


def sampling_fields(cls: type[DataclassInstance]) -> dict[str, SamplingField]:
    """The sampling fields of a dataclass, by name, in declaration order."""
    return field_declarations(cls, _KEY, SamplingField)
