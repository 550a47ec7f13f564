"""The committed table of compiled kernel resources (``compiled.json`` beside this file).

``mita.kernels.aot`` compiles all 220 specialisations × sm_80 / sm_90 (440 compiles: ~15-40 min
on 2 cores). Their records — registers, spills, stack, shared memory, resident blocks — change
only when what they are compiled from changes, so they are committed once, under
``compile_key()``, a hash of everything a record depends on.
``tests/kernels/test_kernel_compile.py`` then checks, in ``make test``:

- the key: a kernel, launcher or Triton change without a regenerated table fails in one line
  naming ``make kernels-table``;
- a seeded sample of the rows (``sample``; the seed follows the commit, so every row is drawn
  over time), recompiled and compared with its committed row field by field;
- every row of the table: compiled, no spill, shared memory and occupancy within the SM.

    python -m mita.kernels.aot_table             # all 264 compiles, then write compiled.json
    python -m mita.kernels.aot_table --markdown  # the committed records as a Markdown table
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sys
from pathlib import Path

from ..tools.argtypes import Parser
from . import aot

TABLE = Path(__file__).with_name("compiled.json")
# The files a record depends on: the jit kernels, their launchers' plans (the arguments and
# constexprs a launch passes) and aot.py (example_plan, the checks, the ptxas flags).
COMPILE_SOURCES = ("__init__.py", "triton_common.py", "bisect.py", "triton_fused.py",
                   "tile_table.py", "routing.py", "topk.py", "pooling.py", "triton_backward.py",
                   "aot.py")
# Not a property of the compile: the cubin embeds its source files' paths (-lineinfo), so its
# size differs between two checkouts of the same commit.
UNCOMPARED = ("cubin_bytes",)


def _code(path: Path) -> str:
    """The module's code without comments and docstrings (``ast.unparse`` of its tree with
    every docstring removed): a reworded comment changes no compile, so it keeps the key."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def compile_key(sources: Path = Path(__file__).parent) -> str:
    """16 hex digits of a SHA-256 over everything the committed records depend on: the code of
    ``COMPILE_SOURCES`` in ``sources`` (``_code``: comments and docstrings left out), Triton's
    version (it ships the ptxas it compiles with), the targets ``aot.CAPABILITIES`` and every
    case of ``aot.cases()``. Raises ImportError without Triton."""
    import triton

    digest = hashlib.sha256()
    for name in COMPILE_SOURCES:
        digest.update(f"\0{name}\0{_code(sources / name)}".encode())
    for part in (f"triton {triton.__version__}", *map(str, aot.CAPABILITIES),
                 *map(str, aot.cases())):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def write(results: list[dict], path: Path = TABLE) -> None:
    """Write ``results`` — every job of ``aot.jobs()``, each compiled — to ``path`` under
    ``compile_key()``, one record a line in ``aot.table``'s order. Raises ValueError when a job
    is missing, repeated or failed (the table holds complete runs only)."""
    want = sorted((str(c), cap) for c, cap in aot.jobs())
    got = sorted((r["case"], r["sm"]) for r in results)
    bad = [f"sm_{r['sm']} {r['case']}" for r in results if not r["ok"]]
    if got != want or bad:
        raise ValueError(f"not writing {path.name}: {len(got)} records for {len(want)} jobs, "
                         f"failed: {bad[:5]}")
    rows = sorted(results, key=lambda r: (r["kernel"], r["case"], r["sm"]))
    lines = ",\n".join("  " + json.dumps(r) for r in rows)
    path.write_text(f'{{"key": "{compile_key()}",\n "versions": {json.dumps(aot.versions())},\n'
                    f' "records": [\n{lines}\n]}}\n')


def read(path: Path = TABLE) -> dict:
    """The committed table, ``{"key", "versions", "records"}`` (records as ``aot.check``
    returns them). Raises RuntimeError, one line naming ``make kernels-table``, when the file
    is missing or its key is not ``compile_key()`` (a kernel, a launcher, aot.py, Triton or
    the case list changed since it was written)."""
    if not path.is_file():
        raise RuntimeError(f"{path.name} is missing: run `make kernels-table`")
    table = json.loads(path.read_text())
    if table["key"] != (key := compile_key()):
        raise RuntimeError(f"{path.name} was compiled from other kernel sources or another Triton "
                           f"(key {table['key']}, now {key}): run `make kernels-table` and "
                           f"commit it")
    return table


# Specialisations whose ptxas compile alone takes minutes on a 2-core CPU (sm_80, idle: the
# threshold select at k 600 375 s, at k 2048 257 s; k 512 46 s, every other one ≤ 19 s):
# ``make kernels-table`` compiles them with the rest, the test suite's sample leaves them out.
SLOW_COMPILES = ("select-k600", "select-k2048")


def sample(seed: int, n: int = 16, skip: tuple[str, ...] = ()) -> list[tuple[aot.Case, int]]:
    """``n`` of ``aot.jobs()`` (case, capability) whose case is not named in ``skip``, drawn
    without replacement by ``random.Random(seed)``."""
    return random.Random(seed).sample([j for j in aot.jobs() if str(j[0]) not in skip], n)


def comparable(record: dict) -> dict:
    """``record`` without the fields ``UNCOMPARED``."""
    return {k: v for k, v in record.items() if k not in UNCOMPARED}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m mita.kernels.aot_table",
               description=f"Compile every kernel specialisation for sm_80 "
                           f"and sm_90 and write {TABLE.name}.")
    p.add_argument("--markdown", action="store_true",
                   help=f"print the committed {TABLE.name} as a Markdown table; compile nothing")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.markdown:
        table = read()
        print(f"{table['versions']}\n\n{aot.table(table['records'])}")
        return 0
    results = aot.check_all()
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        print(f"FAIL sm_{r['sm']} {r['case']}: {r['error']}")
    if bad:
        print(f"{len(bad)} of {len(results)} compiles failed: {TABLE.name} not written")
        return 1
    write(results)
    spilled = sum(1 for r in results if r["spill_store_bytes"] or r["spill_load_bytes"])
    print(f"wrote {TABLE} ({len(results)} records, key {compile_key()}; {spilled} spill)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
