"""Layering (docs/design.md section 2: layers import only downward) and no import cycles inside `hcp`.

Each package of `hcp` belongs to one layer and imports only itself and the layers above it; a new
package must be placed in `LAYERS` (the test fails until it is). `hcp/entry.py`, the program's entry,
sits below every layer (it may import any). No two modules import each other,
directly or through others, counting imports inside functions too (a late import that hides a cycle
is still a cycle).
"""
import ast
import pathlib
import re

LAYERS = ["config", "parallel", "comm", "model", "data", "schedule", "dcp", "plan", "launch", "train", "preflight"]
PKG = pathlib.Path(__file__).resolve().parents[1] / "hcp"


def _imports(path):
    """Modules `path` imports: `from a.b import c` yields `a.b.c` (a module or a name in a.b)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = ("hcp",) + path.relative_to(PKG).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def test_every_package_has_a_layer():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} - {"conf"}
    assert packages <= set(LAYERS), f"place {sorted(packages - set(LAYERS))} in LAYERS"


def test_layers_import_only_downward():
    wrong = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        if len(rel) < 2 or rel[0] not in LAYERS:
            continue
        own = LAYERS.index(rel[0])
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "hcp" and len(parts) > 1 and parts[1] in LAYERS and LAYERS.index(parts[1]) > own:
                wrong.append(f"{'/'.join(rel)} imports {mod}")
    assert not wrong, wrong


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_import_cycle_finder_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for name in _imports(path):
            target = name if name in mods else name.rpartition(".")[0]
            if target in mods and target != m:
                graph[m].add(target)
    assert import_cycles(graph) == []


MODULE_LOOKUP = re.compile(r"\bmodule_cfg\b|\bcfg\.(encoders|projectors)\b|[\"'](encoders|projectors)[\"']")


def test_module_blocks_are_read_in_config_only():
    """Outside hcp/config no code looks a module's block up by name (`module_cfg`, the
    `encoders` / `projectors` groups of cfg): the layers take `hcp.config.specs.ModuleSpecs`,
    resolved once from the validated config."""
    found = sorted(f"{path.relative_to(PKG)}:{n}" for path in PKG.rglob("*.py")
                   if path.relative_to(PKG).parts[0] != "config"
                   for n, line in enumerate(path.read_text().splitlines(), 1) if MODULE_LOOKUP.search(line))
    assert not found, found
