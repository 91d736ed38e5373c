"""docs/architecture.md is the one map of the package, and it is true: its folder rows run in the order
tests/project/test_layout.py enforces, every package module is named in its own folder's row, and every name in a row is
a module that exists (a renamed or deleted module cannot linger there)."""

import pathlib
import re

from test_layout import LAYERS, MODULES

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
MAP = DOCS / "architecture.md"

# The map's rows for the layers whose modules sit at the package's top level rather than in a folder.
ROW_OF_TOP_LEVEL = {"shared leaves": LAYERS[0], "entry points": LAYERS[-1]}


def _rows():
    """(row's folder cell, its modules cell) of the map's folder table, in order."""
    text = MAP.read_text(encoding="utf-8")
    section = text.split("## The folders", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("folder", "---") and not cells[0].startswith("---"):
            rows.append((cells[0].strip("`").rstrip("/"), cells[2]))
    return rows


def _layer_names(row: str):
    return ROW_OF_TOP_LEVEL.get(row, (row,))


def test_the_rows_run_in_the_enforced_layer_order():
    assert [tuple(_layer_names(row)) for row, _ in _rows()] == [tuple(layer) for layer in LAYERS]


def _named(cell: str):
    return set(re.findall(r"`([A-Za-z_][\w/.]*?)/?`", cell))


def _module_names_in_row(row: str):
    """Each package module of the row, as the map names it: relative to its folder, a sub-package's modules with
    their package (`sglang/decode`), a package's own __init__ by the package's name."""
    names = {}
    for module in MODULES:
        parts = module.split(".")
        if row in ROW_OF_TOP_LEVEL:
            if len(parts) == 1 and parts[0] in ROW_OF_TOP_LEVEL[row]:
                names[module] = parts[0]
            continue
        if parts[0] != row or parts == [row, "__init__"]:
            continue
        inner = parts[1:]
        if inner[-1] == "__init__":
            inner = inner[:-1]
        names[module] = "/".join(inner)
    return names


def test_every_package_module_is_named_in_its_folders_row():
    missing = []
    for row, cell in _rows():
        named = _named(cell)
        for module, name in _module_names_in_row(row).items():
            last = name.split("/")[-1]
            # a module of a sub-package is named in the sub-package's own list: `sglang/` (`decode`, ...)
            if name not in named and last not in named:
                missing.append(module)
    assert not missing, f"modules the map does not name in their folder's row: {missing}"


def test_every_module_the_map_names_exists():
    existing = {"__init__", "__main__"}
    for module in MODULES:
        parts = [p for p in module.split(".") if p != "__init__"]
        existing.update(parts)  # the module, its folder and sub-package
        existing.add("/".join(parts[1:]))
    phantoms = []
    for row, cell in _rows():
        for name in _named(cell):
            if "." in name or name.startswith("otel-kvtransfer"):
                continue  # a class or call (`recorder.Sink`), a thread's name
            if name.split("/")[-1] not in existing and name not in existing:
                phantoms.append((row, name))
    assert not phantoms, f"the map names modules that do not exist: {phantoms}"


def test_the_other_maps_point_here():
    """No second map to drift: docs/testing.md and the package docstring send the reader to this one."""
    testing = (DOCS / "testing.md").read_text(encoding="utf-8")
    assert "architecture.md" in testing and "sdk_internals every private name" not in testing
    package_doc = (MAP.parent.parent / "otel_kvtransfer" / "__init__.py").read_text(encoding="utf-8")
    assert "docs/architecture.md" in package_doc
