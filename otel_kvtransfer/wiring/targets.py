"""What a framework's wrappers need from the code they patch: declared once, checked where it runs and by the canary.

A `Target` names one class of a module, optionally one of its methods (a patch target) with the parameter names
the wrapper reads from the call, and the attributes the wrappers read from its instances (set in the class body,
declared as fields, or assigned as `self.<name>` in any method of the class or of its bases). A target marked
`optional` is a newer code path: when it is absent the wrappers simply do not see that path.

- `missing(module, targets)`: the check at run time, on the imported module, before anything of it is patched.
- `missing_in_source(tree_of, targets)`: the same check on source text only (ast; nothing imported), for
  the canary that reads each new release's wheel.
Both answer the same strings, e.g. `MooncakeConnectorWorker._send_blocks(src_ptrs)`, so a warning and a canary
failure name the missing piece the same way.
"""

import ast
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union, cast


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    method: Optional[str] = None
    params: Tuple[str, ...] = ()
    attrs: Tuple[str, ...] = ()
    optional: bool = False

    def names(self) -> List[str]:
        """The pieces of this target, as the check reports them when missing."""
        pieces = []
        if self.method:
            pieces.append(f"{self.cls}.{self.method}")
            pieces.extend(f"{self.cls}.{self.method}({p})" for p in self.params)
        pieces.extend(f"{self.cls}.{a}" for a in self.attrs)
        return pieces or [self.cls]


def required(targets: Iterable[Target]) -> List[Target]:
    return [t for t in targets if not t.optional]


# --- the run-time check -----------------------------------------------------------------------------------------

def _self_assignments(tree: ast.AST) -> Set[str]:
    """Names assigned as `self.<name>` (plain, annotated or augmented) anywhere in a class body's functions."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for element in ast.walk(target):
                    if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                            and element.value.id == "self"):
                        names.add(element.attr)
    return names


def _class_body_names(node: ast.ClassDef) -> Set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
    return names


def _declared_attributes(cls: type) -> Set[str]:
    """Attributes the classes of `cls`'s MRO declare: class attributes, annotations, msgspec / dataclass fields."""
    names: Set[str] = set()
    for klass in inspect.getmro(cls):
        names.update(vars(klass))
        for declared in ("__annotations__", "__struct_fields__", "__dataclass_fields__"):
            value = vars(klass).get(declared)
            if isinstance(value, (dict, tuple, list)):
                names.update(value)
    return names


def _source_files(cls: type) -> List[str]:
    files = []
    for klass in inspect.getmro(cls):
        try:
            path = inspect.getsourcefile(klass)
        except TypeError:  # a builtin class
            continue
        if path and path not in files:
            files.append(path)
    return files


def _assigned_in_source(cls: type, name: str, texts: Dict[str, str]) -> bool:
    """`self.<name> = ...` in the source files of `cls`'s classes. A text search, not ast: at run time it must
    cost milliseconds on vLLM's 4,000-line modules; the canary does the exact (ast) check."""
    pattern = re.compile(r"\bself\." + re.escape(name) + r"\s*(?::[^=\n]+)?(?:[-+*/|&]?=)(?!=)")
    for path in _source_files(cls):
        if path not in texts:
            try:
                with open(path, encoding="utf-8") as handle:
                    texts[path] = handle.read()
            except OSError:
                texts[path] = ""
        if pattern.search(texts[path]):
            return True
    return False


def _parameters(function: Callable[..., Any]) -> Optional[Set[str]]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: its parameters cannot be checked here


def _module(name: str, default: ModuleType) -> ModuleType:
    """A module the patched one imported already (its metadata classes live next door)."""
    if getattr(default, "__name__", None) == name:
        return default
    found = sys.modules.get(name)
    return found if found is not None else importlib.import_module(name)


def missing(module: ModuleType, targets: Iterable[Target]) -> List[str]:
    """What of `targets` the imported `module` (and the modules they name) lack; [] when everything is there."""
    absent: List[str] = []
    attribute_cache: Dict[type, Set[str]] = {}
    texts: Dict[str, str] = {}  # source file -> its text, read once per check
    for target in targets:
        try:
            owner = _module(target.module, module)
        except Exception:
            absent.append(target.module)
            continue
        cls = getattr(owner, target.cls, None)
        if not isinstance(cls, type):
            absent.append(target.cls)
            continue
        if target.method:
            function = inspect.getattr_static(cls, target.method, None)
            if function is None:
                absent.append(f"{target.cls}.{target.method}")
                continue
            function = getattr(function, "__func__", function)  # staticmethod / classmethod
            params = _parameters(function)
            if params is not None:
                absent.extend(f"{target.cls}.{target.method}({p})" for p in target.params if p not in params)
        if target.attrs:
            if cls not in attribute_cache:
                attribute_cache[cls] = _declared_attributes(cls)
            absent.extend(f"{target.cls}.{a}" for a in target.attrs
                          if a not in attribute_cache[cls] and not _assigned_in_source(cls, a, texts))
    return absent


# --- the same check on source text (the canary) ------------------------------------------------------------------

def _imports(tree: ast.Module, module: str) -> Dict[str, Tuple[str, str]]:
    """Name -> (module, name) of the `from X import Name` statements of a module (relative ones resolved)."""
    found = {}
    package = module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            for alias in node.names:
                found[alias.asname or alias.name] = (source, alias.name)
    return found


def _find_class(tree_of: Callable[[str], Optional[ast.Module]], module: str, name: str,
                depth: int = 0) -> Optional[Tuple[str, ast.ClassDef]]:
    tree = tree_of(module)
    if tree is None or depth > 8:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    source = _imports(tree, module).get(name)  # re-exported: follow the import
    return _find_class(tree_of, source[0], source[1], depth + 1) if source else None


def _source_class_chain(tree_of: Callable[[str], Optional[ast.Module]], module: str,
                        name: str) -> List[Tuple[str, ast.ClassDef]]:
    """The class and its bases that have source here (bases from other libraries simply end the chain)."""
    chain: List[Tuple[str, ast.ClassDef]]
    seen: Set[Tuple[str, str]]
    chain, todo, seen = [], [(module, name)], set()
    while todo and len(chain) < 32:
        found = _find_class(tree_of, *todo.pop())
        if found is None or (found[0], found[1].name) in seen:
            continue
        seen.add((found[0], found[1].name))
        chain.append(found)
        imports = _imports(cast(ast.Module, tree_of(found[0])), found[0])  # the class was just found in it
        for base in found[1].bases:
            base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if base_name:
                todo.append(imports.get(base_name, (found[0], base_name)))
    return chain


def _function_params(node: Union[ast.FunctionDef, ast.AsyncFunctionDef]) -> Set[str]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return set(names)


def missing_in_source(tree_of: Callable[[str], Optional[ast.Module]], targets: Iterable[Target]) -> List[str]:
    """`missing()` on source text: `tree_of(dotted module name)` gives its parsed source, or None."""
    absent: List[str] = []
    for target in targets:
        chain = _source_class_chain(tree_of, target.module, target.cls)
        if not chain:
            absent.append(target.cls)
            continue
        if target.method:
            definition = None
            for _, node in chain:  # the nearest class that defines it, as Python's lookup finds it
                definition = next((item for item in node.body if isinstance(item, (ast.FunctionDef,
                                   ast.AsyncFunctionDef)) and item.name == target.method), None)
                if definition is not None:
                    break
            if definition is None:
                absent.append(f"{target.cls}.{target.method}")
                continue
            params = _function_params(definition)
            absent.extend(f"{target.cls}.{target.method}({p})" for p in target.params if p not in params)
        if target.attrs:
            names: Set[str] = set()
            for _, node in chain:
                names |= _class_body_names(node) | _self_assignments(node)
            absent.extend(f"{target.cls}.{a}" for a in target.attrs if a not in names)
    return absent
