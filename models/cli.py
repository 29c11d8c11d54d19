"""The ``sphereface`` command line: a thin dispatcher over the installed packages' commands.

Each package registers its own subcommands through the entry-point group ``sphereface.commands``
(``pyproject.toml``): ``models.commands`` (import, quantize, models), ``training.commands`` (prepare,
train, export, combine, evaluate, calibrate, report) and ``service.commands`` (serve, keys, gallery).
A package that is not installed (the serving image has no ``training/``) simply adds no commands.
Each subcommand imports what it needs only when it runs, so ``sphereface serve`` never loads torch
and ``sphereface --help`` is instant. Also runs as ``python -m models.cli`` (e.g. under torchrun).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points

from models.errors import SphereFaceError

#: The entry-point group each package's ``register(subparsers)`` function is listed under.
COMMANDS_GROUP = "sphereface.commands"

Register = Callable[[argparse._SubParsersAction], None]


class UsageError(SphereFaceError):
    """Options that do not go together, or a value argparse cannot check on its own."""

    code = "invalid_arguments"


def _load_register(entry: EntryPoint) -> Register | None:
    """The package's ``register`` function, or None when the package is not installed."""
    try:
        return entry.load()
    except ModuleNotFoundError as exc:
        package = entry.value.split(":")[0].split(".")[0]
        if exc.name is not None and (exc.name == package or exc.name.startswith(package + ".")):
            return None
        raise


def command_groups() -> list[tuple[str, Register]]:
    """``(name, register)`` of every installed command group, in a stable order (models first)."""
    order = {"models": 0, "training": 1, "service": 2}
    groups = []
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: (order.get(e.name, 9), e.name)):
        register = _load_register(entry)
        if register is not None:
            groups.append((entry.name, register))
    return groups


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [
        sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for sub in dict.fromkeys(action.choices.values())
    ]


def share_options_with_subcommands(parser: argparse.ArgumentParser) -> None:
    """Let every option of a command also be given after its subcommands: ``sphereface keys
    --data-dir D create`` and ``sphereface keys create --data-dir D`` mean the same. The copies
    default to ``SUPPRESS``, so a value given before the subcommand is kept when none comes after."""
    for sub in _subparsers(parser):
        taken = {text for action in sub._actions for text in action.option_strings}
        for action in parser._actions:
            if not action.option_strings or taken.intersection(action.option_strings):
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            shared = copy.copy(action)
            shared.default = argparse.SUPPRESS
            sub._add_action(shared)
        share_options_with_subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``sphereface`` parser, from every installed command group."""
    parser = argparse.ArgumentParser(
        prog="sphereface",
        description="SphereFace / SphereFace+ face recognition: prepare, train, export, evaluate, serve.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for _, register in command_groups():
        register(sub)
    share_options_with_subcommands(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. Domain errors print ``error [code]: message`` and exit 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except SphereFaceError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error [file_not_found]: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # e.g. `sphereface import dlib` in the serving image, which has no torch
        print(
            f"error [missing_dependency]: `sphereface {args.command}` needs the Python package "
            f"{exc.name!r}, which this install does not have (the 'train' extra has what training, "
            "export and import need: pip install 'sphereface[train]')",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
