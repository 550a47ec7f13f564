"""Where each test runs under ``make test``'s parallel workers: its lane is its folder.

- ``tests/service/``, lane ``ray``: the tests of the session's Ray Serve app (``service``
  fixture), and tests of an in-process server whose deadlines (0.5-1.5 s) are measured to
  within 1 s; one after another in one worker, each holding the cores lock;
- ``tests/own_ray/``, lane ``ray-own``: tests that start a Ray of their own (a ``python -m
  service``, a cluster), and those whose timing checks a background process could miss
  (Poisson arrivals' gaps); one after another in one worker, each holding the cores lock;
- ``tests/no_ray/``, lane ``background``: everything without Ray (modules, commands, the
  repository's own checks), an xdist group per file, at nice 19 in a session of its own;
- ``tests/kernels/``, lane ``background``: the CPU and Triton kernels (the interpreter,
  ahead-of-time compiles, builds), started before ``no_ray`` (they cost the most).

Each folder's ``conftest.py`` names its lane with ``folder_lane``. Three markers, written on a
module (``pytestmark``) or a test, refine the order: ``sharing`` (a session-service test that
mostly waits or checks no timing, run first and beside the ``ray-own`` worker's test without
the cores lock: the two Ray lanes' locked tests run one at a time, so what needs no lock
shortens the run),
``quiet`` (no background test runs beside it: latency ratios it checks moved 2x beside them)
and ``heavy(rank)`` (a background file started first, lowest rank first, so that the run does
not end on it alone). A test placed where its lane cannot hold it fails at once, before its
fixtures start anything, with a message naming where it belongs (``problems``): a test outside
a lane folder, a marker outside the lane it is for, a test taking the session's service
outside ``tests/service/``, and a test in ``tests/own_ray/`` without a ``service`` or
``slow`` mark (``make test-fast``, ``-m "not service and not slow"``, must leave it out; the
session's tests are marked ``service`` by their fixture).

A new test: a test of a module or a command without Ray goes in ``tests/no_ray/`` (mark it
``slow`` when it runs the Triton interpreter, a compile or a subprocess command); one that
takes the ``service`` fixture in ``tests/service/``; one that starts a Ray of its own or whose
timing a busy machine moves in ``tests/own_ray/``, marked ``service`` (it starts Ray) or
``slow``; a kernel's in ``tests/kernels/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RAY, OWN_RAY, BACKGROUND = "ray", "ray-own", "background"
FOLDERS = {"service": RAY, "own_ray": OWN_RAY, "no_ray": BACKGROUND, "kernels": BACKGROUND}
RAY_LANES = (RAY, OWN_RAY)


def folder_lane(conftest: str, lane: str):
    """The ``pytest_collection_modifyitems`` hook of the folder of ``conftest`` (its
    ``__file__``): every test under that folder gets the marker ``lane(lane)``. Raises
    ValueError when ``lane`` is not the one ``FOLDERS`` gives the folder."""
    here = Path(conftest).resolve().parent
    if FOLDERS.get(here.name) != lane:
        raise ValueError(f"{here.name}/ is lane {FOLDERS.get(here.name)!r}, not {lane!r}")

    @pytest.hookimpl(tryfirst=True)  # before the top conftest's hook reads the marker
    def pytest_collection_modifyitems(items):
        for item in items:
            if Path(item.path).resolve().is_relative_to(here):
                item.add_marker(pytest.mark.lane(lane, here.name))
    return pytest_collection_modifyitems


def lane(item) -> str:
    """The lane ``folder_lane`` gave ``item``: ``RAY``, ``OWN_RAY`` or ``BACKGROUND``."""
    return item.get_closest_marker("lane").args[0]


def group(item) -> str:
    """The xdist group of ``item``, the unit a worker takes whole: the lane for the two Ray
    lanes, else the test's file, so that a file's tests run in one process in their order
    (module fixtures once; a test that reads what the tests before it counted)."""
    return lane(item) if lane(item) in RAY_LANES else item.nodeid.split("::")[0]


def problems(item) -> list[str]:
    """Why ``item`` is placed where its lane cannot hold it, as sentences (none: it is not)."""
    marker = item.get_closest_marker("lane")
    if marker is None:
        return [f"{item.nodeid}: not in a lane folder (tests/{{{','.join(FOLDERS)}}}/)"]
    out = []
    if "service" in getattr(item, "fixturenames", ()) and marker.args[0] != RAY:
        out.append(f"{item.nodeid}: takes the session's service, so it belongs in "
                   "tests/service/")
    for name in ("sharing", "quiet"):
        if item.get_closest_marker(name) and marker.args[0] != RAY:
            out.append(f"{item.nodeid}: marked {name}, which is for tests/service/ only")
    if item.get_closest_marker("heavy") and marker.args[0] != BACKGROUND:
        out.append(f"{item.nodeid}: marked heavy, which orders background tests only")
    # make test-fast (-m "not service and not slow") must leave out every test that starts a
    # Ray or is timed; the session's service marks its tests by the fixture
    if marker.args[0] == OWN_RAY and not (item.get_closest_marker("service")
                                         or item.get_closest_marker("slow")):
        out.append(f"{item.nodeid}: in tests/own_ray/ without a service or slow mark, so "
                   "make test-fast would run it")
    return out


def rank(item) -> tuple[int, int]:
    """The order the workers take the groups in (``make test``: --no-loadscope-reorder): the
    session-service tests first, ``sharing`` ones first of all (they run beside the tests with
    a Ray of their own, which start at once in another worker), so the service stops after its
    last test instead of idling beside the Ray instances started after it; then the tests with
    a Ray of their own; then the background: ``heavy`` first by rank, then kernels, then the
    slow files (the interpreter, compiles, subprocesses), so that the workers end together."""
    if lane(item) == RAY:
        return (0 if item.get_closest_marker("sharing") else 1, 0)
    if lane(item) == OWN_RAY:
        return (2, 0)
    heavy = item.get_closest_marker("heavy")
    if heavy:
        return (3, heavy.args[0])
    if item.get_closest_marker("lane").args[1] == "kernels":
        return (4, 0)
    return (5 if item.get_closest_marker("service") or item.get_closest_marker("slow") else 6, 0)


# The stand-in suites' pytest.ini: pyproject.toml's markers, shortened.
STAND_IN_INI = ("[pytest]\nmarkers =\n    service: Ray Serve\n    slow: slow\n    lane: lane\n"
                "    sharing: sharing\n    quiet: quiet\n    heavy: heavy\n"
                "    misplaced: misplaced\n")


def write_lane_folders(root: Path) -> None:
    """The four lane folders under ``root / "tests"``, each with its ``conftest.py`` as in this
    suite: for the stand-in suites that check the lanes on a pytester copy."""
    for folder, lane_name in FOLDERS.items():
        (root / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (root / "tests" / folder / "conftest.py").write_text(
            "from tests.lanes import folder_lane\n\n"
            f"pytest_collection_modifyitems = folder_lane(__file__, {lane_name!r})\n")
