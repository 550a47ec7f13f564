"""``mita.tools.progress.Progress``: a bar on a terminal, one line per phase in a log."""

from __future__ import annotations

import io
import os
import select

from mita.tools.progress import Progress


def test_in_a_log_each_phase_is_one_line_and_nothing_else():
    log = io.StringIO()
    with Progress(6, "sweep", "point", file=log) as bar:
        for n in (1024, 4096, 16384):
            bar.phase(f"N={n}")
            bar.update(2)
            bar.phase_done(f"N={n}: forward 1.5 ms")
        bar.write("N=16384 dense: skipped")
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue()
    assert [line.rsplit(" [", 1)[0] for line in lines[:3]] == [
        "sweep: N=1024: forward 1.5 ms", "sweep: N=4096: forward 1.5 ms",
        "sweep: N=16384: forward 1.5 ms"]
    assert [line.split("[")[1].split(",")[0] for line in lines[:3]] == [
        "2/6 point", "4/6 point", "6/6 point"]
    assert lines[3:] == ["N=16384 dense: skipped", ""]


def test_on_a_terminal_the_bar_is_drawn_and_phase_lines_are_not():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty:
        assert tty.isatty()
        with Progress(4, "load", "req", file=tty) as bar:
            bar.phase("n=1024, variant=mita")
            bar.update(4)
            bar.phase_done("N=1024 mita: 4 of 4 answered")
        tty.flush()
        # all of it: one read returns what the pty holds at that moment, which was now and
        # then only the first part of the output (1 run in 15)
        out = b""
        while select.select([leader], [], [], 0.5)[0]:
            chunk = os.read(leader, 65536)
            if not chunk:
                break
            out += chunk
        out = out.decode()
    os.close(leader)
    assert "\r" in out and "load:" in out  # the bar, redrawn in place
    assert "n=1024, variant=mita" in out  # the phase beside the bar
    assert "4 of 4 answered" not in out
