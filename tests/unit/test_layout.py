"""The repository's shape: which package may import which, and where tests live.

Read from the source with `ast`, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

from tests.support import ROOT
from tests.support.lanes import BESIDE_THE_SERVERS

# import name -> folder (pyproject's package-dir)
PACKAGES = {"batchpilot_server": "server", "batchpilot_operator": "operator",
            "batchpilot_tools": "tools"}  # fmt: skip
# what each package may import of the others
ALLOWED = {
    "batchpilot_server": set(),
    "batchpilot_operator": {"batchpilot_server"},
    "batchpilot_tools": {"batchpilot_server", "batchpilot_operator"},
}
TEST_FOLDERS = ("unit", "integration", "e2e")
# server/ in layers, lowest first: a module imports only its own layer and those below,
# so the engine never reaches the HTTP side and only the process wires the two. The
# engine and the HTTP side are the packages server/engine/ and server/http/ (models, KV
# cache, schedulers, the step loop, sampling and the grammar state it masks; the aiohttp
# app and its parts, the wire models, parsing, grammar compiling, answers, metrics).
SERVER_LAYERS = ("shared", "engine", "http", "process")
SERVER_PACKAGES = ("engine", "http")
# the layer of each module at server/'s top
TOP_LEVEL_LAYER = {
    # what both sides speak: the engine's interface, configs, the tokenizer
    **dict.fromkeys(("batching_config", "chat_template", "engine_api", "metric_names",
                     "model_presets", "tokenizer"), "shared"),
    # the `batchpilot` CLI: builds the engine and the app and runs them
    **dict.fromkeys(("admin_token", "cli", "cpu_quota", "serve", "serve_options"), "process"),
}  # fmt: skip


def imported(path: Path, runtime_only: bool = False) -> Iterator[str]:
    """Every absolute module name `path` imports; `runtime_only`: not those under `if
    TYPE_CHECKING:`, which a type checker reads and the interpreter never runs."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for child in node.body
        for inner in ast.walk(child)
    }
    for node in ast.walk(tree):
        if runtime_only and id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            # `from package import module` imports the module too
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def modules(package: str) -> dict[str, Path]:
    """Module name -> file for every module of `package`."""
    folder = ROOT / PACKAGES[package]
    found = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def test_each_package_imports_only_the_packages_below_it() -> None:
    crossings = {
        f"{name} imports {target}"
        for package, allowed in ALLOWED.items()
        for name, path in modules(package).items()
        for target in imported(path)
        if (top := target.split(".")[0]) in PACKAGES and top != package and top not in allowed
    }
    assert not crossings


def server_layer(module: str) -> str | None:
    """The layer of a batchpilot_server module, or of a name inside one; None: the package."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    return parts[0] if parts[0] in SERVER_PACKAGES else TOP_LEVEL_LAYER.get(parts[0])


def test_every_module_at_the_server_top_has_a_layer() -> None:
    top = {path.stem for path in (ROOT / "server").glob("*.py")} - {"__init__"}
    assert top == set(TOP_LEVEL_LAYER)
    assert all((ROOT / "server" / package / "__init__.py").is_file() for package in SERVER_PACKAGES)


def test_each_server_layer_imports_only_its_own_and_the_layers_below() -> None:
    rank = {layer: i for i, layer in enumerate(SERVER_LAYERS)}
    upward = {
        f"{name} ({layer}) imports {target} ({target_layer})"
        for name, path in modules("batchpilot_server").items()
        if (layer := server_layer(name)) is not None
        for target in imported(path)
        if target.split(".")[0] == "batchpilot_server"
        and (target_layer := server_layer(target)) is not None
        and rank[target_layer] > rank[layer]
    }
    assert not upward


def test_the_server_modules_the_operator_imports_never_reach_torch() -> None:
    server = modules("batchpilot_server")
    pending = [
        target
        for path in modules("batchpilot_operator").values()
        for target in imported(path)
        if target in server
    ]
    assert pending, "the operator imports nothing of the server: this test checks nothing"
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        # a type-only import of torch (sequence.py's annotations) loads nothing
        targets = set(imported(server[name], runtime_only=True))
        assert "torch" not in {t.split(".")[0] for t in targets}, f"{name} imports torch"
        pending += [t for t in targets if t in server]


def test_the_tuning_rule_imports_nothing_that_imports_it() -> None:
    # operator/policy/ is the whole rule, pure: what it takes from the rest of the operator
    # (the Signals and Slo types) must not lead back into it, directly or through others.
    operator = modules("batchpilot_operator")
    rule = {name for name in operator if name.startswith("batchpilot_operator.policy")}
    outside = {
        target for name in rule for target in imported(operator[name])
        if target in operator and target not in rule
    }  # fmt: skip
    assert outside, "the rule imports nothing of the operator: this test checks nothing"
    pending, seen = list(outside), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        targets = {t for t in imported(operator[name]) if t in operator}
        assert not targets & rule, f"{name} is imported by the rule and imports it back"
        pending += targets


def progress_writes(path: Path) -> Iterator[str]:
    """Each assignment in `path` to a sequence's progress: `num_computed`, or a
    `status` set to a `Status` (other objects' `status`, an HTTP code, is not)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            sets_status = (
                target.attr == "status"
                and isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id == "Status"
            )
            if target.attr == "num_computed" or sets_status:
                yield f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"


def test_only_the_sequence_writes_its_progress() -> None:
    """`Sequence`'s transitions (admit, advance, preempt, finish) are the one writer of
    its status and `num_computed`: the schedulers, the step plan, the simulator and the
    tests call them rather than copy the bookkeeping (issue 42)."""
    owner = ROOT / "server" / "engine" / "sequence.py"
    writes = [
        write
        for folder in ("server", "tools", "tests", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != owner
        for write in progress_writes(path)
    ]
    assert not writes


def test_every_test_file_lives_in_a_test_folder() -> None:
    tests = ROOT / "tests"
    misplaced = [
        path.relative_to(tests).as_posix()
        for path in tests.rglob("test_*.py")
        if path.relative_to(tests).parts[0] not in TEST_FOLDERS
    ]
    assert not misplaced


def test_tests_import_shared_helpers_from_tests_support_only() -> None:
    tests = ROOT / "tests"
    helpers = {path.stem for path in (tests / "support").glob("*.py")} - {"__init__"}
    stray = {
        f"{path.relative_to(tests).as_posix()}: {target}"
        for path in tests.rglob("*.py")
        for target in imported(path)
        if target.split(".")[0] in helpers
        or target.split(".")[0].startswith("test_")  # another test module: order-dependent
        or (target.split(".")[0] == "tests" and not target.startswith("tests.support"))
    }
    assert not stray


def test_every_test_the_side_lane_names_exists() -> None:
    """A renamed module or test would drop back into the main lane without a word."""
    integration = ROOT / "tests" / "integration"
    missing = []
    for entry in sorted(BESIDE_THE_SERVERS):
        module, _, function = entry.partition("::")
        path = integration / module
        if not path.exists() or (function and function not in defined_functions(path)):
            missing.append(entry)
    assert not missing


def defined_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_every_package_folder_is_installed() -> None:
    """A sub-package pyproject does not list is missing from a wheel (the editable
    install of development finds it anyway, so only a fresh install would show it)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for package, folder in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *parts))
            assert name in listed, f"{name} ({init.parent}) is not in pyproject's packages"
