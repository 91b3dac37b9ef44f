"""Builds the native core's C++ unit tests with CMake and runs them with ctest.

The tests link against the core the Python package was built with (its build tree's
``libdflop_core.a``) when that library is newer than every core source, so the suite
compiles the tests only; otherwise (no build tree, or sources edited since) the core is
compiled too. ``.ci/run`` builds everything again from scratch under ASan + UBSan."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_DIR

REPO = REPO_DIR


def prebuilt_core(repo: Path = REPO) -> Path | None:
    """The package build tree's core library, if no source of the core is newer."""
    sources = [p for d in ("cpp/src", "cpp/include") for p in (repo / d).rglob("*") if p.is_file()]
    newest_source_s = max(p.stat().st_mtime for p in sources)
    built = sorted(
        (p for p in (repo / "build").glob("*/libdflop_core.a") if p.is_file()),
        key=lambda p: p.stat().st_mtime,
    )
    if built and built[-1].stat().st_mtime >= newest_source_s:
        return built[-1]
    return None


@pytest.mark.slow
def test_ctest_passes(tmp_path: Path) -> None:
    if shutil.which("cmake") is None or shutil.which("ctest") is None:
        pytest.skip("cmake/ctest not installed")
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    core = prebuilt_core()
    reuse = [f"-DDFLOP_PREBUILT_CORE={core}"] if core is not None else []
    subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), *generator, "-DDFLOP_BUILD_TESTS=ON", *reuse],
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
