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


def test_install_commands_stay_on_the_cpu_build():
    # The public index's Linux x86_64 torch is the CUDA build: the README's commands name
    # PyTorch's CPU index, and the constraint accepts only its "+cpu" build there.
    from packaging.requirements import Requirement

    commands = re.findall(r"^pip install .*$", README.read_text(encoding="utf-8"), re.M)
    assert len(commands) == 3, "the demo, test and documentation commands"
    for command in commands:
        assert "-c constraints.txt" in command
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in command
    lines = (README.parent / "constraints.txt").read_text(encoding="utf-8").splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]

    def pin_on(machine, system):
        environment = {"platform_machine": machine, "sys_platform": system}
        chosen = [pin for pin in pins if pin.marker is None or pin.marker.evaluate(environment)]
        assert len(chosen) == 1, (machine, system)
        return str(chosen[0].specifier)

    assert pin_on("x86_64", "linux").endswith("+cpu")
    assert pin_on("AMD64", "win32").endswith("+cpu")
    assert "+" not in pin_on("arm64", "darwin")
    assert "+" not in pin_on("aarch64", "linux")
