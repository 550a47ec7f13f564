"""The ``service`` marker comes from the fixture (``conftest.py``'s collection hook): a test that
takes the session's Ray Serve app, directly or through another fixture, is deselected by
``make test-fast`` without a hand-written mark. Run on a stand-in suite, no Ray."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_tests_taking_service_are_marked_service(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    service: Ray Serve\n    slow: slow\n")
    pytester.makeconftest('''
        import pytest

        from tests.conftest import pytest_collection_modifyitems  # noqa: F401  the hook tested

        @pytest.fixture
        def service():  # stands in for the session's Ray Serve app
            return None

        @pytest.fixture
        def serve_reset(service):
            yield
    ''')
    pytester.makepyfile('''
        import pytest

        def test_takes_service(service):
            pass

        def test_takes_serve_reset(serve_reset):
            pass

        @pytest.mark.slow
        def test_slow():
            pass

        def test_plain():
            pass
    ''')
    fast = pytester.runpytest("-m", "not service and not slow", "-v")
    fast.assert_outcomes(passed=1, deselected=3)
    fast.stdout.fnmatch_lines(["*::test_plain PASSED*"])
    marked = pytester.runpytest("-m", "service", "-v")
    marked.assert_outcomes(passed=2, deselected=2)
    marked.stdout.fnmatch_lines(["*::test_takes_service PASSED*",
                                 "*::test_takes_serve_reset PASSED*"])
