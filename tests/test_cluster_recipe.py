"""The dask recipe of doc/user_guide/gpu_and_clusters.rst runs as pasted, as a script."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "doc" / "user_guide" / "gpu_and_clusters.rst"


def _recipe():
    blocks = re.findall(
        r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", PAGE.read_text(encoding="utf-8")
    )
    recipes = [block for block in blocks if "LocalCluster" in block]
    assert len(recipes) == 1, "one dask recipe on the cluster page"
    return "\n".join(line[4:] for line in recipes[0].splitlines())


@pytest.mark.slow
def test_dask_recipe_runs_as_a_script(tmp_path):
    pytest.importorskip("distributed")
    script = tmp_path / "gram_on_dask.py"
    script.write_text(_recipe(), encoding="utf-8")
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shape, residual = done.stdout.strip().splitlines()[-1].split(") ")
    assert shape == "(300, 300"
    assert float(residual) < 1e-9
