"""docs/configuration.md from the argparse parsers of every command.

Environment variables are found, not copied from the help text: each parser is built once
with an empty environment (the defaults shown), then once per variable it read with that
variable set to a sentinel; a flag whose default changed takes its default from that
variable. Defaults therefore never show this machine's environment, and strings that
depend on the machine (the checkout's path, the home folder, the host name) are shown
as expressions.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import gateway.__main__ as gateway_main
import worker.__main__ as worker_main
from gateway import cli, client

ROOT = Path(__file__).resolve().parent.parent
SENTINELS = ("0", "docs-sentinel")  # "0" flips the boolean flags, the other every string
ENV_NOTE = re.compile(r"\s*\[env ([A-Z][A-Z0-9_]*)([^\]]*)\]")
Builder = Callable[[], argparse.ArgumentParser]


class RecordingEnviron(dict[str, str]):
    """os.environ stand-in that remembers which variables were asked for."""

    def __init__(self, values: dict[str, str] | None = None) -> None:
        super().__init__(values or {})
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.append(key)
        return super().__contains__(key)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[RecordingEnviron]:
    env = RecordingEnviron(values)
    with mock.patch.object(os, "environ", env):
        yield env


@dataclass(frozen=True)
class Command:
    """A parser to document: its heading, and the flags of its parser (or of a subcommand)."""

    name: str
    build: Builder
    subcommand: str | None = None


COMMANDS = (
    Command("tokenrelay-gateway", gateway_main.build_parser),
    Command("tokenrelay-worker", worker_main.build_parser),
    Command("tokenrelay up", cli.build_parser, "up"),
    Command("tokenrelay demo", cli.build_parser, "demo"),
    Command("tokenrelay bench", cli.build_parser, "bench"),
    Command("tokenrelay-client", client.build_parser),
)


def subparser(parser: argparse.ArgumentParser, name: str | None) -> tuple[argparse.ArgumentParser, str]:
    """The parser of subcommand `name` (or `parser`), and its one-line help."""
    if name is None:
        return parser, parser.description or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return action.choices[name], helps.get(name, "")
    raise KeyError(name)


def documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def defaults(command: Command, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Each flag's default with this environment, and the variables the parser read."""
    with environment(env) as recorded:
        parser, _ = subparser(command.build(), command.subcommand)
    return {a.dest: a.default for a in documented(parser)}, recorded.read


def env_vars(command: Command) -> dict[str, str]:
    """dest -> the environment variable its default comes from."""
    base, read = defaults(command, {})
    found: dict[str, str] = {}
    for name in dict.fromkeys(read):
        for sentinel in SENTINELS:
            changed, _ = defaults(command, {name: sentinel})
            for dest, value in changed.items():
                if value != base[dest]:
                    found.setdefault(dest, name)
    return found


def stable(text: str) -> str:
    """This machine's paths and host name as the expressions they come from."""
    for value, expression in ((str(ROOT), "<checkout>"), (str(Path.home()), "~"),
                              (socket.gethostname(), "<hostname>")):
        if len(value) > 2:
            text = text.replace(value, expression)
    return text


def cell(text: str) -> str:
    """Plain text in a Markdown table cell: no HTML, no emphasis, no column breaks."""
    text = " ".join(text.split())
    for raw, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def code(text: str) -> str:
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def render_default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return "on" if value else "off"
    if value is None:
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return code("inf")
    if isinstance(value, list | tuple):
        return code(" ".join(map(str, value)))
    if isinstance(value, Path):
        value = str(value)
    return code(stable(str(value))) if str(value) else '`""`'


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str]:
    """(help without its [env ...] note, what the note adds to the variable, e.g. '=1')."""
    expanded = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
    note = ENV_NOTE.search(expanded)
    return stable(ENV_NOTE.sub("", expanded)), (note.group(2).strip() if note else "")


def flag_name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    names = [s for s in action.option_strings if not s.startswith("--no-")] or action.option_strings
    name = ", ".join(code(s) for s in names)
    if isinstance(action, argparse.BooleanOptionalAction):
        return f"{name} / {code('--no-' + names[-1][2:])}"
    if action.metavar is not None:  # a named value (RATE, METRIC:MS); choices have their own column
        formatter = argparse.HelpFormatter(parser.prog)
        name += f" {code(formatter._format_args(action, action.dest.upper()))}"
    return name


def env_text(var: str, note: str) -> str:
    """`VAR`, or `VAR=1` and the rest of the help's note ("=0 to disable")."""
    value, _, rest = note.partition(" ")
    if value.startswith("="):
        return code(var + value) + (f" {cell(rest)}" if rest else "")
    return code(var) + (f" {cell(note)}" if note else "")


def env_mismatches() -> list[str]:
    """Flags whose help names another environment variable than the one the code reads."""
    problems = []
    for command in COMMANDS:
        parser, _ = subparser(command.build(), command.subcommand)
        found = env_vars(command)
        for action in documented(parser):
            named = ENV_NOTE.search(action.help or "")
            if named and named.group(1) != found.get(action.dest):
                problems.append(f"{command.name} {action.option_strings[0]}: help says {named.group(1)}, "
                                f"the default reads {found.get(action.dest)}")
    return problems


def render_command(command: Command, env_index: dict[str, list[str]]) -> list[str]:
    with environment({}):
        parser, summary = subparser(command.build(), command.subcommand)
    found = env_vars(command)
    lines = [f"## {command.name}", "", cell(stable(summary)), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in documented(parser)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            lines += [f"### {command.name}: {group.title}", ""]
            if group.description:
                lines += [cell(group.description), ""]
        lines += ["| flag | environment variable | default | choices | meaning |", "|---|---|---|---|---|"]
        for action in actions:
            text, note = help_text(parser, action)
            var = found.get(action.dest)
            if var:
                env_index.setdefault(var, []).append(f"{command.name} {code(action.option_strings[0])}")
            choices = ", ".join(code(str(c)) for c in action.choices) if action.choices else ""
            env_cell = env_text(var, note) if var else ""
            lines.append(f"| {flag_name(parser, action)} | {env_cell} | {render_default(action)} | {choices} "
                         f"| {cell(text)} |")
        lines.append("")
    return lines


def render_configuration() -> str:
    env_index: dict[str, list[str]] = {}
    body: list[str] = []
    for command in COMMANDS:
        body += render_command(command, env_index)
    head = [
        "# Configuration",
        "",
        "After reading this page you can set any flag or environment variable of the gateway, the worker, "
        "the `tokenrelay` launcher and the client, and know what each one defaults to.",
        "",
        "<!-- Generated by `make docs` (docs/gen_config.py) from the commands' argparse parsers: "
        "edit the help text in the code, not this file. -->",
        "",
        "Every process builds one frozen, validated config object from its flags at start-up. A flag "
        "wins over its environment variable; the variable wins over the default shown here (defaults "
        "are shown as they are with no variable set). `--help` on any command prints the same.",
        "",
        "## Environment variables",
        "",
        "| variable | flag |",
        "|---|---|",
    ]
    head += [f"| {code(var)} | {', '.join(flags)} |" for var, flags in sorted(env_index.items())]
    return "\n".join([*head, "", *body]).rstrip("\n") + "\n"
