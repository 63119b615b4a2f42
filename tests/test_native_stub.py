"""The type stub of the native module (python/zen5/_native/*.pyi) against the built module, both
ways: every public name of zen5._native and of its testing submodule is in the stub and every
stub name exists, of the same kind (function, class, property, exception base); every function's
and method's parameter names, and which of them have defaults, are the ones pybind11 reports.
A binding added without its stub entry, or renamed, fails here."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import zen5
from zen5 import _native

STUBS = Path(zen5.__file__).parent / "_native"
MODULES = {"zen5._native": (_native, STUBS / "__init__.pyi"),
           "zen5._native.testing": (_native.testing, STUBS / "testing.pyi")}
SIMPLE_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def stub_names(tree: ast.Module) -> dict[str, ast.AST]:
    """The names a stub exports (PEP 484): definitions, annotated names and `import x as x`."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.setdefault(node.name, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            out.update((a.asname, node) for a in node.names if a.asname == a.name)
    return {name: node for name, node in out.items() if not name.startswith("_")}


def stub_defs(body: list[ast.stmt], name: str) -> list[ast.FunctionDef]:
    """Every definition of name in a stub body (more than one when overloaded)."""
    return [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]


def runtime_signatures(fn) -> list[ast.arguments]:
    """The signatures pybind11 writes into a function's docstring, parsed; one per overload."""
    lines = (fn.__doc__ or "").strip().splitlines()
    assert lines, f"{fn.__qualname__} has no docstring signature"
    if lines[0].endswith("(*args, **kwargs)") and len(lines) > 1 and lines[1] == "Overloaded function.":
        lines = [ln.split(". ", 1)[1] for ln in lines if ln[:1].isdigit() and ". " in ln]
    else:
        lines = lines[:1]
    return [ast.parse(f"def {ln}: ...").body[0].args for ln in lines]


def params(args: ast.arguments) -> list[tuple[str, bool]]:
    """(name, has a default) per parameter, in order."""
    plain = args.posonlyargs + args.args
    first_default = len(plain) - len(args.defaults)
    out = [(a.arg, i >= first_default) for i, a in enumerate(plain)]
    out += [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return out


def check_function(where: str, fn, defs: list[ast.FunctionDef]) -> None:
    runtime = [params(a) for a in runtime_signatures(fn)]
    stubbed = [params(d.args) for d in defs]
    if len(runtime) == 1 and len(stubbed) > 1:  # overloads for the type checker only: same names
        assert all([n for n, _ in s] == [n for n, _ in runtime[0]] for s in stubbed), where
    else:
        assert stubbed == runtime, f"{where}: stub {stubbed} != module {runtime}"


def check_class(where: str, cls: type, node: ast.ClassDef) -> None:
    if issubclass(cls, BaseException):  # a registered exception: its base is the whole API
        bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        assert bases == [cls.__bases__[0].__name__], f"{where}: bases {bases} != {cls.__bases__[0].__name__}"
        return
    members = {n for n in vars(cls) if not n.startswith("_")} | {"__init__"}
    stubbed = {n.name for n in node.body if isinstance(n, ast.FunctionDef)
               and (not n.name.startswith("_") or n.name == "__init__")}
    assert stubbed == members, f"{where}: only in the stub {stubbed - members}, only in the module {members - stubbed}"
    for name in sorted(members):
        defs = stub_defs(node.body, name)
        is_property = any(isinstance(d, ast.Name) and d.id == "property" for df in defs for d in df.decorator_list)
        if isinstance(vars(cls)[name], property):
            assert is_property, f"{where}.{name} is a property in the module"
        else:
            assert not is_property, f"{where}.{name} is a method in the module"
            check_function(f"{where}.{name}", vars(cls)[name], defs)


@pytest.mark.parametrize("module_name", list(MODULES))
def test_stub_names_both_ways(module_name):
    module, path = MODULES[module_name]
    stubbed = set(stub_names(ast.parse(path.read_text(), str(path))))
    public = {n for n in dir(module) if not n.startswith("_")}
    assert stubbed - public == set(), f"{path.name} names what {module_name} does not have"
    assert public - stubbed == set(), f"{module_name} has names {path.name} does not describe"


@pytest.mark.parametrize("module_name", list(MODULES))
def test_stub_kinds_and_signatures(module_name):
    module, path = MODULES[module_name]
    tree = ast.parse(path.read_text(), str(path))
    for name, node in stub_names(tree).items():
        obj, where = getattr(module, name), f"{module_name}.{name}"
        if isinstance(node, ast.ClassDef):
            assert inspect.isclass(obj), f"{where} is not a class"
            check_class(where, obj, node)
        elif isinstance(node, ast.FunctionDef):
            assert callable(obj) and not inspect.isclass(obj), f"{where} is not a function"
            check_function(where, obj, stub_defs(tree.body, name))
        elif isinstance(node, ast.ImportFrom):
            assert inspect.ismodule(obj) and obj.__name__ == where, f"{where} is not its submodule"
            assert (STUBS / f"{name}.pyi").is_file(), f"{where} has no stub file"
        else:
            annotation = ast.unparse(node.annotation)
            if annotation in SIMPLE_TYPES:
                assert isinstance(obj, SIMPLE_TYPES[annotation]), f"{where} is not a {annotation}"


def test_check_catches_a_missing_parameter():
    """The signature check reads pybind11's docstrings: a stub that drops a parameter fails."""
    stub = ast.parse("def rewind(self, n: int) -> None: ...").body
    with pytest.raises(AssertionError, match="rewind"):
        check_function("Context.rewind", _native.Context.rewind, stub_defs(stub, "rewind"))
