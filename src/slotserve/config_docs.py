"""``python -m slotserve.config_docs > docs/configuration.md``: every option's table, written
from the option declarations (``slotserve.options``), so the page cannot drift from them."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from slotserve.chat.command import local_options
from slotserve.hosting.config import PER_MODEL
from slotserve.options import Option, options
from slotserve.serve_config import ACCEPTED_FLAGS, SERVE_GROUPS

COMMAND = "python -m slotserve.config_docs > docs/configuration.md"

INTRO = f"""\
# Configuration

<!-- Written by `{COMMAND}` from the option declarations; edit those, not this file. -->

Every option of `slotserve serve` is a flag and a `SLOTSERVE_*` environment variable; a flag
given on the command line wins over the variable. The options of each model (engine, runner
and chat) are also fields of the `POST /models/load` body, which loads one more model with its
own values over the server's (`{{"model": "name", "path": "/models/x.gguf", "slots": 2}}`);
there a size may be given in bytes or as text (`"2GiB"`), and `speculative_config` as a JSON
object or as its text."""


def render() -> str:
    parts = [INTRO]
    for title, about, config in SERVE_GROUPS:
        per_model = config in PER_MODEL
        rows = [_row(opt, per_model) for opt in options(config).values()]
        parts.append(f"## `serve`: {title}\n\n{about}\n\n{_table(rows, per_model)}")
    parts.append(_other_servers())
    chat_rows = [_row(opt, False) for opt in local_options()]
    parts.append(
        "## `chat`: the model in-process\n\n"
        "`slotserve chat` without `--url` runs the model in its own process with these of "
        "`serve`'s options; the others keep `serve`'s defaults and variables, but a reply has "
        "no time limit.\n\n"
        f"{_table(chat_rows, False)}"
    )
    return "\n\n".join(parts) + "\n"


def _row(opt: Option, per_model: bool) -> str:
    if opt.positional:
        flag = f"`{opt.metavar or opt.flag.upper()}` (positional)"
    elif opt.kind is bool:
        flag = ", ".join(f"`{f}`, `--no-{f.removeprefix('--')}`" for f in opt.flags)
    else:
        flag = ", ".join(f"`{f}`" for f in opt.flags)
        if opt.repeated:
            flag = f"`{opt.flag} {opt.metavar}` (repeatable)"
    about = opt.help
    if opt.choices is not None:
        about += f"; one of {', '.join(f'`{c}`' for c in opt.choices)}"
    variable = f"`{opt.env_var}`" if opt.env_var else ""
    load = f"`{opt.dest}`" if per_model else None
    return _cells(flag, variable, _default(opt.default), load, about)


def _other_servers() -> str:
    """vLLM's, SGLang's and llama-server's spellings of our options, and their flags that
    change nothing."""
    aliases = [
        f"| `{alias}` | `{opt.flag}` |"
        for _, _, config in SERVE_GROUPS
        for opt in options(config).values()
        for alias in opt.aliases
    ]
    accepted = [f"| `{flag}` | {about} |" for flag, about in ACCEPTED_FLAGS.items()]
    return (
        "## `serve`: command lines from vLLM, SGLang and llama-server\n\n"
        "`serve` takes these spellings of vLLM's, SGLang's and llama-server's flags beside its "
        "own, each meaning what its flag here does (with `--no-` for a switch); the variable "
        "and the `POST /models/load` field keep the name here. A flag is never taken by a "
        "prefix of its name.\n\n"
        "| Their flag | Here |\n|---|---|\n" + "\n".join(aliases) + "\n\n"
        "These flags of theirs are accepted and change nothing: what they turn on is always "
        "on here.\n\n"
        "| Flag | About |\n|---|---|\n" + "\n".join(accepted)
    )


def _cells(flag: str, variable: str, default: str, load: str | None, about: str) -> str:
    about = about.replace("|", "\\|").replace("<", "&lt;")
    cells = [flag, variable, default] + ([load] if load is not None else []) + [about]
    return "| " + " | ".join(cells) + " |"


def _default(value: Any) -> str:
    if value is None or value == ():
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _table(rows: Iterable[str], per_model: bool) -> str:
    head = ["Flag", "Variable", "Default"] + (["Load field"] if per_model else []) + ["About"]
    rule = "|" + "|".join("---" for _ in head) + "|"
    return "\n".join(["| " + " | ".join(head) + " |", rule, *rows])


if __name__ == "__main__":
    sys.stdout.write(render())
