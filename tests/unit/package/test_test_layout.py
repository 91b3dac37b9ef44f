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
