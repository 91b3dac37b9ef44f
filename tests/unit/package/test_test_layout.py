"""The test tree mirrors the package: a test file's place says what it tests, and its
folder sets its tier (``tests/integration`` is the ``integration`` tier)."""

from __future__ import annotations

from conftest import INTEGRATION_DIR, REPO_DIR, TESTS_DIR

PACKAGE_DIR = REPO_DIR / "python" / "dflop"


def test_every_test_file_is_in_a_folder_that_names_what_it_tests():
    units = {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()}
    units.add("package")  # the modules directly in dflop
    misplaced = []
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        where = path.relative_to(TESTS_DIR).parts
        if where[0] == "integration" and len(where) == 2:
            continue
        if where[0] == "unit" and len(where) == 3 and where[1] in units:
            continue
        misplaced.append("/".join(where))
    assert not misplaced, (
        "test files belong in tests/unit/<package>/ (one of "
        f"{', '.join(sorted(units))}) or tests/integration/: {misplaced}"
    )


def test_test_file_names_are_unique():
    # pytest's default import mode puts each test folder on sys.path: equal names clash
    names = [p.name for p in TESTS_DIR.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_integration_tier_is_its_folder(request):
    # this file is in tests/unit: not marked; a test under INTEGRATION_DIR would be
    assert request.node.get_closest_marker("integration") is None
    assert INTEGRATION_DIR.is_dir() and any(INTEGRATION_DIR.glob("test_*.py"))


def test_a_run_past_its_budget_fails_naming_it():
    """.ci/run's guard: with DFLOP_SUITE_BUDGET_S set, a run that takes longer fails (its
    tests passed) and says by how much; within the budget it passes."""
    import os
    import subprocess
    import sys

    this = f"{__file__}::test_test_file_names_are_unique"

    def run(budget_s: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", this],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_DIR,
            env={**os.environ, "DFLOP_SUITE_BUDGET_S": budget_s, "PYTEST_ADDOPTS": ""},
        )

    over = run("0.001")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "1 passed" in over.stdout
    assert "over its budget of 0 s (DFLOP_SUITE_BUDGET_S)" in over.stdout
    within = run("600")
    assert within.returncode == 0 and "over its budget" not in within.stdout, within.stdout
