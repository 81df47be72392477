"""The built wheel, shared by the packaging tests: built once per test process from a copy of the
checkout's build inputs (offline, without build isolation: the dev extra brings setuptools and
wheel)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

# What building the wheel reads from the checkout (``pyproject.toml`` names the README).
BUILD_INPUTS = ("pyproject.toml", "README.md", "email_platform", "analytics")


def run(*command: str | Path, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, check=False, **kwargs
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the checkout's build inputs, symlinks kept as they are in git.

    A copy, because building in place writes ``build/`` and ``*.egg-info`` into the checkout,
    and a stale ``build/lib`` would carry files into the wheel that the checkout no longer has.
    """
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation",
        "--disable-pip-version-check", "--quiet", "--wheel-dir", dist, source,
    )  # fmt: skip
    (built,) = dist.glob("email_platform-*.whl")
    return built
