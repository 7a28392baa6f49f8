"""docs/design.md section 2: each layer of `hcp` imports only itself and the layers above it."""
import ast
import pathlib

LAYERS = ["config", "parallel", "comm", "model", "data", "schedule", "dcp", "train"]
PKG = pathlib.Path(__file__).resolve().parents[1] / "hcp"


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


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
