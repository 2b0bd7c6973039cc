"""Every dotted name the docs give our code resolves (`tests/doc_names.py` says which spans
count and how they resolve): a rename that leaves a page, a docstring or a comment naming
what is gone fails here, with the file, the line, the span and why. In the fast tier, so
the commit that renames is the one that fails."""

from __future__ import annotations

import ast
import textwrap

import pytest

from tests.doc_names import PAGES, REPO, Resolver, every_span, python_files

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def resolver() -> Resolver:
    return Resolver()


def test_every_named_name_resolves(resolver):
    stale = resolver.stale(every_span(resolver))
    assert not stale, "names that do not resolve (fix the text to say what the code is):\n" + (
        "\n".join(stale)
    )


def test_the_scan_finds_the_names_the_docs_give(resolver):
    """Not vacuous: the pages and the sources name plenty of our code, of every kind."""
    on_pages = [s for page in PAGES for s in resolver.page_spans(page)]
    in_sources = [s for path in python_files() for s in resolver.source_spans(path)]
    assert len(on_pages) >= 20 and len(in_sources) >= 50, (len(on_pages), len(in_sources))
    names = {s.name for s in on_pages + in_sources}
    assert any(n.split(".")[0] in resolver.classes for n in names)  # Class.attr
    assert any(n.startswith("gym_proxy.") for n in names)
    assert any(n.startswith(("proxy.", "worker.", "coordinator.")) for n in names)


def test_the_worker_package_names_every_module_of_it():
    """worker/__init__.py's docstring is the map of the package: a new module goes on it
    (and every name on it resolves, as everywhere)."""
    folder = REPO / "worker"
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    modules = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    packages = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    missing = [m for m in sorted(modules + packages) if f"`worker.{m}`" not in docstring]
    assert len(modules) > 20 and not missing, missing


def _made_stale(name: str) -> str:
    return name + "_no_such_name"


@pytest.mark.parametrize("kind", ["Class.attr", "module.Name", "gym_proxy.module"])
def test_a_real_name_made_stale_fails(resolver, kind):
    """As the site build fails on a broken anchor: a page naming a real name of each kind,
    with its last part changed, fails at that line, naming the span."""
    spans = [s for page in PAGES for s in resolver.page_spans(page)]
    if kind == "Class.attr":
        real = next(s for s in spans if s.name.split(".")[0] in resolver.classes)
    elif kind == "module.Name":
        real = next(s for s in spans if s.name.startswith(("proxy.", "worker.", "coordinator.")))
    else:
        real = next(s for s in spans if s.name.startswith("gym_proxy."))
    assert resolver.why_not(real.name) is None
    page = REPO / "docs" / "design.md"
    text = page.read_text(encoding="utf-8")
    line = text.count("\n") + 2
    text += f"\nAs before, `{_made_stale(real.name)}` does it.\n"
    before = resolver.stale(resolver.page_spans(page))
    *after, failure = resolver.stale(resolver.page_spans(page, text))
    assert after == before
    assert failure.startswith(f"docs/design.md:{line}: `{_made_stale(real.name)}`: "), failure


# --- the rules, on a tree of their own ---------------------------------------------------

TREE = {
    "proxy/__init__.py": "",
    "proxy/base.py": """
        import enum


        class Base:
            inherited = 1

            def __init__(self):
                self.made_in_init = 0


        class Color(enum.Enum):
            RED = 1
        """,
    "proxy/things.py": '''
        """Uses `Thing.method` and `Thing.gone`."""

        from gym_proxy.proxy.base import Base
        from gym_proxy.proxy.base import Color as Colour

        CONSTANT = 1  # see `proxy.things.CONSTANT` and `proxy.things.NOT_HERE`


        class Part:
            piece = 1


        class Thing(Base):
            field: Part | None

            def method(self):
                """Sets `Thing.later`.

                And names `Part.nothing` two lines down."""
                self.later = 1

            @property
            def prop(self):
                return 1

            class Inner:
                deep = 1


        def helper():
            pass
        ''',
    "worker/__init__.py": "",
    "worker/twice.py": """
        class Thing:
            only_here = 1
        """,
    "coordinator/__init__.py": "",
    "gym_proxy/__init__.py": """
        import logging

        log = logging.getLogger("gym_proxy.things")
        """,
}


@pytest.fixture
def tree(tmp_path) -> Resolver:
    for name, text in TREE.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return Resolver(tmp_path)


@pytest.mark.parametrize(
    "name",
    [
        "proxy.things",
        "gym_proxy.proxy.things.Thing",  # the installed name of the same module
        "proxy.things.Thing.method",
        "proxy.things.CONSTANT",
        "proxy.things.helper",
        "proxy.things.Base.inherited",  # imported from our code: followed
        "proxy.things.Colour.RED",  # imported under another name
        "Color.RED",  # an enum member
        "Thing.inherited",  # from a base class of ours
        "Thing.made_in_init",  # assigned to self in the base's method
        "Thing.later",  # assigned to self in its own method
        "Thing.prop",
        "Thing.field",
        "Thing.field.piece",  # through the field's annotation
        "Thing.Inner.deep",
        "Thing.only_here",  # the other class named Thing has it
        "gym_proxy.things",  # a logger name our code uses
    ],
)
def test_a_name_of_our_code_resolves(tree, name):
    assert tree.why_not(name) is None


@pytest.mark.parametrize(
    "name, why",
    [
        ("proxy.nothing", "module proxy (proxy/__init__.py) has no top-level name nothing"),
        ("proxy.things.Missing", "module proxy.things (proxy/things.py) has no top-level name"),
        ("Thing.missing", "has no attribute missing (nor its bases of our code; bases Base)"),
        ("proxy.things.Thing.Inner.shallow", "has no attribute shallow"),
        ("proxy.things.helper.attr", "proxy.things.helper (proxy/things.py) is not a class"),
        ("Thing.method.attr", "Thing.method is not a nested class or a field annotated"),
        ("gym_proxy.other", "module gym_proxy (gym_proxy/__init__.py) has no top-level name"),
        ("Unknown.attr", "Unknown is neither a package of ours nor a class our code defines"),
    ],
)
def test_a_stale_name_fails_and_says_why(tree, name, why):
    assert why in (tree.why_not(name) or "")


def test_which_spans_of_a_page_count(tree, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`proxy.things.Thing.method()` and `Thing.later(x)` resolve; `Thing.gone` does not\n"
        "not names: `a Thing.b`, `Thing.x=1`, `proxy/things.py`, `proxy.things.py`, `'Thing.x'`\n"
        "not ours: `json.dumps`, `Other.attr`, `self.attr`\n"
        "```python\nThing.in_a_fence\nfrom gym_proxy.proxy.things import Thing, Gone as G\n```\n"
        "`gym_proxy.proxy.things.Nope` after the fence; `python -m gym_proxy.proxy.absent`\n",
        encoding="utf-8",
    )
    spans = list(tree.page_spans(page))
    assert [(s.line, s.name) for s in spans] == [
        (1, "proxy.things.Thing.method"),
        (1, "Thing.later"),
        (1, "Thing.gone"),
        (6, "gym_proxy.proxy.things.Thing"),  # what a fenced example imports
        (6, "gym_proxy.proxy.things.Gone"),
        (8, "gym_proxy.proxy.things.Nope"),
        (8, "gym_proxy.proxy.absent"),  # what it runs
    ]
    assert tree.stale(spans) == [
        "page.md:1: `Thing.gone`: class proxy.things.Thing (proxy/things.py:13), "
        "worker.twice.Thing (worker/twice.py:1) has no attribute gone (nor its bases of our "
        "code; bases Base)",
        "page.md:6: `from gym_proxy.proxy.things import Thing, Gone as G`: module proxy.things "
        "(proxy/things.py) has no top-level name Gone",
        "page.md:8: `gym_proxy.proxy.things.Nope`: module proxy.things (proxy/things.py) has "
        "no top-level name Nope",
        "page.md:8: `-m gym_proxy.proxy.absent`: module proxy (proxy/__init__.py) has no "
        "top-level name absent",
    ]


def test_docstrings_and_comments_are_scanned_at_their_lines(tree, tmp_path):
    path = tmp_path / "proxy" / "things.py"
    stale = tree.stale(tree.source_spans(path))
    assert [line.split(": ")[0:2] for line in stale] == [
        ["proxy/things.py:1", "`Thing.gone`"],
        ["proxy/things.py:6", "`proxy.things.NOT_HERE`"],
        ["proxy/things.py:19", "`Part.nothing`"],
    ]


def test_the_tree_is_the_source_tree():
    """The resolver reads the folders the installed package links to."""
    for link in ("proxy", "worker", "coordinator"):
        assert (REPO / "gym_proxy" / link).resolve() == (REPO / link).resolve()
    assert REPO / "proxy" / "config.py" in python_files()
