"""The shape of the code: declared layers that only point down, by module and by folder (each
folder of ``rollout/`` stands in one layer), no import cycles, no remote call named by a
string, and no long positional argument lists in the weight-sync package (request types
carry what belongs together)."""

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
            # `from rollout.contracts import net` imports the module rollout.contracts.net.
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
    # The weight sync's services, and its contracts (protocol, net, backend) where they live.
    for path in [*(PACKAGE / "sync").rglob("*.py"), *(PACKAGE / "contracts").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                if len(params) > 5:
                    offenders.append(f"{path.relative_to(SOURCE)}:{node.lineno} {node.name}({', '.join(params)})")
    assert offenders == []


# The layers, lowest first. A module may import its own layer and the ones below it, never
# one above: docs/concepts.md explains each. A pattern ending in ".*" is a
# folder: the package and everything under it; any other pattern is one module. Every module
# must be placed. Where patterns overlap the longest places a module, but a folder still
# stands in one layer (test_no_folder_imports_a_layer_above_its_own), so an overlap only
# lets the folder check name the module that splits its folder.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Types and errors every layer speaks; they import no torch, vLLM or Ray (net's address
    # probes need only the standard library). The folder ``rollout/contracts/`` holds those
    # of the weight sync (its protocol, addresses and ports, the backend contract and
    # registry) and of the engine (its load, its weight versions).
    (
        "contracts",
        (
            "rollout", "rollout.errors", "rollout.wire_errors", "rollout.processes", "rollout.api", "rollout.logs", "rollout.episodes", "rollout.batching",
            "rollout.stats_summary", "rollout.readme_section", "rollout.contracts.*",
        ),
    ),
    # Functions requests name (rewards, tools): config checks names against them.
    ("plug-ins", ("rollout.rewards.*", "rollout.tools.*")),
    # The one source of configuration truth.
    ("config", ("rollout.config",)),
    # What runs beside the engine: the weight sync (coordinator, agent, publisher, backends),
    # routing, scaling signals, metrics; and how the supported vLLM versions differ (vllm_compat).
    ("services", ("rollout.sync.*", "rollout.routing.*", "rollout.scaling", "rollout.metrics", "rollout.coalesced_stats", "rollout.kube", "rollout.vllm_compat")),
    # The engine replica: composes the vLLM engine, admission, the sync agent, episodes.
    ("engine", ("rollout.engine.*",)),
    # The ways in: the HTTP ingress and the Python clients.
    ("edges", ("rollout.http.*", "rollout.client.*")),
    # The application: what `rollout serve` deploys.
    ("app", ("rollout.app", "rollout.local")),
    # Entry points and tooling built on the application.
    (
        "entry",
        (
            "rollout.cli", "rollout.bench.*", "rollout.soak.*", "rollout.demo.*", "rollout.status",
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
                matches = module == pattern[:-2] or module.startswith(pattern[:-1])
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


def unit_of(module: str, names: set[str], root: str = "rollout") -> str:
    """The unit ``module`` stands in: the folder directly under ``root`` that holds it, or
    the module itself where it lies directly in ``root`` (or is ``root``)."""
    parts = module.split(".")
    if parts[0] != root or len(parts) == 1:
        return module
    top = f"{root}.{parts[1]}"
    return top if any(n.startswith(f"{top}.") for n in names) else module


def folder_layers(names: set[str], layers=LAYERS, root: str = "rollout") -> dict[str, list[str]]:
    """Each folder's layers, from its modules' (each folder should have exactly one)."""
    found: dict[str, set[int]] = {}
    for name in names - {root}:
        unit, layer = unit_of(name, names, root), layer_of(name, layers)
        if unit != name or any(n.startswith(f"{name}.") for n in names):
            found.setdefault(unit, set())
            if layer is not None:
                found[unit].add(layer)
    return {unit: [layers[i][0] for i in sorted(held)] for unit, held in sorted(found.items())}


def upward_folder_imports(graph: dict[str, set[str]], layers=LAYERS, root: str = "rollout") -> list[str]:
    names = set(graph)
    lowest: dict[str, int] = {}
    highest: dict[str, int] = {}
    for name in names:
        layer = layer_of(name, layers)
        if layer is not None:
            unit = unit_of(name, names, root)
            lowest[unit] = min(lowest.get(unit, layer), layer)
            highest[unit] = max(highest.get(unit, layer), layer)
    found = set()
    for name, targets in graph.items():
        mine = unit_of(name, names, root)
        for target in targets:
            theirs = unit_of(target, names, root)
            if mine != theirs and mine in lowest and theirs in highest and highest[theirs] > lowest[mine]:
                found.add(f"{mine} ({layers[lowest[mine]][0]}) imports {theirs} ({layers[highest[theirs]][0]})")
    return sorted(found)


def test_every_folder_stands_in_exactly_one_layer():
    layers = folder_layers(set(modules()))
    assert {unit: held for unit, held in layers.items() if len(held) != 1} == {}
    # The folders are the ones on disk (a check of none would pass).
    assert set(layers) == {f"rollout.{p.name}" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_no_folder_imports_a_layer_above_its_own():
    """The layers as the tree shows them. A reader of ``rollout/`` sees its folders and its
    top-level modules, so those are the units: each folder directly under ``rollout/``, with
    everything beneath it (``sync/`` holds ``sync/backends/``), is one unit; each module
    directly in ``rollout/`` (and the package's ``__init__``) is a unit of its own, placed by
    its own LAYERS entry (top-level modules are not grouped). A folder stands in exactly one
    layer (test_every_folder_stands_in_exactly_one_layer), so where a file stands tells a
    contract from a service: a contract that a lower layer needs lives in a folder of that
    layer (``rollout/contracts/``), not beside the services that implement it.

    Read as units, no import runs up a layer. An imported unit stands at the highest layer
    of its modules (importing any file of a folder depends on the folder), an importing one
    at the lowest, so a folder split across layers shows up both ways."""
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    assert upward_folder_imports(graph) == []


def test_the_folder_check_finds_a_contract_kept_beside_its_services():
    # What the module check lets pass: a low module imports a contract kept in a folder with
    # the services above it, and those services import a unit above the contract's layer.
    layers = [("low", ("r", "r.a", "r.pkg.contract")), ("high", ("r.b", "r.pkg.*"))]
    graph = {"r": set(), "r.a": {"r.pkg.contract"}, "r.b": {"r.a"}, "r.pkg": set(), "r.pkg.contract": set(), "r.pkg.service": {"r.pkg.contract", "r.b"}}
    assert upward_imports(graph, layers) == []
    assert folder_layers(set(graph), layers, root="r") == {"r.pkg": ["low", "high"]}
    assert upward_folder_imports(graph, layers, root="r") == ["r.a (low) imports r.pkg (high)", "r.pkg (low) imports r.b (high)"]


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
