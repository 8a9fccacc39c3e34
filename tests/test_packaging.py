"""What a wheel of metanode and of each plugin holds, checked against the tree without building.

An installed node (`pip install metanode-….whl`, no checkout) reads its templates, static
files and OpenAPI document from the installed package and finds its plugins through entry
points; a file the code reads but `[tool.setuptools.package-data]` does not match is missing
from the wheel only, so every test run from the checkout passes while the installed node
serves a 500 or a 404. The build backend (setuptools>=77) is not in the test environment
offline, so the wheel's file list is computed here from the globs setuptools expands.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from metanode.plugins import ENTRY_POINT_GROUP

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "metanode"
PLUGINS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())

# how the code names a file of its own package: `importlib.resources.files("metanode")` then
# `.joinpath("x")` or `/ "x"`, and Jinja2's `PackageLoader("metanode", "x")`
RESOURCE = re.compile(
    r'resources\.files\("metanode"\)\)?\s*(?:\.joinpath\(|/)\s*"([^"]+)"'
    r'|PackageLoader\("metanode",\s*"([^"]+)"\)'
)
# a read relative to the source file: works in the checkout, points nowhere in a wheel
# unless the file is package data (then `importlib.resources` says so)
SOURCE_RELATIVE = re.compile(r"Path\(__file__\)|dirname\(__file__\)")


def project(folder: Path) -> dict[str, Any]:
    """The parsed pyproject.toml of the distribution in `folder`."""
    with (folder / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


def data_files() -> set[Path]:
    """Each file of the package that setuptools puts in the wheel as package data: the files
    each `package-data` glob matches below the package (a matched folder adds nothing)."""
    globs = project(ROOT)["tool"]["setuptools"]["package-data"]["metanode"]
    return {path for glob in globs for path in PACKAGE.glob(glob) if path.is_file()}


def non_python_files(folder: Path) -> set[Path]:
    """The files below `folder` that are no Python source (nor its bytecode)."""
    return {
        path
        for path in folder.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }


def test_every_non_python_file_of_the_package_is_package_data() -> None:
    unmatched = non_python_files(PACKAGE) - data_files()
    assert not unmatched, f"not in [tool.setuptools.package-data], so not in the wheel: {unmatched}"


def test_every_package_data_glob_matches_a_file() -> None:
    globs = project(ROOT)["tool"]["setuptools"]["package-data"]["metanode"]
    stale = [g for g in globs if not any(p.is_file() for p in PACKAGE.glob(g))]
    assert not stale, f"package-data globs matching no file: {stale}"


def test_each_resource_the_code_reads_is_shipped() -> None:
    named = {
        (path.name, file or folder)
        for path in sorted(PACKAGE.glob("*.py"))
        for file, folder in RESOURCE.findall(path.read_text(encoding="utf-8"))
    }
    # the OpenAPI document (api.py), the static files and the templates (ui.py)
    assert {name for _, name in named} >= {"openapi.json", "static", "templates"}, named
    shipped = data_files()
    for module, name in named:
        resource = PACKAGE / name
        files = {resource} if resource.is_file() else non_python_files(resource)
        assert files, f"{module} reads {name}, which is no file or an empty folder"
        assert files <= shipped, f"{module} reads {files - shipped}, not in the wheel"


def test_no_code_reads_a_file_beside_its_source() -> None:
    sources = [*PACKAGE.glob("*.py"), *(ROOT / "plugins").rglob("*.py")]
    relative = [p.name for p in sources if SOURCE_RELATIVE.search(p.read_text(encoding="utf-8"))]
    assert not relative, f"read files by their source's path (use importlib.resources): {relative}"


def test_the_version_has_one_source() -> None:
    meta = project(ROOT)
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "metanode.__version__"}


def test_the_readme_and_the_license_ship_with_each_distribution() -> None:
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    for folder in [ROOT, *PLUGINS]:
        meta = project(folder)["project"]
        assert (folder / meta["readme"]).is_file(), folder
        assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"], folder
        assert (folder / "LICENSE").read_text(encoding="utf-8") == licence, folder


def test_each_extra_the_code_names_is_declared() -> None:
    extras = project(ROOT)["project"]["optional-dependencies"]
    texts = [p.read_text(encoding="utf-8") for p in [*PACKAGE.glob("*.py"), ROOT / "README.md"]]
    texts += [p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md")]
    named = {extra for text in texts for extra in re.findall(r"metanode\[(\w+)\]", text)}
    assert "postgresql" in named  # pg.py's refusal of a DSN without the driver
    assert named <= extras.keys(), f"named but not declared: {named - extras.keys()}"


def defines(module: Path, name: str) -> bool:
    """Whether the module's top level defines `name` (a class, a function or an assignment),
    read without importing it (the test environment's plugins are the main checkout's)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
    return False


def test_each_plugin_ships_its_package_and_its_entry_point() -> None:
    assert len(PLUGINS) == 5, PLUGINS
    for folder in PLUGINS:
        meta = project(folder)
        found = sorted(p.parent.name for p in folder.glob("*/__init__.py"))
        assert meta["tool"]["setuptools"]["packages"] == found, folder
        for package in found:
            assert not non_python_files(folder / package), f"{package}: no package-data declared"
        entries = meta["project"]["entry-points"][ENTRY_POINT_GROUP]
        assert entries, f"{folder.name}: no {ENTRY_POINT_GROUP} entry point"
        for target in entries.values():
            module, _, attr = target.partition(":")
            source = folder / module.replace(".", "/") / "__init__.py"
            assert source.is_file() and defines(source, attr), f"{folder.name}: {target}"


def test_no_plugin_requires_metanode() -> None:
    """The name "metanode" on PyPI is another project (1.0.x): a plugin wheel installed alone
    with "metanode" among its requirements pulled that one in. A plugin runs only inside the
    node's environment, so it leaves metanode out, as docs/plugins.md tells a third party."""
    for folder in PLUGINS:
        needs = [Requirement(r).name for r in project(folder)["project"]["dependencies"]]
        assert needs and "metanode" not in needs, folder.name
