"""The private names the package reads, found by parsing it (ast), each with its owner: where the value comes from.

A private name starts with one underscore (a dunder is not one). A read is an attribute (`x._name`, read or
assigned), a string constant given to getattr / hasattr / setattr / delattr / attrgetter, or an import of a
private name or from a module whose path has a private part (`opentelemetry.sdk._configuration`).

Its owner is the module the value comes from, as far as the source says:
- `""`: the reader's own code (`self._x` where the reader's module defines `_x`; a name the module defines);
- a dotted module: what the value was imported from, also through a name assigned from it (`recorder = RECORDER`),
  a default (`def f(recorder=RECORDER)`) or a call (`Patcher(...)`: an object of a class imported from there);
- None: the source does not say (a value passed in, or made by something not imported).
tests/project/test_layout.py reads the owners that are our own modules (no private read across folders);
tests/project/test_sdk_canary.py the ones that are OpenTelemetry's (only through `sdk_internals`).
"""

import ast
import pathlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

PACKAGE = "otel_kvtransfer"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2] / PACKAGE
ATTRIBUTE_FUNCTIONS = {"getattr": 1, "hasattr": 1, "setattr": 1, "delattr": 1}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass(frozen=True)
class Read:
    module: str  # the reader, dotted, relative to the package ("engines.mooncake")
    line: int
    name: str  # the private name
    owner: Optional[str]  # "" (the reader's own), a dotted module, or None (unknown)
    text: str  # the expression, for messages
    kind: str = "attribute"  # or "import"

    def ours(self) -> bool:
        return self.owner == "" or (self.owner or "").split(".")[0] == PACKAGE

    def owner_module(self) -> Optional[str]:
        """Our module that owns it, relative to the package ("recording.recorder"); None when not ours."""
        if self.owner == "":
            return self.module
        if self.owner and self.owner.split(".")[0] == PACKAGE:
            return self.owner[len(PACKAGE) + 1:] or "__init__"
        return None


def modules(package_dir: pathlib.Path = PACKAGE_DIR) -> Dict[str, pathlib.Path]:
    """Every module of the package, dotted relative to it ("building.builder", "engines.__init__")."""
    return {".".join(path.relative_to(package_dir).with_suffix("").parts): path
            for path in sorted(package_dir.rglob("*.py"))}


def _is_our_module(dotted: str, package_dir: pathlib.Path) -> bool:
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        return False
    file = package_dir.joinpath(*parts[1:])
    return file.with_suffix(".py").exists() or file.is_dir()


def _root(node: ast.AST) -> Optional[str]:
    """The name an expression starts from: `a` in `a.b[0].c()`, None for a literal."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


class _Owners:
    """Name -> owner for one module, from its imports, its own definitions and the names assigned from them."""

    def __init__(self, module: str, tree: ast.Module, package_dir: pathlib.Path):
        self.module, self.tree, self.package_dir = module, tree, package_dir
        parts = module.split(".")
        self.package = [PACKAGE] + parts[:-1]  # a module's own package (for __init__: the package itself)
        self.bound: Dict[str, Optional[str]] = {}
        self.own_attributes = self._own_attributes()
        self._imports()
        self._definitions()
        for _ in range(3):  # names assigned from names assigned from imports, ...
            self._aliases()

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package[: len(self.package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def imported_from(self, node: ast.ImportFrom, name: str) -> str:
        """Where `from <node.module> import name` comes from: the submodule when it is one of ours."""
        source = self._absolute(node)
        sub = f"{source}.{name}"
        return sub if _is_our_module(sub, self.package_dir) else source

    def _imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.bound[alias.asname] = alias.name
                    else:
                        self.bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    self.bound[alias.asname or alias.name] = self.imported_from(node, alias.name)

    def _definitions(self) -> None:
        """The module's own top-level functions and classes (a module-level assignment is an alias, below)."""
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bound.setdefault(node.name, "")

    def owner_of(self, node: ast.AST) -> Optional[str]:
        name = _root(node)
        if name is None:
            return None
        return self.bound.get(name)

    def _bind(self, target: ast.AST, value: Optional[ast.AST], module_level: bool) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [None] * len(target.elts)
            for element, element_value in zip(target.elts, values):
                self._bind(element, element_value, module_level)
            return
        if not isinstance(target, ast.Name) or target.id in self.bound and self.bound[target.id] is not None:
            return
        owner = self.owner_of(value) if value is not None else None
        if owner is None and module_level:
            owner = ""  # a module-level value made here (a constant, a dict, an object of a builtin)
        if owner is not None:
            self.bound[target.id] = owner

    def _aliases(self) -> None:
        top = set(map(id, self.tree.body))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind(target, node.value, id(node) in top)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                self._bind(node.target, node.value, id(node) in top)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                positional = args.posonlyargs + args.args
                for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                    self._bind(ast.Name(arg.arg), default, False)
                for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                    if default is not None:
                        self._bind(ast.Name(arg.arg), default, False)

    def _own_attributes(self) -> set:
        """Attribute names this module defines: assigned on anything, or defined in a class body."""
        names = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            if isinstance(target, ast.Name):
                                names.add(target.id)
        return names

    def attribute_owner(self, base: ast.AST, name: str) -> Optional[str]:
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            if name in self.own_attributes:
                return ""
            return self._inherited().get(name)  # from a base class of ours defined elsewhere, or unknown (None)
        return self.owner_of(base)

    def _inherited(self) -> Dict[str, str]:
        """Attribute name -> the module of ours that defines it, for this module's classes' bases in the package
        (one level: a base's own attributes)."""
        if getattr(self, "_inherited_names", None) is None:
            self._inherited_names: Dict[str, str] = {}
            for node in ast.walk(self.tree):
                if not isinstance(node, ast.ClassDef):
                    continue
                for base in node.bases:
                    owner = self.owner_of(base)
                    if not owner or owner.split(".")[0] != PACKAGE:
                        continue
                    module = owner if _is_our_module(owner, self.package_dir) else owner.rsplit(".", 1)[0]
                    path = self.package_dir.joinpath(*module.split(".")[1:]).with_suffix(".py")
                    if not path.exists():
                        continue
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                    relative = module[len(PACKAGE) + 1:]
                    for attribute in _Owners(relative, tree, self.package_dir).own_attributes:
                        self._inherited_names.setdefault(attribute, module)
        return self._inherited_names


def reads(module: str, source: str, package_dir: pathlib.Path = PACKAGE_DIR) -> List[Read]:
    """Every private name `module` (dotted, relative to the package) reads, with its owner."""
    tree = ast.parse(source)
    owners = _Owners(module, tree, package_dir)
    found: List[Read] = []

    def add(node, name, owner, kind="attribute"):
        found.append(Read(module, node.lineno, name, owner, ast.unparse(node)[:80], kind))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            add(node, node.attr, owners.attribute_owner(node.value, node.attr))
        elif isinstance(node, ast.Call):
            function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if function in ATTRIBUTE_FUNCTIONS and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                    add(node, name.value, owners.attribute_owner(node.args[0], name.value))
            elif function == "attrgetter":
                for name in node.args:
                    if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                        add(node, name.value, None)
        elif isinstance(node, ast.ImportFrom):
            source_module = owners._absolute(node)
            for part in source_module.split("."):
                if is_private(part):
                    add(node, part, source_module, "import")
            for alias in node.names:
                if is_private(alias.name):
                    add(node, alias.name, source_module, "import")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    if is_private(part):
                        add(node, part, alias.name, "import")
    return found


def private_strings(source: str) -> Iterator[str]:
    """Every string constant that is a private name (the names a module declares for reading elsewhere)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and is_private(node.value) \
                and node.value.isidentifier():
            yield node.value
