"""The package's import graph: no cycles between modules, and no module importing from a layer
above its own.

Why a test: the layering (HTTP adapters over the session, the session over the text layer, the
text layer over the engine, the engine over the native module) is the architecture, and it
erodes one convenient import at a time (a count that re-renders beside the session, a dialect
reaching into the sampler for a string helper). Reading the source with `ast` needs no weights
and no native build, and sees imports inside functions too: a lazy import is still a dependency,
and a cycle hidden behind one still couples the two modules.

The table below is the map. A new module must be placed in it (the test fails for an unplaced
one), so adding a module means deciding its layer.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "zen5"

# Layers from the top down: a module may import from its own layer and the layers below it.
# An entry names a module or a package (which covers everything under it); the longest entry
# that matches a module places it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("zen5.__main__", "zen5.server")),
    ("api", ("zen5.api",)),
    ("session", ("zen5.session",)),
    ("text", ("zen5.dialects", "zen5.constraints", "zen5.grammar", "zen5.lark_json_string",
              "zen5.tool_memory", "zen5.checkpoints", "zen5.signatures", "zen5.chat_types")),
    ("engine", ("zen5", "zen5.engine", "zen5.sampling", "zen5.lookup", "zen5.tokenizer",
                "zen5.loader", "zen5.config", "zen5.deepseek_v4_config", "zen5.registry", "zen5.cpu_topology",
                "zen5.memory")),
    ("native", ("zen5._native",)),
    # pure-Python helpers and value types the text layers and the engine both use (private
    # files, the environment overrides)
    ("shared", ("zen5.stop_strings", "zen5.sampling_params", "zen5.private_files", "zen5.overrides")),
]

# Known violations, each owned by someone else's work in progress; an entry that no longer
# occurs must be removed (the test says so), so this list only shrinks.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Layers that must not import a given lower layer at all: the adapters translate JSON and the
# text layer works on text and token ids the session hands it, so neither needs the engine, and
# both run (and are tested) without a model or the native build.
OFF_LIMITS = {"api": ("engine", "native"), "text": ("engine", "native")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported_names(name: str, path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import anywhere in the source (inside functions and
    TYPE_CHECKING blocks too), relative ones resolved: `import m` gives (m, None),
    `from m import x` gives (m, x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The zen5 modules `name` imports. `from pkg import x` depends on `pkg.x` when that is a
    module, else on `pkg`."""
    out = {f"{m}.{x}" if f"{m}.{x}" in known else m for m, x in _imported_names(name, path)}
    return {m for m in out if m == "zen5" or m.startswith("zen5.")} - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"zen5._native"}
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _layer(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and len(e) > best:
                best, rank = len(e), i
    return rank


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _known_cycle(component: frozenset[str]) -> bool:
    """A component made only of known cycles (two known pairs through one module form one
    component)."""
    pairs = [c for c in KNOWN_CYCLES if c <= component]
    return bool(pairs) and frozenset().union(*pairs) == component


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _graph() if _layer(m) is None)
    assert not unplaced, f"place these modules in LAYERS (tests/test_layers.py): {unplaced}"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    new = [sorted(c) for c in cycles if not _known_cycle(c)]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if not any(c <= comp for comp in cycles)]
    assert not gone, f"fixed: remove from KNOWN_CYCLES: {gone}"


def test_no_module_imports_from_a_higher_layer():
    graph = _graph()
    upward = {(m, dep) for m, deps in graph.items() for dep in deps
              if _layer(m) is not None and _layer(dep) is not None and _layer(dep) < _layer(m)}
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, "imports from a higher layer (module -> dependency): " + ", ".join(
        f"{m} ({LAYERS[_layer(m)][0]}) -> {d} ({LAYERS[_layer(d)][0]})" for m, d in new)
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"fixed: remove from KNOWN_UPWARD: {gone}"


def test_the_adapters_and_the_text_layer_stay_off_the_engine():
    names = [name for name, _ in LAYERS]
    bad = sorted(f"{m} -> {dep}" for m, deps in _graph().items() for dep in deps
                 if _layer(m) is not None and _layer(dep) is not None
                 and names[_layer(dep)] in OFF_LIMITS.get(names[_layer(m)], ()))
    assert not bad, f"imports of the engine from the api or text layer: {bad}"


def test_no_module_imports_another_modules_private_names():
    """A private name is a module's own business (one protocol adapter once took another's
    private class, against the rule in api/__init__.py): what two modules share is made public
    in a module both may import."""
    mods = _modules()
    known = set(mods) | {"zen5._native"}
    found = [f"{name}: from {m} import {x}" for name, path in mods.items()
             for m, x in _imported_names(name, path)
             if m.startswith("zen5") and x and x.startswith("_") and f"{m}.{x}" not in known]
    assert not found, found


def test_the_checker_sees_what_it_checks():
    """The graph is not vacuous: imports at module level, inside functions and relative ones are
    all edges, and a cycle is found when there is one."""
    graph = _graph()
    assert "zen5.engine" in graph["zen5.session"]            # module level
    assert "zen5.session" in graph["zen5.server"]             # inside a function
    assert "zen5.dialects.base" in graph["zen5.dialects.chatml"]
    assert "zen5._native" in graph["zen5.engine"]             # `from zen5 import _native`
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
