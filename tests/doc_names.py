"""The dotted Python names the documentation gives our code, and whether each resolves.

The docs name code in two ways: by path (`proxy/fleet/moves/mover.py`, which tests/test_docs.py
checks on its own) and by dotted name (`proxy.fleet.moves.mover`, `Router.route_request`,
`gym_proxy.worker.participant.current_session`). A rename leaves the second kind stale
without a sound, so this module finds every such name, in the Markdown pages and in the
docstrings and comments of proxy/, worker/ and coordinator/, and resolves it against the
source. Statically, with ast: importing the modules would pull in Ray and NeMo Gym, which
only the NeMo Gym tier installs, and would run their import-time code.

Which spans count: an inline code span that is a dotted identifier, optionally called
(`a.b`, `a.b()`, `a.b(x)`), whose first part is one of our package roots (`gym_proxy`,
`proxy`, `worker`, `coordinator`) or the name of a class our code defines. Anything with a
space, `=`, `/` or a quote is not a name; a file name (`app.py`) is a path. Both
`proxy.fleet.moves.mover` and `gym_proxy.proxy.fleet.moves.mover` are the installed
package's module.
And what code a reader copies names, in a fenced block too: each name of
`from gym_proxy.<module> import <names>`, and the module of `-m gym_proxy.<module>`.

How a name resolves, part by part:

- a module is a file of the source tree (`proxy/fleet/moves/mover.py`, or a package's
  `__init__.py`); after a module, a part is a submodule or a name the module binds at top
  level (def, class, assignment, import; inside a top-level `if` or `try` too), and a name
  it imports from our code is followed to where it is defined;
- a class has what its body defines (methods, properties, class attributes, annotated
  fields, enum members, nested classes, `__slots__`), what any of its methods assigns to
  `self.<name>` (or `cls.<name>`, or `setattr(self, "<name>", ...)`), and what a base
  class of our code has (bases followed by name); a class name our code defines twice is
  ambiguous, and the name resolves when any of those classes has it;
- past an attribute, a part resolves only through a nested class, or through a field whose
  annotation names a class of ours;
- a string our code uses, written as the whole span, resolves too: logger names
  (`gym_proxy.access`) and span attribute names (`gym_proxy.slot`) are names of ours that
  are not Python names.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("gym_proxy", "proxy", "worker", "coordinator")
SOURCE_DIRS = ("proxy", "worker", "coordinator")
# Markdown pages whose names must resolve; bench/HISTORY.md is history, true when written.
PAGES = (
    [REPO / "README.md", REPO / "CONTRIBUTING.md"]
    + sorted((REPO / "docs").rglob("*.md"))
    + [REPO / "bench" / "README.md"]
)

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# A dotted name, optionally called with arguments that hold no space: `a.b(x)` names a.b.
NAME_SPAN = re.compile(rf"({DOTTED.pattern})(?:\([\w.,]*\))?")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
# Code in a fenced block or a span with spaces: `from gym_proxy.x import a, b`, `-m gym_proxy.x`.
IMPORT_LINE = re.compile(r"\bfrom (gym_proxy(?:\.\w+)*) import \(?([\w ,]+)")
RUN_MODULE = re.compile(r"(?<![\w-])-m ?(gym_proxy(?:\.\w+)*)")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "sh", "txt", "so", "sock"}


@dataclass(frozen=True)
class Span:
    """One name the docs give our code, and where it was written."""

    path: Path
    line: int
    name: str  # the dotted name, without a call's parentheses
    text: str  # the span (or the import, or the -m run) as written
    root: Path = REPO  # what `path` is shown relative to

    def where(self) -> str:
        return f"{self.path.relative_to(self.root)}:{self.line}"


@dataclass
class ClassInfo:
    name: str
    module: str
    path: Path
    line: int
    bases: list[str]
    members: set[str] = field(default_factory=set)
    nested: dict[str, ClassInfo] = field(default_factory=dict)
    # member -> the class names its annotation mentions (to follow `Class.field.attr`)
    annotations: dict[str, set[str]] = field(default_factory=dict)


@dataclass
class ModuleInfo:
    name: str  # proxy.fleet.moves.mover
    path: Path
    names: set[str] = field(default_factory=set)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    # a name imported from our code -> (the module, the name there)
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)
    star_imports: list[str] = field(default_factory=list)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ours(module: str) -> str | None:
    """An imported module's name in the source tree, if it is ours."""
    if module == "gym_proxy" or module.startswith("gym_proxy."):
        rest = module.removeprefix("gym_proxy").removeprefix(".")
        return rest if rest.split(".")[0] in SOURCE_DIRS else module
    return None


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _target_names(element)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A body's statements, looking into `if`, `try` and `with` (still top level)."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If):
            yield from _statements(statement.body)
            yield from _statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _statements(statement.body)
            for handler in statement.handlers:
                yield from _statements(handler.body)
            yield from _statements(statement.orelse)
            yield from _statements(statement.finalbody)
        elif isinstance(statement, ast.With):
            yield from _statements(statement.body)


def _annotated_classes(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\w+", node.value))  # a quoted forward reference
    return names


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


def _class_info(node: ast.ClassDef, module: str, path: Path) -> ClassInfo:
    bases = [b for b in (_base_name(base) for base in node.bases) if b is not None]
    info = ClassInfo(node.name, module, path, node.lineno, bases)
    for statement in _statements(node.body):
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            info.members.add(statement.name)
            info.annotations[statement.name] = _annotated_classes(statement.returns)
        elif isinstance(statement, ast.ClassDef):
            info.members.add(statement.name)
            info.nested[statement.name] = _class_info(statement, module, path)
        elif isinstance(statement, ast.Assign):
            for target in statement.targets:
                info.members.update(_target_names(target))
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    info.members.update(
                        n.value
                        for n in ast.walk(statement.value)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    )
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            info.members.add(statement.target.id)
            info.annotations[statement.target.id] = _annotated_classes(statement.annotation)
    for method in node.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(method):
            if isinstance(inner, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                for target in targets:
                    for element in ast.walk(target):
                        if (
                            isinstance(element, ast.Attribute)
                            and isinstance(element.value, ast.Name)
                            and element.value.id in ("self", "cls")
                        ):
                            info.members.add(element.attr)
                            if isinstance(inner, ast.AnnAssign) and element is target:
                                info.annotations[element.attr] = _annotated_classes(
                                    inner.annotation
                                )
            elif (
                isinstance(inner, ast.Call)
                and len(inner.args) >= 2
                and isinstance(inner.args[1], ast.Constant)
                and isinstance(inner.args[1].value, str)
                and (
                    (isinstance(inner.func, ast.Name) and inner.func.id == "setattr")
                    or (isinstance(inner.func, ast.Attribute) and inner.func.attr == "__setattr__")
                )
            ):
                info.members.add(inner.args[1].value)
    return info


def _module_info(path: Path, root: Path) -> tuple[ModuleInfo, ast.Module]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    info = ModuleInfo(_module_name(path, root), path)
    for statement in _statements(tree.body):
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            info.names.add(statement.name)
        elif isinstance(statement, ast.ClassDef):
            info.names.add(statement.name)
            info.classes[statement.name] = _class_info(statement, info.name, path)
        elif isinstance(statement, ast.Assign):
            for target in statement.targets:
                info.names.update(_target_names(target))
        elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
            info.names.update(_target_names(statement.target))
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                info.names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(statement, ast.ImportFrom):
            origin = _ours(statement.module or "") if statement.level == 0 else None
            for alias in statement.names:
                if alias.name == "*":
                    if origin is not None:
                        info.star_imports.append(origin)
                    continue
                info.names.add(alias.asname or alias.name)
                if origin is not None:
                    info.imported[alias.asname or alias.name] = (origin, alias.name)
    return info, tree


def python_files(root: Path = REPO) -> list[Path]:
    """The source tree's Python files (gym_proxy/'s own; its folders link to the others)."""
    return sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py")) + sorted(
        (root / "gym_proxy").glob("*.py")
    )


class Resolver:
    """Our code's modules, classes and strings, read once from the tree at `root`;
    `why_not` resolves a name."""

    def __init__(self, root: Path = REPO) -> None:
        self.root = root
        self.modules: dict[str, ModuleInfo] = {}
        self.classes: dict[str, list[ClassInfo]] = {}
        self.strings: set[str] = set()
        for path in python_files(root):
            info, tree = _module_info(path, root)
            self.modules[info.name] = info
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if DOTTED.fullmatch(node.value) and node.value.split(".")[0] in ROOTS:
                        self.strings.add(node.value)
            for cls in self._all_classes(info.classes.values()):
                self.classes.setdefault(cls.name, []).append(cls)

    def _all_classes(self, classes: Iterable[ClassInfo]) -> Iterator[ClassInfo]:
        for cls in classes:
            yield cls
            yield from self._all_classes(cls.nested.values())

    def _where(self, path: Path, line: int) -> str:
        return f"{path.relative_to(self.root)}:{line}"

    def counts(self, name: str) -> bool:
        """Whether a dotted name is one the docs give our code (module docstring)."""
        first = name.split(".")[0]
        return first in ROOTS or first in self.classes

    # --- resolving ----------------------------------------------------------------------

    def why_not(self, name: str) -> str | None:
        """None when `name` resolves; else why not, in one line."""
        if name in self.strings:
            return None
        parts = name.split(".")
        if parts[0] in ROOTS:
            return self._from_module_path(parts)
        if parts[0] in self.classes:
            return self._in_classes(self.classes[parts[0]], parts[1:], parts[0])
        return f"{parts[0]} is neither a package of ours nor a class our code defines"

    def _from_module_path(self, parts: list[str]) -> str | None:
        if parts[0] == "gym_proxy" and len(parts) > 1 and parts[1] in SOURCE_DIRS:
            parts = parts[1:]  # gym_proxy.proxy.x is the source tree's proxy.x
        for end in range(len(parts), 0, -1):
            module = ".".join(parts[:end])
            if module in self.modules:
                return self._in_module(module, parts[end:])
        return f"no module {parts[0]} in the source tree"

    def _in_module(self, module: str, rest: list[str], seen: int = 0) -> str | None:
        """Why `rest` is not a name in `module` (None when it is); `seen` bounds the
        imports followed, should two modules import a name from each other."""
        if not rest:
            return None
        info = self.modules[module]
        head = rest[0]
        if f"{module}.{head}" in self.modules:  # a submodule the longest match passed over
            return self._in_module(f"{module}.{head}", rest[1:], seen)
        if head in info.classes:
            return self._in_classes([info.classes[head]], rest[1:], f"{module}.{head}")
        if head in info.imported and seen < 10:
            origin, original = info.imported[head]
            if origin in self.modules:
                return self._in_module(origin, [original, *rest[1:]], seen + 1)
            if f"{origin}.{original}" in self.modules:
                return self._in_module(f"{origin}.{original}", rest[1:], seen + 1)
            return f"{module} imports {head} from {origin}, which is not in the source tree"
        if head in info.names:
            if len(rest) > 1:
                return (
                    f"{module}.{head} ({info.path.relative_to(self.root)}) is not a class or a "
                    f"module: .{'.'.join(rest[1:])} cannot be followed"
                )
            return None
        for origin in info.star_imports:
            if origin in self.modules and self._in_module(origin, rest, seen + 1) is None:
                return None
        return f"module {module} ({info.path.relative_to(self.root)}) has no top-level name {head}"

    def _lookup(self, cls: ClassInfo, attr: str, seen: set[int]) -> ClassInfo | None:
        """The class (cls or a base of ours) whose body or methods give it `attr`."""
        if id(cls) in seen:
            return None
        seen.add(id(cls))
        if attr in cls.members:
            return cls
        for base in cls.bases:
            for candidate in self.classes.get(base, []):
                found = self._lookup(candidate, attr, seen)
                if found is not None:
                    return found
        return None

    def _in_classes(self, classes: list[ClassInfo], rest: list[str], label: str) -> str | None:
        if not rest:
            return None
        attr = rest[0]
        found = [o for o in (self._lookup(cls, attr, set()) for cls in classes) if o is not None]
        if not found:
            where = ", ".join(
                f"{c.module}.{c.name} ({self._where(c.path, c.line)})" for c in classes
            )
            bases = sorted({b for c in classes for b in c.bases})
            of_bases = f"; bases {', '.join(bases)}" if bases else ""
            return f"class {where} has no attribute {attr} (nor its bases of our code{of_bases})"
        if len(rest) == 1:
            return None
        following: list[ClassInfo] = []
        for owner in found:
            if attr in owner.nested:
                following.append(owner.nested[attr])
            for named in owner.annotations.get(attr, set()):
                following.extend(self.classes.get(named, []))
        if not following:
            return (
                f"{label}.{attr} is not a nested class or a field annotated with a class of "
                f"ours: .{'.'.join(rest[1:])} cannot be followed"
            )
        return self._in_classes(following, rest[1:], f"{label}.{attr}")

    # --- finding the spans --------------------------------------------------------------

    def names_in(self, path: Path, text: str, first_line: int = 1) -> Iterator[Span]:
        """The spans of `text` (starting at `first_line` of `path`) that name our code."""
        for match in SPAN.finditer(text):
            called = NAME_SPAN.fullmatch(match.group(1).strip())
            if called is None:
                continue
            name = called.group(1)
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES or not self.counts(name):
                continue
            line = first_line + text.count("\n", 0, match.start())
            yield Span(path, line, name, match.group(1), self.root)

    def code_names_in(self, path: Path, text: str, first_line: int = 1) -> Iterator[Span]:
        """What code in `text` imports from gym_proxy or runs with `-m`: the examples a
        reader copies, in a fenced block or a span with spaces, which `names_in` skips."""
        for match in IMPORT_LINE.finditer(text):
            line = first_line + text.count("\n", 0, match.start())
            for imported in match.group(2).split(","):
                name = imported.strip().split(" as ")[0].strip()
                if name:
                    yield Span(path, line, f"{match.group(1)}.{name}", match.group(0), self.root)
        for match in RUN_MODULE.finditer(text):
            line = first_line + text.count("\n", 0, match.start())
            yield Span(path, line, match.group(1), match.group(0).strip(), self.root)

    def page_spans(self, path: Path, text: str | None = None) -> Iterator[Span]:
        """A Markdown page's inline code spans (fenced blocks are commands and configs),
        and the imports and `-m` runs of its code, fenced or not."""
        text = path.read_text(encoding="utf-8") if text is None else text
        spans = list(self.names_in(path, FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)))
        spans.extend(self.code_names_in(path, text))
        yield from sorted(spans, key=lambda span: span.line)

    def source_spans(self, path: Path, text: str | None = None) -> Iterator[Span]:
        """A Python file's docstrings (every string statement) and comments."""
        text = path.read_text(encoding="utf-8") if text is None else text
        lines = text.splitlines(keepends=True)
        spans: list[Span] = []
        for node in ast.walk(ast.parse(text, str(path))):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and node.end_lineno is not None
            ):
                # The literal as written, so a span's line is counted in the file.
                literal = "".join(lines[node.lineno - 1 : node.end_lineno])
                spans.extend(self.names_in(path, literal, node.lineno))
                spans.extend(self.code_names_in(path, literal, node.lineno))
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                spans.extend(self.names_in(path, token.string, token.start[0]))
                spans.extend(self.code_names_in(path, token.string, token.start[0]))
        yield from sorted(spans, key=lambda span: span.line)

    def stale(self, spans: Iterable[Span]) -> list[str]:
        """One line per span that does not resolve: where, the span, and why."""
        failures = []
        for span in spans:
            why = self.why_not(span.name)
            if why is not None:
                failures.append(f"{span.where()}: `{span.text}`: {why}")
        return failures


def every_span(resolver: Resolver) -> Iterator[Span]:
    for page in PAGES:
        yield from resolver.page_spans(page)
    for path in python_files(resolver.root):
        yield from resolver.source_spans(path)
