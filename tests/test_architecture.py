"""The shape of the code: declared layers that only point down, no import cycles, no remote
call named by a string, and no long positional argument lists in the weight-sync package
(request types carry what belongs together)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "platform"
PACKAGE = SOURCE / "rollout"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from rollout.sync import net` imports the module rollout.contracts.net.
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return {m for m in found if m in known}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_project_has_no_import_cycle():
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_in_the_sync_package_takes_more_than_five_positional_parameters():
    offenders = []
    for path in (PACKAGE / "sync").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                if len(params) > 5:
                    offenders.append(f"{path.relative_to(SOURCE)}:{node.lineno} {node.name}({', '.join(params)})")
    assert offenders == []


# The layers, lowest first. A module may import its own layer and the ones below it, never
# one above: the README's "How it is built" explains each. A pattern ending in ".*" holds a
# package's modules; the longest pattern that matches a module places it, so a package can
# keep its torch-free contract (``rollout.contracts.sync_protocol``) below config while its services
# (``rollout.sync.coordinator``) sit above it. Every module must be placed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Types and errors every layer speaks; no I/O, no torch, no Ray.
    (
        "contracts",
        (
            "rollout", "rollout.errors", "rollout.wire_errors", "rollout.processes", "rollout.api", "rollout.logs", "rollout.episodes", "rollout.batching",
            "rollout.stats_summary", "rollout.readme_section", "rollout.engine", "rollout.contracts.load", "rollout.contracts.sync_protocol",
            "rollout.contracts.version", "rollout.contracts.net", "rollout.sync.backends", "rollout.contracts.backend",
        ),
    ),
    # Functions requests name (rewards, tools): config checks names against them.
    ("plug-ins", ("rollout.rewards", "rollout.rewards.*", "rollout.tools", "rollout.tools.*")),
    # The one source of configuration truth.
    ("config", ("rollout.config",)),
    # What runs beside the engine: the weight sync (coordinator, agent, publisher, backends),
    # routing, scaling signals, metrics.
    (
        "services",
        ("rollout.sync", "rollout.sync.*", "rollout.routing", "rollout.routing.*", "rollout.scaling", "rollout.metrics", "rollout.coalesced_stats", "rollout.kube"),
    ),
    # The engine replica: composes the vLLM engine, admission, the sync agent, episodes.
    ("engine", ("rollout.engine.*",)),
    # The ways in: the HTTP ingress and the Python clients.
    ("edges", ("rollout.http", "rollout.http.*", "rollout.client", "rollout.client.*")),
    # The application: what `rollout serve` deploys.
    ("app", ("rollout.app", "rollout.local")),
    # Entry points and tooling built on the application.
    (
        "entry",
        (
            "rollout.cli", "rollout.bench", "rollout.bench.*", "rollout.soak", "rollout.soak.*", "rollout.demo", "rollout.demo.*", "rollout.status",
            "rollout.gpu_report", "rollout.helm_schema", "rollout.config_docs", "rollout.monitoring", "rollout.modelbuild",
        ),
    ),
]


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index of ``module``'s layer (the longest matching pattern wins), None when unplaced."""
    best: tuple[int, int] | None = None  # (pattern length, layer)
    for i, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if pattern.endswith(".*"):
                matches = module.startswith(pattern[:-1])
            else:
                matches = module == pattern
            if matches and (best is None or len(pattern) > best[0]):
                best = (len(pattern), i)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    found = []
    for name in sorted(graph):
        mine = layer_of(name, layers)
        for target in sorted(graph[name]):
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{name} ({layers[mine][0]}) imports {target} ({layers[theirs][0]})")
    return found


def test_every_module_has_a_layer():
    assert sorted(m for m in modules() if layer_of(m) is None) == []


def test_no_module_imports_a_layer_above_its_own():
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    layers = [("low", ("a", "pkg.contract")), ("high", ("b", "pkg.*"))]
    graph = {"a": {"b"}, "b": {"a"}, "pkg.contract": set(), "pkg.service": {"pkg.contract", "a"}}
    assert upward_imports(graph, layers) == ["a (low) imports b (high)"]


def string_named_remote_calls(source: str) -> list[int]:
    """Lines that call a Ray/Serve method named at run time: ``getattr(x, name).remote(...)``
    or ``x.remote("name", ...)``. Remote calls go through typed clients, whose methods a
    checker and a reader can follow."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"):
            continue
        target = node.func.value
        by_getattr = isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "getattr"
        by_string = bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
        if by_getattr or by_string:
            found.append(node.lineno)
    return found


def test_no_remote_call_is_named_by_a_string():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        offenders += [f"{path.relative_to(SOURCE)}:{line}" for line in string_named_remote_calls(path.read_text())]
    assert offenders == []


def test_the_remote_call_check_finds_string_named_calls():
    source = "getattr(h, method).remote(1)\nh.remote('status')\nh.status.remote()\nray.remote(Cls)\n"
    assert string_named_remote_calls(source) == [1, 2]
