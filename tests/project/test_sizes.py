"""The project's size rules over the whole package, read from the source (ast): no function longer than 50 lines
and no class longer than 250 (from its `def` or `class` line to its last, decorators aside; a nested function
counts inside its own and in the one around it). A module that breaks one is split where its concerns part."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "otel_kvtransfer"
MOST_FUNCTION_LINES = 50
MOST_CLASS_LINES = 250


def _too_long(source: str, filename: str = "<source>") -> list:
    """(kind, name, line, length) of every function and class over its limit."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, most = "function", MOST_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            kind, most = "class", MOST_CLASS_LINES
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > most:
            found.append((kind, node.name, node.lineno, length))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_function_or_class_is_over_its_size(path):
    too_long = _too_long(path.read_text(encoding="utf-8"), str(path))
    assert not too_long, f"{path.relative_to(PACKAGE)}: over the size rules (kind, name, line, lines): {too_long}"


def test_the_rule_sees_a_long_function_and_a_long_class():
    """Not vacuous: a function of 51 lines and a class of 251 are caught, one of 50 and one of 250 are not."""
    def function(name, lines):
        return f"def {name}():\n" + "    x = 1\n" * (lines - 1)

    source = function("fits", 50) + function("long", 51)
    source += "class Fits:\n" + "    x = 1\n" * 249 + "class Long:\n" + "    x = 1\n" * 250
    assert [(kind, name, length) for kind, name, _, length in _too_long(source)] == [
        ("function", "long", 51), ("class", "Long", 251)]


def test_the_package_is_read():
    assert len(MODULES) > 40
