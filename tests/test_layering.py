"""The package's import graph has floors, and every arrow between subpackages points down.

Each private subpackage sits on a floor; a module may import another subpackage only
if it sits on a lower floor, only through that subpackage's face (its
``__init__``), and only at module level (an import inside a function would hide a
cycle rather than remove it). Read from the source with :mod:`ast`, so the test
sees every import, also those that never run.
"""

import ast
import pathlib

import pytest

import sklearn_pathkernel

PACKAGE = pathlib.Path(sklearn_pathkernel.__file__).parent
NAME = PACKAGE.name

#: The floors, lowest first. A subpackage imports only from lower floors.
FLOORS = (
    ("_path", "_nn"),  # the recorded path and the network layers: nothing of ours below
    ("_training", "_engine"),  # training writes the path, the engine reads it
    ("_explain",),  # explanations ask the engine
    ("_estimators",),  # the scikit-learn estimators
    ("_recording",),  # the recorder's face and the recording of a user's loop
)
TOP = len(FLOORS)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def _modules(package):
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield path, parts[:-1] if is_package else parts, is_package


def _subpackage(parts):
    """The private subpackage a module (dotted parts) belongs to; None for the top."""
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOOR) else None


def _imports(package):
    """(file, line, importing module's parts, imported parts, at module level)."""
    for path, parts, is_package in _modules(package):
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = list(parts) if is_package else list(parts[:-1])
                    base = base[: len(base) - node.level + 1]
                    target = tuple(base) + tuple(
                        (node.module or "").split(".") if node.module else ()
                    )
                else:
                    target = tuple((node.module or "").split("."))
                targets = [target]
            elif isinstance(node, ast.Import):
                targets = [tuple(alias.name.split(".")) for alias in node.names]
            else:
                continue
            for target in targets:
                if target[0] == NAME:
                    yield path, node.lineno, parts, target, id(node) in top_level


def _cross_imports(package=PACKAGE):
    for path, line, here, target, top_level in _imports(package):
        source, destination = _subpackage(here), _subpackage(target)
        if destination is not None and source != destination:
            where = f"{path.relative_to(package.parent)}:{line}"
            yield where, source, destination, target, top_level


def _upward(package=PACKAGE):
    return [
        f"{where}: {source or 'the top'} (floor {FLOOR.get(source, TOP)}) imports "
        f"{destination} (floor {FLOOR[destination]})"
        for where, source, destination, _, _ in _cross_imports(package)
        if FLOOR[destination] >= FLOOR.get(source, TOP)
    ]


def test_every_subpackage_has_a_floor():
    found = {path.parent.name for path in PACKAGE.glob("_*/__init__.py")}
    assert found == set(FLOOR), f"subpackages without a floor: {found - set(FLOOR)}"


def test_every_arrow_points_down():
    wrong = _upward()
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


def test_imports_across_subpackages_use_the_face():
    wrong = [
        f"{where}: imports {'.'.join(target)}, not {NAME}.{destination}"
        for where, _, destination, target, _ in _cross_imports()
        if len(target) > 2
    ]
    assert not wrong, "imports that reach into another subpackage:\n" + "\n".join(wrong)


def test_no_import_across_subpackages_hides_in_a_function():
    wrong = [
        f"{where}: imports {destination} inside a function or class"
        for where, _, destination, _, top_level in _cross_imports()
        if not top_level
    ]
    assert not wrong, "imports that would hide a cycle:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(FLOOR))
def test_each_face_says_what_it_is_and_what_it_exports(name):
    module = ast.parse((PACKAGE / name / "__init__.py").read_text())
    docstring = ast.get_docstring(module) or ""
    assert len(docstring.split()) >= 8, f"{name}/__init__.py: say in a sentence what it is"
    exports = [
        node
        for node in module.body
        if isinstance(node, ast.Assign) and any(t.id == "__all__" for t in node.targets)
    ]
    assert exports, f"{name}/__init__.py exports no __all__"


def test_the_checker_finds_arrows_up_sideways_and_hidden(tmp_path):
    """The graph walk itself, on a made-up package named like ours."""
    package = tmp_path / NAME
    for name in ("_path", "_engine", "_training"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from ._engine import thing\n")
    (package / "_path" / "_weights.py").write_text("from .._engine import up\n")
    (package / "_engine" / "_facade.py").write_text(
        "from .._path import fine\nfrom .._training._loop import sideways\n"
        "def f():\n    from sklearn_pathkernel._path._weights import hidden\n"
    )
    found = {
        (where, source, destination, top)
        for where, source, destination, _, top in _cross_imports(package)
    }
    assert (f"{NAME}/_path/_weights.py:1", "_path", "_engine", True) in found
    assert (f"{NAME}/_engine/_facade.py:4", "_engine", "_path", False) in found
    upward = _upward(package)
    assert len(upward) == 2  # _path -> _engine, _engine -> _training (same floor)
    assert any("_path/_weights.py:1" in line for line in upward)
    assert any("_engine/_facade.py:2" in line for line in upward)
