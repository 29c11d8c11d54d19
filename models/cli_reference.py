"""The command-line reference (``docs/reference/cli.md``), written from the parser itself.

``make cli-docs`` runs ``python -m models.cli_reference --out docs/reference/cli.md``; a test checks
that every command and option of ``sphereface`` appears in the committed file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from models.cli import build_parser, command_groups

#: Help is formatted at this width whatever the terminal, so the file does not depend on it.
HELP_WIDTH = 100


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's direct subcommands by name (aliases left out), in the order they were added."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub not in found.values():
                    found[name] = sub
    return found


def walk_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command below ``parser`` (depth first), as ``(("evaluate", "lfw"), parser)``."""
    for name, sub in subcommands(parser).items():
        yield (*path, name), sub
        yield from walk_commands(sub, (*path, name))


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The long option names a command takes (``--model``, ...), without ``--help``."""
    return [
        text
        for action in parser._actions
        for text in action.option_strings
        if text.startswith("--") and text != "--help"
    ]


def _help_text(parser: argparse.ArgumentParser) -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def markdown_reference() -> str:
    """Every ``sphereface`` command with its ``--help``, grouped by the package that adds it."""
    parser = build_parser()
    groups = ", ".join(name for name, _ in command_groups())
    lines = [
        "# Command-line reference",
        "",
        "Every `sphereface` command with its `--help`, written from the parser by `make cli-docs`",
        f"(command groups installed when it was written: {groups}). A serving install (the CPU image)",
        "has the service's commands and the models' ones, not training's. Every command also runs as",
        "`python -m models.cli ...` (for example under `torchrun`).",
        "",
        "```text",
        _help_text(parser),
        "```",
    ]
    for path, sub in walk_commands(parser):
        lines += ["", f"{'#' * min(len(path) + 1, 4)} sphereface {' '.join(path)}", "", "```text"]
        lines += [_help_text(sub), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to ``--out`` (default: print it)."""
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    args = cli.parse_args(argv)
    text = markdown_reference()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
