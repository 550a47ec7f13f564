"""Every number the profiler's advisor shows a user, pinned on hand-made inputs: its quality
measures, constraint and setting grid (its report, recommendation, table and files:
``tests/no_ray/test_advise_report_numbers.py``).

Expected values are worked out by hand (in the comments) or by an independent formula. Inputs
are binary fractions wherever a value is printed or compared exactly, so float equality is
exact; the one tolerance is named where it is used.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from profiler import advise, advise_report
from profiler.advise_config import Constraint, Setting, default_grid, drop_points, parse_setting

# Float sums whose order differs from the hand formula's: only the last bits may differ.
REL = 1e-12


# --- advisor: quality measures, constraint, setting grid --------------------------------------


def test_compare_paired_standard_error_by_hand():
    """Five sequences, three classes. Dense right on 0, 1, 2; this one on 0, 3: b = 2 (only
    dense right: 1, 2), c = 1 (only this: 3). SE = 100·√(b + c − (b − c)²/n)/n
    = 100·√(3 − 1/5)/5 = √1120 points."""
    q, h = 0.25, 0.5
    ref = np.array([[h, q, q], [q, h, q], [q, q, h], [q, h, q], [h, q, q]])
    probs = np.array([[h, q, q], [q, q, h], [q, h, q], [h, 0.375, 0.125], [h, q, q]])
    labels = np.array([0, 1, 2, 0, 1])
    got = advise.compare(ref, probs, labels)
    assert got["accuracy"] == 0.4 and got["agreement"] == 0.4  # rows 0, 3 right; 0, 4 agree
    # KL(ref ‖ probs): rows 1 and 2 ½ ln 2 − ¼ ln 2 = ¼ ln 2 each; row 3
    # −¼ ln 2 + ½ ln(4/3) + ¼ ln 2 = ½ ln(4/3) (the reverse KL would be ⅜ ln 1.5); mean over 5.
    assert got["kl"] == pytest.approx((0.5 * math.log(2) + 0.5 * math.log(4 / 3)) / 5, rel=REL)
    assert got["drop_se_points"] == pytest.approx(math.sqrt(1120), rel=REL)
    # Independently: the SE of the mean of d = dense right − this right, population variance.
    d = np.array([0, 1, 1, -1, 0])
    assert got["drop_se_points"] == pytest.approx(100 * d.std() / math.sqrt(5), rel=REL)


def test_compare_standard_error_is_zero_when_nothing_varies():
    ref = np.array([[0.75, 0.25], [0.75, 0.25]])
    # Dense right on both, this on neither: b = n = 2, c = 0: 2 − 4/2 = 0.
    got = advise.compare(ref, ref[:, ::-1].copy(), np.array([0, 0]))
    assert (got["accuracy"], got["agreement"], got["drop_se_points"]) == (0.0, 0.0, 0.0)
    # Rows with different argmax classes (a flat argmax over all rows would not give them).
    two = np.array([[0.75, 0.25], [0.125, 0.875]])
    same = advise.compare(two, two, np.array([0, 1]))
    assert same == {"accuracy": 1.0, "agreement": 1.0, "kl": 0.0, "drop_se_points": 0.0}


def test_compare_standard_error_when_only_this_one_is_right():
    # Dense wrong on both, this right on row 0: b = 0, c = 1, n = 2: 100·√(1 − 1/2)/2 = 25√2.
    ref = np.array([[0.25, 0.75], [0.25, 0.75]])
    got = advise.compare(ref, np.array([[0.75, 0.25], [0.25, 0.75]]), np.array([0, 0]))
    assert (got["accuracy"], got["agreement"]) == (0.5, 0.5)
    assert got["drop_se_points"] == pytest.approx(25 * math.sqrt(2), rel=REL)


def test_constraints_met_exactly_at_their_value():
    dense = {"accuracy": 0.75}
    agree = Constraint("agreement", 0.75)
    assert agree.met({"agreement": 0.75, "accuracy": 0.0}, dense)  # at the value: met
    assert not agree.met({"agreement": 0.74, "accuracy": 0.75}, dense)
    # Drop 100·(0.75 − 0.5) = 25 points, exactly the value: met; a better accuracy too.
    drop = Constraint("accuracy_drop", 25.0)
    assert drop.met({"accuracy": 0.5, "agreement": 0.0}, dense)
    assert drop.met({"accuracy": 0.875, "agreement": 0.0}, dense)
    assert not drop.met({"accuracy": 0.4921875, "agreement": 1.0}, dense)  # 25.78 points
    assert not Constraint("accuracy_drop", 24.9).met({"accuracy": 0.5}, dense)
    assert agree.describe() == "agreement with dense ≥ 75.0 %"
    assert Constraint("agreement", 0.995).describe() == "agreement with dense ≥ 99.5 %"
    assert drop.describe() == "accuracy drop ≤ 25 points"
    assert Constraint("accuracy_drop", 0.5).describe() == "accuracy drop ≤ 0.5 points"


def test_parse_setting_bounds():
    assert parse_setting("32x16") == Setting(32, 16, 1, "paper")
    assert parse_setting("4x1x4", "official") == Setting(4, 1, 4, "official")
    assert parse_setting("1x1x1") == Setting(1, 1, 1, "paper")
    # mita.config.parse_setting: the numbers are check_setting's to refuse, named as there
    for bad, why in (("4x4x5", "'route_topk' s = 5 exceeds 'num_landmarks' m = 4"),
                     ("0x4", "'num_landmarks' must be an int ≥ 1, got 0"),
                     ("4x0", "'topk' must be an int ≥ 1, got 0"),
                     ("4x4x0", "'route_topk' must be an int ≥ 1, got 0")):
        with pytest.raises(ValueError) as e:
            parse_setting(bad)
        assert str(e.value) == f"setting {bad!r}: {why}"
    for bad in ("32", " 4x4", "4x4x", "4x4x4x4", "axb"):
        with pytest.raises(ValueError) as e:
            parse_setting(bad)
        assert str(e.value) == f"setting {bad!r} is not MxK or MxKxS (e.g. 32x32 or 32x32x2)"


def test_default_grid_adds_each_ns_fig5_side_and_skips_s_above_m():
    # Fig. 5: N = 4 → √1 = 1 → m = k = 1 (no s = 2); N = 2^20 → √2^18 = 512.
    grid = default_grid([4, 1 << 20, 1024], ["paper", "official"])
    sides = [1, 8, 16, 32, 64, 512]  # 1024 → 16, already a fixed side
    expected = [Setting(x, x, s, scale) for scale in ("paper", "official")
                for x in sides for s in (1, 2) if (x, s) != (1, 2)]
    assert grid == expected and len(grid) == 2 * 11


def test_sequence_of_length_repeats_and_cuts():
    data = [([1, 2, 3], 0), ([4, 5], 1)]
    got = advise.sequence_of_length(data, 5)
    assert got.dtype == np.int64 and got.tolist() == [1, 2, 3, 4, 5]
    assert advise.sequence_of_length(data, 11).tolist() == [1, 2, 3, 4, 5] * 2 + [1]
    assert advise.sequence_of_length(data, 3).tolist() == [1, 2, 3]
    assert advise.sequence_of_length(data, 0).tolist() == []
    for empty in ([], [([], 0), ([], 1)]):  # once looped for ever
        with pytest.raises(ValueError, match="^the data hold no token to build a sequence"):
            advise.sequence_of_length(empty, 5)


def test_cpu_sharing_warning_at_and_above_the_threshold(monkeypatch):
    assert advise_report.cpu_sharing_warning(1.0, 2) is None  # exactly 0.5 per core: not busy
    assert advise_report.cpu_sharing_warning(1.25, 2) == (
        "warning: other processes share the CPU (1-minute load average 1.25 on 2 cores, above "
        "0.5 per core): latencies will be slower and speed-ups noisier than on an otherwise "
        "idle machine, and the run longer than the timings in docs/profiler.md. Stop other heavy "
        "work (a running service, a test run, a training) for numbers you can compare.")
    # Defaults: the load average and this process's cores (affinity, else cpu_count, else 1).
    monkeypatch.setattr(advise_report.os, "getloadavg", lambda: (2.0, 9.0, 9.0))
    monkeypatch.setattr(advise_report.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3},
                        raising=False)
    assert advise_report.cpu_sharing_warning() is None  # 2.0 = 0.5 × 4
    monkeypatch.setattr(advise_report.os, "getloadavg", lambda: (2.5, 0.0, 0.0))
    assert "average 2.50 on 4 cores" in advise_report.cpu_sharing_warning()
    monkeypatch.delattr(advise_report.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(advise_report.os, "cpu_count", lambda: 8)
    assert advise_report.cpu_sharing_warning() is None  # 2.5 ≤ 0.5 × 8
    monkeypatch.setattr(advise_report.os, "cpu_count", lambda: None)
    assert "average 2.50 on 1 cores" in advise_report.cpu_sharing_warning()

    def no_load():
        raise OSError("no load average here")

    monkeypatch.setattr(advise_report.os, "getloadavg", no_load)
    assert advise_report.cpu_sharing_warning() is None
    assert advise_report.cpu_sharing_warning(5.0, 1) is not None  # a given load needs no platform


def test_a_drop_of_float_noise_is_a_positive_zero():
    """Dense 0.3 against 0.1 + 0.2 (0.30000000000000004): 100 × the difference is −5.6e-15,
    which rounds at 9 digits to −0.0; the tables must print 0.0, not -0.0."""
    drop = drop_points({"accuracy": 0.3}, {"accuracy": 0.1 + 0.2})
    assert drop == 0 and str(drop) == "0.0"
