"""Options: configuration fields that carry their own flag, ``SLOTSERVE_*`` variable and help.

A field of a configuration dataclass made with :func:`option` is declared once, and what the
user meets is derived from it: the flags of ``slotserve serve`` and ``slotserve chat``
(:func:`add_arguments`; vLLM's and SGLang's spellings as the option's aliases), the
environment defaults (``--ctx-size`` ↔ ``SLOTSERVE_CTX_SIZE``; a flag given on the command
line wins), the body of ``POST /models/load``, ``docs/configuration.md``, and the runners'
recipes, which take their options' defaults and bounds from here (:func:`option_values`,
:func:`declared_as`, :func:`check_declared`). The engine's configuration is declared with it,
so this module imports nothing of slotserve's but the leaf ``field_declarations``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from slotserve.field_declarations import field_declarations

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "SLOTSERVE_"
_KEY = "slotserve.option"
_T = TypeVar("_T")
_C = TypeVar("_C", bound="DataclassInstance")


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"{ENV_PREFIX}{name}", default)


def parse_bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


class CacheBudget(NamedTuple):
    """What the prefix cache may keep once no request uses it: tokens, or bytes of KV."""

    tokens: int | None = None
    bytes: int | None = None


def _scaled_bytes(text: str, unit_when_none: str | None) -> int:
    """``"512MiB"`` → 536870912; ``ValueError`` for anything else (a bare number is
    ``unit_when_none``, or refused when that is None)."""
    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("bgikm")
    unit = value[len(number) :] or unit_when_none
    if unit not in _BYTE_UNITS:
        raise ValueError(unit)
    return int(float(number) * _BYTE_UNITS[unit])


def parse_cache_budget(text: str) -> CacheBudget:
    """``"20000"`` → (20000 tokens, None); ``"512MiB"`` → (None, 536870912 bytes)."""
    digits = text.strip().replace(" ", "")
    if digits.isdigit():
        return CacheBudget(tokens=int(digits))
    try:
        return CacheBudget(bytes=_scaled_bytes(text, None))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid budget {text!r}: a token count (20000) or bytes with a unit (512MiB, 2GB)"
        ) from None


def parse_bytes(text: str) -> int:
    """``"2GiB"`` → 2147483648, ``"512MB"`` → 512000000; a plain number is bytes."""
    try:
        return _scaled_bytes(text, "b")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: bytes, with a unit if you like (512MiB, 2GB)"
        ) from None


class _Derived(enum.Enum):
    FROM_FLAG = enum.auto()


FROM_FLAG = _Derived.FROM_FLAG  # an option's variable named after its flag (--ctx-size: CTX_SIZE)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option. ``flag``: the long flag (``--ctx-size``; by default the field's name with
    dashes), or a positional's name (``model``); ``dest``: its name once parsed, which
    ``POST /models/load`` uses too (``ctx_size``); ``env``: its variable's name after
    ``SLOTSERVE_`` (by default the flag's name, ``CTX_SIZE``; None: none);
    ``parse``: how a flag's or a variable's text becomes the value (None: by the field's type);
    ``wire``: the JSON types ``POST /models/load`` takes for an option read by ``parse``, which
    reads their JSON text; ``ge``: the least value ``POST /models/load`` takes;
    ``aliases``: other servers' spellings of the flag with the same meaning (vLLM's
    ``--max-num-seqs`` for ``--slots``), accepted beside it on the command line (a variable
    and a load field keep the option's own name).

    ``name``, ``default`` and ``kind`` (the field's type without None) are the field's:
    :func:`options` fills them in."""

    flag: str
    env: str | None
    help: str
    dest: str
    short: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    wire: Any = None
    ge: float | None = None
    many: bool = False  # a repeated flag that also takes several values at once (nargs "+")
    aliases: tuple[str, ...] = ()
    name: str = ""
    default: Any = None
    kind: Any = str

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    @property
    def repeated(self) -> bool:
        """A ``tuple[X, ...]`` field: the flag may be given again and again."""
        return typing.get_origin(self.kind) is tuple and typing.get_args(self.kind)[-1:] == (...,)

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling the command line takes: the flag, its short form, its aliases."""
        return (self.flag, *([self.short] if self.short else []), *self.aliases)

    @property
    def env_var(self) -> str | None:
        return None if self.env is None else ENV_PREFIX + self.env

    def environ(self) -> str | None:
        """The variable's text, when it is set."""
        return None if self.env_var is None else os.environ.get(self.env_var)

    def read(self, text: str) -> Any:
        """A flag's or a variable's text as the field's value."""
        if self.parse is not None:
            return self.parse(text)
        if self.kind is bool:
            return parse_bool(text)
        if self.kind in (int, float):
            return self.kind(text)
        return text

    def read_json(self, value: Any) -> Any:
        """A ``POST /models/load`` value as the field's value: an option read from text takes
        that text or its JSON value (``"2GiB"`` or ``2147483648``; a speculative config's
        object); a repeated option's list is its tuple; the others are the value."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.dest} must be one of {', '.join(self.choices)}")
        if self.parse is None:
            return tuple(value) if self.repeated and isinstance(value, list) else value
        return self.parse(value if isinstance(value, str) else json.dumps(value))


def option(
    default: _T,
    *,
    help: str,
    flag: str | None = None,
    env: str | _Derived | None = FROM_FLAG,
    dest: str | None = None,
    short: str | None = None,
    metavar: str | None = None,
    choices: Iterable[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    wire: Any = None,
    ge: float | None = None,
    many: bool = False,
    aliases: Iterable[str] = (),
) -> _T:
    """A dataclass field declared as an option (see :class:`Option`)."""
    # Left empty, flag, dest and variable are named by options(), which knows the field's name.
    declared = Option(
        flag or "",
        "" if env is FROM_FLAG else env,
        help,
        dest or "",
        short,
        metavar,
        tuple(choices) if choices is not None else None,
        parse,
        wire,
        ge,
        many,
        tuple(aliases),
    )
    return dataclasses.field(default=default, metadata={_KEY: declared})


def repeated_option(metavar: str, *, help: str) -> tuple[str, ...]:
    """An option of several texts, none by default, given as ``--flag a b`` or ``--flag a
    --flag b``. It has no ``SLOTSERVE_*`` variable: a variable's text would be read as one
    value, not as a list."""
    return option((), many=True, env=None, metavar=metavar, help=help)


def options(cls: type[DataclassInstance]) -> dict[str, Option]:
    """The options of a configuration dataclass, by field name, in declaration order."""
    found: dict[str, Option] = {}
    for field_name, declared in field_declarations(cls, _KEY, Option).items():
        flag = declared.flag or "--" + field_name.replace("_", "-")
        name = flag.lstrip("-").replace("-", "_")
        found[field_name] = dataclasses.replace(
            declared,
            flag=flag,
            dest=declared.dest or name,
            env=name.upper() if declared.env == "" else declared.env,
        )
    return found


def declared_as(cls: type[DataclassInstance], name: str) -> Any:
    """A field declared as ``cls``'s option ``name`` is (its default, flag and bound), for a
    configuration that takes the same setting without being ``cls`` (a runner's recipe takes
    the engine's ``--slots``)."""
    (declared,) = (f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=declared.default, metadata=declared.metadata)


def option_values(config: DataclassInstance, cls: type[DataclassInstance]) -> dict[str, Any]:
    """``config``'s values of ``cls``'s options, by field name (``config`` holds them all:
    it is a ``cls``, or joins it with other options)."""
    return {name: getattr(config, name) for name in options(cls)}


def check_declared(config: DataclassInstance) -> None:
    """``ValueError`` for an option of ``config`` outside its declared bound or choices: for a
    configuration made in code (a runner's recipe), which no flag's parser saw."""
    for opt in options(type(config)).values():
        value = getattr(config, opt.name)
        if value is None:
            continue
        if opt.ge is not None and value < opt.ge:
            raise ValueError(f"{opt.flag} must be >= {opt.ge:g}")
        if opt.choices is not None and value not in opt.choices:
            raise ValueError(f"{opt.flag} must be one of {', '.join(opt.choices)}")


def add_arguments(parser: argparse._ActionsContainer, declared: Iterable[Option]) -> None:
    """The options as flags, each defaulting to its ``SLOTSERVE_*`` variable when that is set
    (argparse reads a text default as it reads the flag), else to the field's default."""
    for opt in declared:
        text = opt.environ()
        default = opt.default if text is None else text
        help_text = opt.help.replace("%", "%%")
        if opt.env_var is not None:
            help_text += f" [{opt.env_var}]"
        if opt.positional:
            parser.add_argument(
                opt.flag, nargs="?", metavar=opt.metavar, default=default, help=help_text
            )
            continue
        flags = opt.flags
        if opt.kind is bool:
            parser.add_argument(
                *flags,
                dest=opt.dest,
                action=argparse.BooleanOptionalAction,
                default=opt.default if text is None else parse_bool(text),
                help=help_text,
            )
        elif opt.repeated:
            # ``many``: "--flag a b" as well as "--flag a --flag b".
            how: dict[str, Any] = {"action": "extend", "nargs": "+"} if opt.many else {}
            parser.add_argument(
                *flags,
                dest=opt.dest,
                metavar=opt.metavar,
                help=help_text,
                **(how or {"action": "append"}),
            )
        else:
            parser.add_argument(
                *flags,
                dest=opt.dest,
                type=_argparse_type(opt),
                choices=opt.choices,
                metavar=opt.metavar,
                default=default,
                help=help_text,
            )


def _argparse_type(opt: Option) -> Callable[[str], Any]:
    if opt.parse is None:
        # argparse names int and float in its own message ("invalid int value: 'x'").
        return opt.kind if opt.kind in (int, float) else opt.read
    parse = opt.parse

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:  # argparse would print only the function's name
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = parse.__name__
    return read


def configure(cls: type[_C], namespace: argparse.Namespace | None = None) -> _C:
    """A configuration: each option from the parsed command line where that has it, else
    from its ``SLOTSERVE_*`` variable when set, else the field's default. A bad value (or an
    invalid combination, the dataclass's own check) raises ``ValueError``."""
    values: dict[str, Any] = {}
    for opt in options(cls).values():
        if namespace is not None and hasattr(namespace, opt.dest):
            value = getattr(namespace, opt.dest)
            values[opt.name] = tuple(value or ()) if opt.repeated else value
            continue
        text = opt.environ()
        if text is not None:
            try:
                values[opt.name] = opt.read(text)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{opt.env_var}: {exc}") from None
    return cls(**values)
