"""docs/architecture.md names what it describes, and those names still exist.

The design record is read by whoever carries the code on: a module row naming a function that
was renamed, or an invariant proven by a test that was split or deleted, tells them something
false. Every backticked code name is checked against the package's source (parsed, not
imported): `module.name` must be defined at the top of metanode/module.py, `Class.member` must
be defined in the class or a class it derives from (a method, a class attribute or an attribute
set on `self`), and a bare name in a module's row of the Modules table must occur in the package
or the plugins. Every test named (`test_x.py::test_name`, then `::test_other` or `test_other`
after it) must be a test function of that file. Spans that are not code (a setting, a slug, a
table's column `claim_rows.log_seq`, a file name) do not look like either and are left alone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

SPAN = re.compile(r"`([^`]+)`")
TEST_FILE = re.compile(r"^(?:tests/)?(test_\w+\.py)(?:::(test_\w+\*?))?(?:\[.*\])?$")
TEST_NAME = re.compile(r"^(?:::)?(test_\w+\*?)(?:\[.*\])?$")
DOTTED = re.compile(r"^([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
BARE = re.compile(r"^([A-Za-z_]\w{2,})(?:\(.*\))?$")
MODULE_ROW = re.compile(r"^\| `(\w+)\.py` \|")
NOT_CODE = re.compile(r"\.(py|db|md|json|toml|sock|key|css|js|html)$")


def _assigned(targets: list[ast.expr]) -> Iterator[str]:
    for target in targets:
        yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))


def _defined(body: list[ast.stmt]) -> set[str]:
    """The names a module or class body defines at its own level (imports included)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(_assigned(node.targets))
        elif isinstance(node, ast.AnnAssign):
            names.update(_assigned([node.target]))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's own members: its body's names and every `self.x = …` in its methods."""
    names = _defined(cls.body)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


def _base_names(cls: ast.ClassDef) -> list[str]:
    out = []
    for base in cls.bases:
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        if isinstance(base, ast.Name):
            out.append(base.id)
        elif isinstance(base, ast.Attribute):
            out.append(base.attr)
    return out


@dataclass
class Code:
    """What the package defines: each module's top-level names and each class's members."""

    modules: dict[str, set[str]] = field(default_factory=dict)
    classes: dict[str, list[ast.ClassDef]] = field(default_factory=dict)
    text: str = ""

    @classmethod
    def read(cls, root: Path) -> Code:
        code = cls()
        sources = []
        for path in sorted((root / "metanode").glob("*.py")):
            source = path.read_text()
            sources.append(source)
            tree = ast.parse(source)
            code.modules[path.stem] = _defined(tree.body)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    code.classes.setdefault(node.name, []).append(node)
        sources += [p.read_text() for p in sorted((root / "plugins").rglob("*.py"))]
        code.text = "\n".join(sources)
        return code

    def has_member(self, class_name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        """`member` is defined by a class of that name or by one of its bases in the package."""
        for cls in self.classes.get(class_name, []):
            if member in _members(cls):
                return True
            bases = [b for b in _base_names(cls) if b not in seen]
            if any(self.has_member(b, member, seen | {class_name}) for b in bases):
                return True
        return False

    def dotted_exists(self, parts: list[str]) -> bool | None:
        """Whether `a.b[.c]` names something that exists; None when it is not a code name."""
        head, member = parts[0], parts[1]
        if head in self.modules:
            if member not in self.modules[head]:
                return False
            return len(parts) == 2 or self.has_member(member, parts[2])
        if head in self.classes:
            return self.has_member(head, member)
        if head[0].isupper():  # a class that is not (or is no longer) in the package
            return False
        return None


def defined_tests(root: Path) -> dict[str, set[str]]:
    """Each test module's test function names (a parametrised one by its bare name)."""
    out = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        out[path.name] = {
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")
        }
    return out


def _test_exists(name: str, names: set[str]) -> bool:
    if name.endswith("*"):  # `test_viewer_*`: the tests of that prefix
        return any(n.startswith(name[:-1]) for n in names)
    return name in names


def missing_names(doc: str, code: Code, tests: dict[str, set[str]]) -> list[str]:
    """Every backticked name of `doc` that the code or the tests no longer define, by line.

    A test named without its file (`::test_b` or `test_b`) belongs to the file named last on
    the same line (a table row); a line naming none continues a sentence begun above, so any
    test module may hold it.
    """
    every_test = set().union(*tests.values())
    problems = []
    for number, line in enumerate(doc.splitlines(), 1):
        row = MODULE_ROW.match(line)
        in_file: str | None = None
        for span in (s.strip() for s in SPAN.findall(line)):
            where = f"architecture.md:{number}: `{span}`"
            if file_match := TEST_FILE.match(span):
                in_file, name = file_match.group(1), file_match.group(2)
                if in_file not in tests:
                    problems.append(f"{where}: no tests/{in_file}")
                elif name and not _test_exists(name, tests[in_file]):
                    problems.append(f"{where}: no such test in {in_file}")
            elif name_match := TEST_NAME.match(span):
                names = tests.get(in_file, set()) if in_file else every_test
                if not _test_exists(name_match.group(1), names):
                    problems.append(f"{where}: no such test in {in_file or 'tests/'}")
            elif problem := _code_problem(span, code, in_module_row=bool(row)):
                problems.append(f"{where}: {problem}")
    return problems


def _code_problem(span: str, code: Code, in_module_row: bool) -> str | None:
    """Why a span that names code names nothing (None: it exists, or is not code)."""
    if NOT_CODE.search(span):
        return None
    if dotted := DOTTED.match(span):
        parts = [dotted.group(1), *dotted.group(2).split(".")[1:]]
        return "not defined in the package" if code.dotted_exists(parts) is False else None
    bare = BARE.match(span)
    if in_module_row and bare and not re.search(rf"\b{re.escape(bare.group(1))}\b", code.text):
        return "in no module of the package or the plugins"
    return None


def test_every_name_in_the_architecture_exists() -> None:
    problems = missing_names(ARCHITECTURE.read_text(), Code.read(ROOT), defined_tests(ROOT))
    assert problems == [], "\n".join(problems)


def test_the_check_sees_a_name_that_is_gone() -> None:
    """The check is not vacuous: each kind of stale name in a doc line is found."""
    doc = "\n".join(
        [
            "| `node.py` | I/O | `Node.no_such_method`, `renamed_helper_xyz`, `Node.ingest_wire` |",
            "| x | `cache.no_such_function`, `cache.CacheStore.nope`, `Gone.attr`, `db.Store` |",
            "| y | `TruthStore.configured` (from `db.Store`) | `test_lint.py::test_gone`, "
            "`::test_ruff_is_clean`, `test_also_gone`, `test_nowhere.py` |",
        ]
    )
    problems = missing_names(doc, Code.read(ROOT), defined_tests(ROOT))
    found = [p.split("`")[1] for p in problems]
    assert found == [
        "Node.no_such_method",
        "renamed_helper_xyz",
        "cache.no_such_function",
        "cache.CacheStore.nope",
        "Gone.attr",
        "test_lint.py::test_gone",
        "test_also_gone",
        "test_nowhere.py",
    ]


def test_every_module_has_its_row_in_the_modules_table() -> None:
    """A module added without a row (or a row left for a module removed) is caught: the table is
    where a reader learns what each module owns and its kind (pure, store, I/O)."""
    rows = {m.group(1) for m in map(MODULE_ROW.match, ARCHITECTURE.read_text().splitlines()) if m}
    modules = {p.stem for p in (ROOT / "metanode").glob("*.py")} - {"__init__", "__main__"}
    assert sorted(modules - rows) == [], "modules without a row"
    assert sorted(rows - modules) == [], "rows of no module"
