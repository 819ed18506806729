"""The studies' registry of ``benchmarks/run.py``: every script in it, and the list.

Fast: no study is run; ``run.py`` is imported as a module (its ``main`` runs only
as a script) and run once without arguments.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RUN = BENCHMARKS / "run.py"


def scripts():
    """The study scripts: ``benchmarks/*.py`` but ``run.py`` and private helpers."""
    return sorted(
        path.name
        for path in BENCHMARKS.glob("*.py")
        if path.name != "run.py" and not path.name.startswith("_")
    )


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("benchmarks_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_is_registered(run):
    registered = {script for script, _ in run.STUDIES.values()}
    missing = [name for name in scripts() if name not in registered]
    assert not missing, f"not in run.py's STUDIES: {missing}"


def test_every_registered_script_exists_once(run):
    registered = [script for script, _ in run.STUDIES.values()]
    assert len(registered) == len(set(registered)), "a script registered twice"
    for name, (script, about) in run.STUDIES.items():
        assert (BENCHMARKS / script).is_file(), f"{name}: no benchmarks/{script}"
        assert not script.startswith("_") and script != "run.py", name
        assert about and "\n" not in about, f"{name}: a one-line description"
        assert '"--quick"' in (BENCHMARKS / script).read_text(), f"{name}: no --quick"


def test_every_study_is_in_one_group(run):
    grouped = [name for names in run.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(run.STUDIES), "GROUPS and STUDIES differ"


def test_the_list_without_arguments():
    done = subprocess.run(
        [sys.executable, str(RUN)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    for name in scripts():
        assert f"({name})" in done.stdout, name


def test_an_unknown_study_is_refused():
    done = subprocess.run(
        [sys.executable, str(RUN), "no-such-study"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "no-such-study" in done.stderr
