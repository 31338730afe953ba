"""Reach: how much code a reader must open to understand a public function.

The counting rule (the project's definition):

* Start at the function's definition and follow, transitively, every top-level
  definition of the package that a definition reached names. Count the files those
  definitions live in, the definitions, and their lines.
* A top-level definition is a module-level function, class (its whole body, methods
  included, is one definition) or assignment (constants, TypeVars, type aliases:
  ``x = v``, ``x: T = v``, ``x += v``, ``type X = ...``), also one inside a
  module-level ``if``, ``try`` or ``with`` block. Its decorators, default values and
  annotations are part of it.
* A definition names another when an ``ast.Name`` or ``ast.Attribute`` anywhere in it
  resolves to a top-level definition of the package: a name defined in the same
  module; a name bound by an import of the package (``from pkg.mod import x``, then
  ``x``; ``from pkg import mod`` or ``import pkg.mod``, then ``mod.x`` or
  ``pkg.mod.x``), relative and star imports included, and so are imports inside the
  definition; a re-export through an ``__init__``: its ``from ._mod import x`` is
  followed to ``x``'s definition, and so is an ``__init__`` alias ``x = mod.x`` whose
  right side is a package definition (neither the import nor the alias is counted). An
  attribute of a definition (``Cls.method``) names that definition. A string annotation
  (``"Cls"``) names what it spells. Not followed: a name bound locally (a parameter, a
  local variable), and a name that is no package definition (jax, optax from clipjax,
  builtins). So a package's import of its own root (optax's ``import optax.tree``,
  then ``optax.tree.zeros_like``) is followed: at optax 0.2.8, optax.scale_by_adam
  reaches 6 files / 282 lines, 4 / 178 when those chains are left out.
* The lines of a definition run from its first decorator to its ``end_lineno``; its
  non-blank ones are counted, docstrings and comments included ("lines"). "Code" is
  the same less docstring lines (of the definition and of the functions and classes
  inside it) and comment-only lines.

``--totals DIR``: over every ``.py`` file under DIR, the non-blank lines and the
docstring lines (module, class and function docstrings: every line their string
literal spans; also given non-blank only), and comment-only lines.

    python benchmarks/reach.py clipjax.zclip clipjax.clip_by_global_norm [--list] [--top 10]
    python benchmarks/reach.py optax.scale_by_adam optax.clip_by_global_norm --list
    python benchmarks/reach.py optax.adam --package-dir .venv/lib/python3.11/site-packages/optax
    python benchmarks/reach.py --totals clipjax --totals tests

A target's package directory is ``--package-dir`` (whose name is the package's), else
``./<package>`` when it holds an ``__init__.py``, else where
``importlib.util.find_spec`` finds it (nothing is imported).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# A binding made by an import: ("module", "pkg.mod") or ("member", "pkg.mod", "name").
Binding = tuple[str, ...]
# A reference in a definition: (binding of a local import or None, name, attributes).
Ref = tuple[Binding | None, str, tuple[str, ...]]

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPED = (*_FUNCTIONS, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_TYPE_ALIAS = getattr(ast, "TypeAlias", None)  # Python >= 3.12
_TRY = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


def _docstring_node(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", None)
    if isinstance(body, list) and body:
        first = body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            return first
    return None


def _docstring_lines(node: ast.AST) -> set[int]:
    """The lines spanned by the docstrings of ``node`` and of every function and
    class inside it."""
    lines: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Module, ast.ClassDef, *_FUNCTIONS)):
            doc = _docstring_node(inner)
            if doc is not None:
                lines.update(range(doc.lineno, doc.end_lineno + 1))
    return lines


def _comment_lines(source: str) -> set[int]:
    """The lines holding nothing but a comment."""
    lines = source.splitlines()
    found = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                if not lines[row - 1][:col].strip():
                    found.add(row)
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


@dataclass(eq=False)
class Definition:
    """One top-level definition: a function, a class or an assignment."""

    module: Module
    node: ast.stmt
    names: tuple[str, ...]
    refs: list[Ref] = field(default_factory=list)

    @property
    def label(self) -> str:
        return ", ".join(self.names)

    @property
    def span(self) -> range:
        decorators = getattr(self.node, "decorator_list", [])
        start = min([self.node.lineno, *(d.lineno for d in decorators)])
        return range(start, self.node.end_lineno + 1)

    @property
    def lines(self) -> set[int]:
        """Non-blank lines, docstrings and comments included."""
        text = self.module.lines
        return {i for i in self.span if text[i - 1].strip()}

    @property
    def code(self) -> set[int]:
        """Non-blank lines less docstrings and comment-only lines."""
        return self.lines - _docstring_lines(self.node) - self.module.comments


class Module:
    """One parsed module of the package: its definitions and import bindings."""

    def __init__(self, name: str, path: Path, is_package: bool) -> None:
        self.name = name
        self.path = path
        self.is_package = is_package
        self.source = path.read_text(encoding="utf-8")
        self.lines = self.source.splitlines()
        self.tree = ast.parse(self.source, filename=str(path))
        self.comments = _comment_lines(self.source)
        self.defs: dict[str, list[Definition]] = {}
        self.imports: dict[str, Binding] = {}
        self.stars: list[str] = []
        self.aliases: dict[str, Ref] = {}  # __init__'s ``x = mod.x``
        self.definitions: list[Definition] = []
        for stmt in _module_level(self.tree.body):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for name, binding in _import_bindings(stmt, self):
                    if binding[0] == "star":
                        self.stars.append(binding[1])
                    else:
                        self.imports[name] = binding
                continue
            names = _defined_names(stmt)
            if not names:
                continue
            definition = Definition(self, stmt, names)
            definition.refs = _references(stmt, self)
            self.definitions.append(definition)
            for name in names:
                self.defs.setdefault(name, []).append(definition)
            if (
                self.path.name == "__init__.py"
                and isinstance(stmt, ast.Assign)
                and len(names) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                ref = _chain(stmt.value)
                if ref is not None:
                    self.aliases[names[0]] = (None, *ref)

    def absolute(self, level: int, module: str | None) -> str:
        """The absolute name of a (relative) import's module."""
        if level == 0:
            return module or ""
        base = self.name if self.is_package else self.name.rpartition(".")[0]
        for _ in range(level - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{module}" if module else base


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, those inside module-level if/try/with blocks included."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif _TRY and isinstance(stmt, _TRY):
            yield from _module_level(stmt.body)
            for handler in stmt.handlers:
                yield from _module_level(handler.body)
            yield from _module_level(stmt.orelse)
            yield from _module_level(stmt.finalbody)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _module_level(stmt.body)
        else:
            yield stmt


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _defined_names(stmt: ast.stmt) -> tuple[str, ...]:
    if isinstance(stmt, (*_FUNCTIONS, ast.ClassDef)):
        return (stmt.name,)
    if isinstance(stmt, ast.Assign):
        return tuple(n for t in stmt.targets for n in _target_names(t))
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return tuple(_target_names(stmt.target))
    if _TYPE_ALIAS is not None and isinstance(stmt, _TYPE_ALIAS):
        return (stmt.name.id,)
    return ()


def _import_bindings(stmt: ast.stmt, module: Module) -> Iterator[tuple[str, Binding]]:
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.asname:
                yield alias.asname, ("module", alias.name)
            else:
                top = alias.name.partition(".")[0]
                yield top, ("module", top)
    elif isinstance(stmt, ast.ImportFrom):
        source = module.absolute(stmt.level, stmt.module)
        for alias in stmt.names:
            if alias.name == "*":
                yield "*", ("star", source)
            else:
                yield alias.asname or alias.name, ("member", source, alias.name)


def _chain(node: ast.AST) -> tuple[str, tuple[str, ...]] | None:
    """``a.b.c`` as ("a", ("b", "c")); None when it does not start at a name."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, tuple(reversed(attrs))
    return None


def _arguments(args: ast.arguments) -> list[ast.arg]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    return every


def _local_bindings(
    nodes: list[ast.AST], module: Module, bound: dict[str, Binding | None]
) -> dict[str, Binding | None]:
    """Names a function (or class) body binds: None for a local variable, the binding
    for a local import. Nested functions, classes, lambdas and comprehensions keep
    their own names."""
    global_names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            bound[node.name] = None
            return
        if isinstance(node, (ast.Lambda, *_COMPREHENSIONS)):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name, binding in _import_bindings(node, module):
                if binding[0] != "star":
                    bound[name] = binding
            return
        if isinstance(node, ast.Global):
            global_names.update(node.names)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.setdefault(node.id, None)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.setdefault(node.name, None)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.setdefault(node.rest, None)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in nodes:
        visit(node)
    for name in global_names:
        bound.pop(name, None)
    return bound


def _references(stmt: ast.stmt, module: Module) -> list[Ref]:
    """Every name and attribute chain a top-level definition reads, less local names."""
    refs: list[Ref] = []
    # Each scope: (kind, names); a class scope is seen only from its own body.
    Scope = tuple[str, dict[str, "Binding | None"]]

    def record(name: str, attrs: tuple[str, ...], scopes: list[Scope]) -> None:
        for depth, (kind, names) in enumerate(reversed(scopes)):
            if kind == "class" and depth > 0:
                continue
            if name in names:
                binding = names[name]
                if binding is not None:
                    refs.append((binding, name, attrs))
                return
        refs.append((None, name, attrs))

    def annotation(node: ast.AST | None, scopes: list[Scope]) -> None:
        if node is None:
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                parsed = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return
            annotation(parsed, scopes)
        elif isinstance(node, (ast.Name, ast.Attribute)):
            visit(node, scopes)
        else:
            for child in ast.iter_child_nodes(node):
                annotation(child, scopes)

    def signature(args: ast.arguments, scopes: list[Scope]) -> None:
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                visit(default, scopes)
        for arg in _arguments(args):
            annotation(arg.annotation, scopes)

    def visit(node: ast.AST, scopes: list[Scope]) -> None:
        if isinstance(node, _FUNCTIONS):
            for decorator in node.decorator_list:
                visit(decorator, scopes)
            signature(node.args, scopes)
            annotation(node.returns, scopes)
            names: dict[str, Binding | None] = {a.arg: None for a in _arguments(node.args)}
            inner = [*scopes, ("function", _local_bindings(node.body, module, names))]
            for child in node.body:
                visit(child, inner)
        elif isinstance(node, ast.ClassDef):
            for child in [*node.decorator_list, *node.bases, *node.keywords]:
                visit(child, scopes)
            inner = [*scopes, ("class", _local_bindings(node.body, module, {}))]
            for child in node.body:
                visit(child, inner)
        elif isinstance(node, ast.Lambda):
            signature(node.args, scopes)
            names = {a.arg: None for a in _arguments(node.args)}
            visit(node.body, [*scopes, ("function", names)])
        elif isinstance(node, _COMPREHENSIONS):
            names = {}
            for generator in node.generators:
                for name in _target_names(generator.target):
                    names[name] = None
            inner = [*scopes, ("function", names)]
            for child in ast.iter_child_nodes(node):
                visit(child, inner)
        elif isinstance(node, ast.AnnAssign):
            annotation(node.annotation, scopes)
            for child in (node.target, node.value):
                if child is not None:
                    visit(child, scopes)
        elif isinstance(node, ast.arg):
            annotation(node.annotation, scopes)
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                record(node.id, (), scopes)
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is not None:
                record(*chain, scopes)
            else:
                visit(node.value, scopes)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, scopes)

    visit(stmt, [])
    return refs


class Package:
    """Every module under a package directory, parsed, with name resolution."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.name = self.directory.name
        self.modules: dict[str, Module] = {}
        # Directories without an __init__.py (namespace packages): modules with no names.
        self.namespaces = {self.name} | {
            ".".join([self.name, *d.relative_to(self.directory).parts])
            for d in self.directory.rglob("*")
            if d.is_dir() and d.name != "__pycache__"
        }
        for path in sorted(self.directory.rglob("*.py")):
            relative = path.relative_to(self.directory)
            if "__pycache__" in relative.parts:
                continue
            parts = [self.name, *relative.with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            try:
                self.modules[name] = Module(name, path, is_package)
            except (SyntaxError, UnicodeDecodeError) as error:
                print(f"skipped {path}: {error}", file=sys.stderr)
        self._resolved: dict[int, list[Definition]] = {}

    def member(self, module: str, name: str, seen: frozenset = frozenset()):
        """What ``module.name`` is: ("defs", definitions), ("module", name) or None."""
        key = (module, name)
        if key in seen:
            return None
        if module not in self.modules:
            return self.binding(("module", f"{module}.{name}"))
        seen = seen | {key}
        mod = self.modules[module]
        if name in mod.aliases:
            found = self.reference(mod, mod.aliases[name], seen)
            if found is not None:
                return found
        if name in mod.defs:
            return ("defs", tuple(mod.defs[name]))
        if name in mod.imports:
            found = self.binding(mod.imports[name], seen)
            if found is not None:
                return found
        if self.is_module(f"{module}.{name}"):
            return ("module", f"{module}.{name}")
        for star in mod.stars if not name.startswith("_") else ():
            found = self.member(star, name, seen)
            if found is not None:
                return found
        return None

    def is_module(self, name: str) -> bool:
        return name in self.modules or name in self.namespaces

    def binding(self, binding: Binding, seen: frozenset = frozenset()):
        if binding[0] == "module":
            return ("module", binding[1]) if self.is_module(binding[1]) else None
        return self.member(binding[1], binding[2], seen)

    def reference(self, module: Module, ref: Ref, seen: frozenset = frozenset()):
        binding, name, attrs = ref
        if binding is not None:
            found = self.binding(binding, seen)
        else:
            found = self.member(module.name, name, seen)
        for attr in attrs:
            if found is None or found[0] == "defs":
                break
            found = self.member(found[1], attr, seen)
        return found

    def named(self, definition: Definition) -> list[Definition]:
        """The package definitions a definition names."""
        key = id(definition)
        if key not in self._resolved:
            found: dict[int, Definition] = {}
            for ref in definition.refs:
                target = self.reference(definition.module, ref)
                if target is not None and target[0] == "defs":
                    for other in target[1]:
                        found.setdefault(id(other), other)
            self._resolved[key] = list(found.values())
        return self._resolved[key]

    def target(self, dotted: str) -> list[Definition]:
        """The definitions a dotted name (``pkg.f``, ``pkg.mod.Cls``) stands for."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if self.is_module(module):
                break
        else:
            raise SystemExit(f"{dotted}: no module of {self.name} at {self.directory}")
        found = ("module", module)
        for attr in parts[cut:]:
            if found is None or found[0] == "defs":
                break
            found = self.member(found[1], attr)
        if found is None or found[0] != "defs":
            raise SystemExit(f"{dotted}: not a top-level definition of {self.name}")
        return list(found[1])

    def reach(self, dotted: str) -> list[Definition]:
        """Every definition reached from ``dotted``, itself included."""
        reached: dict[int, Definition] = {}
        stack = self.target(dotted)
        while stack:
            definition = stack.pop()
            if id(definition) in reached:
                continue
            reached[id(definition)] = definition
            stack.extend(self.named(definition))
        return list(reached.values())

    def display(self, path: Path) -> str:
        return str(path.relative_to(self.directory.parent))


@dataclass
class Count:
    files: int
    definitions: int
    lines: int
    code: int


def count(definitions: list[Definition]) -> Count:
    lines: dict[Path, set[int]] = {}
    code: dict[Path, set[int]] = {}
    for definition in definitions:
        path = definition.module.path
        lines.setdefault(path, set()).update(definition.lines)
        code.setdefault(path, set()).update(definition.code)
    return Count(
        files=len(lines),
        definitions=len(definitions),
        lines=sum(map(len, lines.values())),
        code=sum(map(len, code.values())),
    )


def _package_dir(top: str, given: dict[str, Path]) -> Path:
    if top in given:
        return given[top]
    local = Path.cwd() / top
    if (local / "__init__.py").is_file():
        return local
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{top}: no package directory found; pass --package-dir")
    return Path(next(iter(spec.submodule_search_locations)))


def _totals(directory: Path) -> dict[str, int]:
    totals = {"files": 0, "non-blank": 0, "docstring": 0, "docstring non-blank": 0}
    totals["comment-only"] = 0
    for path in sorted(directory.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        text = source.splitlines()
        non_blank = {i for i, line in enumerate(text, 1) if line.strip()}
        try:
            docstrings = _docstring_lines(ast.parse(source, filename=str(path)))
        except SyntaxError as error:
            print(f"{path}: docstrings not counted: {error}", file=sys.stderr)
            docstrings = set()
        totals["files"] += 1
        totals["non-blank"] += len(non_blank)
        totals["docstring"] += len(docstrings)
        totals["docstring non-blank"] += len(docstrings & non_blank)
        totals["comment-only"] += len(_comment_lines(source))
    return totals


def _table(header: list[str], rows: list[list[object]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", help="dotted names: clipjax.zclip, optax.adam")
    parser.add_argument(
        "--package-dir",
        action="append",
        default=[],
        type=Path,
        help="a package directory (its name is the package's); repeatable",
    )
    parser.add_argument(
        "--list", action="store_true", help="the definitions reached, per file, largest first"
    )
    parser.add_argument(
        "--top", type=int, default=0, metavar="N", help="the N largest definitions reached"
    )
    parser.add_argument(
        "--totals", action="append", default=[], type=Path, metavar="DIR", help="repeatable"
    )
    args = parser.parse_args()
    if not args.targets and not args.totals:
        parser.error("give targets or --totals DIR")

    if args.targets:
        given = {p.resolve().name: p for p in args.package_dir}
        packages: dict[str, Package] = {}
        rows, details = [], []
        for dotted in args.targets:
            top = dotted.partition(".")[0]
            if top not in packages:
                packages[top] = Package(_package_dir(top, given))
            package = packages[top]
            reached = package.reach(dotted)
            c = count(reached)
            rows.append([dotted, c.files, c.definitions, c.lines, c.code])
            if args.list or args.top:
                details.append(_details(dotted, package, reached, args.list, args.top))
        print(_table(["target", "files", "defs", "lines", "code"], rows))
        for text in details:
            print()
            print(text)

    if args.totals:
        rows = []
        for directory in args.totals:
            totals = _totals(directory)
            rows.append([str(directory), *totals.values()])
        if args.targets:
            print()
        print(_table(["directory", *totals.keys()], rows))


def _details(
    dotted: str, package: Package, reached: list[Definition], per_file: bool, top: int
) -> str:
    out = []
    sized = sorted(
        reached, key=lambda d: (-len(d.lines), package.display(d.module.path), d.span.start)
    )
    if per_file:
        out.append(f"{dotted}: definitions reached per file (lines, code)")
        files: dict[Path, list[Definition]] = {}
        for definition in sized:
            files.setdefault(definition.module.path, []).append(definition)
        ordered = sorted(files.items(), key=lambda kv: (-count(kv[1]).lines, str(kv[0])))
        for path, definitions in ordered:
            c = count(definitions)
            out.append(
                f"  {package.display(path)}: {c.definitions} defs, {c.lines} lines, {c.code} code"
            )
            for d in definitions:
                out.append(
                    f"    {len(d.lines):5d} {len(d.code):5d}  {d.label} (line {d.span.start})"
                )
    if top:
        if out:
            out.append("")
        out.append(f"{dotted}: the {top} largest definitions reached (lines, code)")
        for d in sized[:top]:
            where = f"{package.display(d.module.path)}:{d.span.start}"
            out.append(f"  {len(d.lines):5d} {len(d.code):5d}  {d.label}  {where}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
