"""The lanes (``tests/lanes.py``): where a test runs is the folder it lives in. Every test file
is in exactly one lane folder, each folder's ``conftest.py`` names its lane, no test module
imports another; on stand-in suites (no Ray), the ``service`` marker comes from the fixture
(``make test-fast`` deselects without a hand-written mark) and a test outside its lane fails
at once with a message naming where it belongs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .. import lanes
from ..lanes import FOLDERS, STAND_IN_INI, write_lane_folders

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
pytest_plugins = ["pytester"]


def test_every_test_file_lives_in_exactly_one_lane_folder():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 60
    outside = [str(f.relative_to(TESTS)) for f in files
               if f.parent.parent != TESTS or f.parent.name not in FOLDERS]
    assert outside == []
    # each folder's conftest.py names its own lane (folder_lane refuses another at import)
    for folder, lane in FOLDERS.items():
        text = (TESTS / folder / "conftest.py").read_text()
        named = re.search(r"folder_lane\(__file__, (\w+)\)", text)
        assert named and getattr(lanes, named.group(1)) == lane, folder
        assert (TESTS / folder / "__init__.py").exists()


def test_no_test_module_imports_another():
    imports = []
    for f in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                if any(n.split(".")[-1].startswith("test_") for n in names):
                    imports.append(f"{f.relative_to(TESTS)}: from {'.' * node.level}"
                                   f"{node.module or ''} import …")
            elif isinstance(node, ast.Import):
                imports += [f"{f.relative_to(TESTS)}: import {a.name}" for a in node.names
                            if a.name.split(".")[-1].startswith("test_")]
    assert imports == []


# The stand-in suites' conftest: the real hook, a stand-in for the session's service.
STAND_IN_CONFTEST = """
    import pytest

    from tests.conftest import (  # noqa: F401  the hooks tested
        pytest_collection_modifyitems, pytest_runtest_setup)

    @pytest.fixture
    def service():  # stands in for the session's Ray Serve app; says it started
        open("service-started", "w").close()

    @pytest.fixture
    def serve_reset(service):
        yield
"""


def stand_in(pytester, files: dict[str, str]) -> None:
    pytester.makeini(STAND_IN_INI)
    pytester.makeconftest(STAND_IN_CONFTEST)
    write_lane_folders(pytester.path)
    for name, text in files.items():
        (pytester.path / "tests" / name).write_text(text)


def test_tests_taking_service_are_marked_service(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    stand_in(pytester, {
        "service/test_a.py": "def test_takes_service(service):\n    pass\n\n\n"
                             "def test_takes_serve_reset(serve_reset):\n    pass\n",
        "no_ray/test_b.py": "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass"
                            "\n\n\ndef test_plain():\n    pass\n"})
    fast = pytester.runpytest_subprocess("-m", "not service and not slow", "-v", "tests")
    fast.assert_outcomes(passed=1, deselected=3)
    fast.stdout.fnmatch_lines(["*::test_plain PASSED*"])
    marked = pytester.runpytest_subprocess("-m", "service", "-v", "tests")
    marked.assert_outcomes(passed=2, deselected=2)
    marked.stdout.fnmatch_lines(["*::test_takes_service PASSED*",
                                 "*::test_takes_serve_reset PASSED*"])


# One stand-in suite holds every misplaced test (one pytest run: each run was ~10 s).
MISPLACED = {
    "no_ray/test_a.py": ("def test_x(service):\n    pass\n",
                         "tests/no_ray/test_a.py::test_x: takes the session's service, so it "
                         "belongs in tests/service/"),
    "own_ray/test_b.py": ("import pytest\n\n\n@pytest.mark.quiet\ndef test_x():\n    pass\n",
                          "tests/own_ray/test_b.py::test_x: marked quiet, which is for "
                          "tests/service/ only"),
    "service/test_c.py": ("import pytest\n\npytestmark = pytest.mark.heavy(0)\n\n\n"
                          "def test_x(service):\n    pass\n",
                          "tests/service/test_c.py::test_x: marked heavy, which orders "
                          "background tests only"),
    "own_ray/test_d.py": ("def test_x():\n    pass\n",
                          "tests/own_ray/test_d.py::test_x: in tests/own_ray/ without a service "
                          "or slow mark, so make test-fast would run it"),
    "test_top.py": ("def test_x():\n    pass\n",
                    "tests/test_top.py::test_x: not in a lane folder "
                    "(tests/{service,own_ray,no_ray,kernels}/)"),
}


def test_a_test_outside_its_lane_fails_before_its_fixtures(pytester, monkeypatch):
    """Under make test's xdist workers (where a collection error only reads as a worker's
    crash), each misplaced test fails in its set-up with the message, and the service they
    take never starts."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    stand_in(pytester, {name: text for name, (text, _) in MISPLACED.items()})
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "tests")
    result.assert_outcomes(errors=len(MISPLACED))  # each failed in its set-up
    for _, message in MISPLACED.values():
        result.stdout.fnmatch_lines([f"*outside its lane (tests/lanes.py): {message}*"])
    assert not (pytester.path / "service-started").exists()
