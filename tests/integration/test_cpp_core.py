"""Builds the native core's C++ unit tests with CMake and runs them with ctest."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_DIR

REPO = REPO_DIR


@pytest.mark.slow
def test_ctest_passes(tmp_path: Path) -> None:
    if shutil.which("cmake") is None or shutil.which("ctest") is None:
        pytest.skip("cmake/ctest not installed")
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), *generator, "-DDFLOP_BUILD_TESTS=ON"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "-j2"], check=True, capture_output=True, timeout=900
    )
    result = subprocess.run(
        ["ctest", "--test-dir", str(build), "--output-on-failure"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
