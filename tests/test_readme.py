"""The README's Python snippets run as written (what a new user copies first)."""

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


@pytest.mark.slow
def test_readme_snippets_run_and_are_exact():
    blocks = _python_blocks()
    assert len(blocks) >= 3, "the README's quickstart, grid-search and user-loop snippets"
    namespace = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102
    # The quickstart's identity and the user loop's certificate, as the README prints them.
    total = namespace["total"]
    assert np.abs(total - namespace["clf"].predict_log_proba(namespace["X"][:5])).max() < 1e-9
    assert namespace["parts"].residual.max() < 1e-9
    assert len(namespace["top"].to_frame()) > 0
    # The pipeline with the transformer's default estimator, tuned through nested parameters.
    grid = namespace["grid"]
    assert grid.best_estimator_.named_steps["epk"].estimator_.max_iter == 10
    assert grid.best_score_ > 0.9
