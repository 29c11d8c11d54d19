"""The house rules, checked on the source: which package may import which, no import cycles,
modules and functions of a readable size, and one command line that lists every command."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGES = ("models", "training", "service", "bench", "tests")
#: (importer, imported): the imports the layering forbids. models/ is shared by training and serving;
#: the service never needs training code; benchmarks stand alone from the test suite.
FORBIDDEN = {
    ("models", "training"),
    ("models", "service"),
    ("models", "bench"),
    ("service", "training"),
    ("service", "bench"),
    ("training", "service"),
    ("training", "bench"),
    ("bench", "tests"),
}
SIZE_CHECKED = ("models", "training", "service")
MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 80


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the project's packages."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every name an ``import`` in the file asks for, at any depth (lazy imports inside functions
    count too), with its line; relative imports made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}, resolved to the longest known module name."""
    files = module_files(root)

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for name, line in imported_names(path, module):
            target = resolve(name)
            if target is not None and target != module and not module.startswith(target + "."):
                edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def layering_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{module} (line {line}) imports {target}"
        for module, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if (module.split(".")[0], target.split(".")[0]) in FORBIDDEN
    ]


def torch_importers(root: Path, package: str) -> list[str]:
    files = module_files(root, (package,))
    return [
        f"{module} (line {line})"
        for module, path in files.items()
        for name, line in imported_names(path, module)
        if name == "torch" or name.startswith("torch.")
    ]


def long_functions(root: Path) -> list[str]:
    found = []
    for module, path in module_files(root, SIZE_CHECKED).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{module}.{node.name}: {lines} lines")
    return found


def test_layers_import_only_downwards():
    assert layering_violations(import_graph(REPO_ROOT)) == []


def test_service_and_models_package_never_import_torch_at_serving_time():
    # models/nets and the importers build networks in PyTorch for training and export only; the
    # service (what the serving image runs) never loads it.
    assert torch_importers(REPO_ROOT, "service") == []


def test_there_are_no_import_cycles():
    assert import_cycles(import_graph(REPO_ROOT)) == []


def test_modules_fit_in_a_thousand_lines():
    too_long = [
        f"{module}: {n} lines"
        for module, path in module_files(REPO_ROOT, SIZE_CHECKED).items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert too_long == []


def test_functions_fit_in_eighty_lines():
    assert long_functions(REPO_ROOT) == []


def test_the_checks_find_what_they_look_for(tmp_path: Path):
    """The checkers above on a small made-up tree: a layering breach, a cycle through a lazy import,
    a torch import and a long function are all reported."""
    (tmp_path / "service").mkdir()
    (tmp_path / "training").mkdir()
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / "service" / "__init__.py").write_text("")
    (tmp_path / "service" / "a.py").write_text("def f():\n    from training.b import g\n    import torch\n")
    (tmp_path / "training" / "__init__.py").write_text("")
    (tmp_path / "training" / "b.py").write_text("from . import c\n")
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "training" / "c.py").write_text(f"def long():\n{body}\ndef g():\n    from .b import c\n")
    graph = import_graph(tmp_path)
    assert layering_violations(graph) == ["service.a (line 2) imports training.b"]
    assert import_cycles(graph) == [["training.b", "training.c"]]
    assert torch_importers(tmp_path, "service") == ["service.a (line 3)"]
    assert long_functions(tmp_path) == [f"training.c.long: {MAX_FUNCTION_LINES + 1} lines"]


# -- one command line --------------------------------------------------------------------------

USER_COMMANDS = {
    "import", "quantize", "models",
    "prepare", "train", "export", "combine", "evaluate", "calibrate", "report",
    "serve", "keys", "gallery", "watch",
}  # fmt: skip


def test_sphereface_help_lists_every_command_of_every_package(capsys: pytest.CaptureFixture[str]):
    from models.cli import command_groups, main

    assert [name for name, _ in command_groups()] == ["models", "training", "service"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    listed = set(re.findall(r"^    (\S+)", capsys.readouterr().out, re.MULTILINE))
    assert listed == USER_COMMANDS


def test_the_cli_reference_names_every_command_and_option():
    from models.cli import build_parser
    from models.cli_reference import option_strings, walk_commands

    reference = (REPO_ROOT / "docs" / "reference" / "cli.md").read_text()
    missing = []
    for path, parser in walk_commands(build_parser()):
        heading = f" sphereface {' '.join(path)}\n"
        if heading not in reference:
            missing.append(" ".join(path))
            continue
        section = reference.split(heading, 1)[1].split("\n#", 1)[0]
        missing += [f"{' '.join(path)} {opt}" for opt in option_strings(parser) if opt not in section]
    assert missing == [], "run `make cli-docs`"


def test_a_package_that_is_not_installed_adds_no_commands(monkeypatch: pytest.MonkeyPatch):
    """The serving image has no training/: its entry point fails to import, and the dispatcher
    leaves it out instead of failing."""
    from importlib.metadata import EntryPoint

    import models.cli

    entries = [
        EntryPoint("service", "service.commands:register", models.cli.COMMANDS_GROUP),
        EntryPoint("absent", "no_such_package_here.commands:register", models.cli.COMMANDS_GROUP),
    ]
    monkeypatch.setattr(models.cli, "entry_points", lambda group: entries)
    assert [name for name, _ in models.cli.command_groups()] == ["service"]
    assert "serve" in models.cli.build_parser().format_help()


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "--data-dir", "D", "create", "--scope", "read"],
        ["keys", "create", "--scope", "read", "--data-dir", "D"],
        ["-v", "gallery", "--data-dir", "D", "models"],
        ["gallery", "models", "--data-dir", "D", "-v"],
    ],
)
def test_options_work_before_or_after_the_subcommand(argv: list[str]):
    from models.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.data_dir == "D"
    assert args.verbose is ("-v" in argv)


def test_an_option_given_before_the_subcommand_is_kept_when_none_follows():
    from models.cli import build_parser

    assert build_parser().parse_args(["keys", "--data-dir", "D", "list"]).data_dir == "D"
    assert build_parser().parse_args(["keys", "list"]).data_dir is None


def test_a_command_whose_package_is_missing_says_which_and_how_to_get_it(monkeypatch, capsys):
    """The serving image lists `import`, which needs torch: it answers with the package to install
    instead of a traceback."""
    import models.commands
    from models.cli import main

    def needs_torch(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(models.commands, "_run_import_mtcnn", needs_torch)
    assert main(["import", "mtcnn", "weights.whl"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error [missing_dependency]: `sphereface import` needs the Python package")
    assert "'torch'" in error
    assert "sphereface[train]" in error
