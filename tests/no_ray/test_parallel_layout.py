"""``make test``'s three workers (``conftest.py``, ``lanes.py``): on a stand-in suite laid out in
the real lane folders, run with ``-n 3 --dist loadgroup``, each test records when it ran, in
which process and at which priority; the Ray tests' timed parts never overlap, a ``quiet``
test never overlaps a background test, a ``sharing`` test runs beside a test with a Ray of its
own, and the background tests run in a session of their own at nice 19. No Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ..lanes import STAND_IN_INI, write_lane_folders

ROOT = Path(__file__).resolve().parents[2]
# An own_ray test is marked service or slow (it fails as misplaced otherwise).
OWN_RAY_MARK = "import pytest\n\npytestmark = pytest.mark.service\n"
pytest_plugins = ["pytester"]

@pytest.mark.slow  # a pytest of its own with three xdist workers
def test_the_workers_keep_timed_ray_tests_apart(pytester, monkeypatch, tmp_path):
    record = tmp_path / "ran.jsonl"
    monkeypatch.setenv("LAYOUT_RECORD", str(record))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini(STAND_IN_INI)
    pytester.makeconftest('''
        import json, os, time
        from pathlib import Path

        import pytest

        from tests.conftest import (  # noqa: F401  the hooks and fixture tested
            cpu_priority, pytest_collection_modifyitems, pytest_configure,
            pytest_runtest_protocol)

        @pytest.fixture(scope="session")
        def service():  # stands in for the session's Ray Serve app
            return None

        @pytest.fixture
        def record():
            def run(name, seconds, after=None):
                """Sleep ``seconds`` (after the test named ``after`` has started, if given:
                a worker started late, e.g. beside a busy machine, is waited for)."""
                start = time.time()
                folder = Path(os.environ["LAYOUT_RECORD"]).parent
                (folder / f"{name}.started").touch()
                while after and not (folder / f"{after}.started").exists():
                    assert time.time() - start < 120, f"{after} never started"
                    time.sleep(0.05)
                time.sleep(seconds)
                try:
                    autogroup = int(Path("/proc/self/autogroup").read_text().split()[-1])
                except OSError:
                    autogroup = None
                row = {"name": name, "start": start, "end": time.time(), "pid": os.getpid(),
                       "sid": os.getsid(0), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                       "autogroup": autogroup}
                with open(os.environ["LAYOUT_RECORD"], "a") as f:
                    f.write(json.dumps(row) + "\\n")
            return run
    ''')
    write_lane_folders(pytester.path)
    files = {
        # tests with a Ray of their own; the first lasts until 2 s after the sharing test
        # started
        "own_ray/test_cluster.py": [OWN_RAY_MARK, "def test_own(record):\n"
                                                  "    record('own', 2, after='sharing')\n"],
        "own_ray/test_gpu_placement.py": [OWN_RAY_MARK,
                                          "def test_own_2(record):\n    record('own', 1)\n"],
        # the session's service: sharing (first in its worker), two timed ones, quiet
        "service/test_prometheus.py": ["import pytest\n\npytestmark = pytest.mark.sharing\n",
                                       "def test_sharing(service, record):\n"
                                       "    record('sharing', 1.5)\n"],
        "service/test_service.py": [f"def test_timed_{i}(service, record):\n"
                                    "    record('timed', 0.5)\n" for i in range(2)],
        "service/test_shadow_load.py": ["import pytest\n\npytestmark = pytest.mark.quiet\n",
                                        "def test_quiet(service, record):\n"
                                        "    record('quiet', 1)\n"],
        # background tests, a file each for the free workers to take
        **{f"no_ray/test_plain_{j}.py": [f"def test_bg_{j}_{i}(record):\n"
                                         f"    record('background', 0.3)\n" for i in range(4)]
           for j in range(4)},
    }
    for name, tests in files.items():
        (pytester.path / "tests" / name).write_text("\n\n".join(tests))
    result = pytester.runpytest_subprocess("-n", "3", "--dist", "loadgroup",
                                           "--no-loadscope-reorder", "tests")
    result.assert_outcomes(passed=22)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    by = {k: [r for r in rows if r["name"] == k]
          for k in ("own", "sharing", "timed", "quiet", "background")}
    assert [len(v) for v in by.values()] == [2, 1, 2, 1, 16]

    def overlap(a, b) -> bool:
        return a["start"] < b["end"] and b["start"] < a["end"]
    locked = by["own"] + by["timed"] + by["quiet"]
    assert not any(overlap(a, b) for a in locked for b in locked if a is not b), locked
    assert not any(overlap(by["quiet"][0], b) for b in by["background"])
    # the sharing test went first in its worker, beside the test with a Ray of its own
    assert overlap(by["sharing"][0], by["own"][0])
    assert by["sharing"][0]["start"] < min(r["start"] for r in by["timed"] + by["quiet"])
    # three workers, each a session of its own; the background at nice 19, the Ray tests at 0
    assert len({r["pid"] for r in rows}) == 3 and all(r["sid"] == r["pid"] for r in rows)
    assert {r["nice"] for r in by["background"]} == {19}
    assert {r["nice"] for r in locked + by["sharing"]} == {0}
    if os.path.exists("/proc/self/autogroup") and os.geteuid() == 0:
        assert {r["autogroup"] for r in by["background"]} == {19}
        assert {r["autogroup"] for r in locked + by["sharing"]} == {0}
