"""Every number of the profiler's advisor report a user reads, pinned on hand-made inputs: the
report's rows, the recommendation, the Markdown table and the files (its quality measures,
constraint and grid: ``tests/no_ray/test_advise_numbers.py``).

Expected values are worked out by hand (in the comments) or by an independent formula. Inputs
are binary fractions wherever a value is printed or compared exactly, so float equality is
exact; the one tolerance is named where it is used.
"""

from __future__ import annotations

import csv
import json

import matplotlib.image
import pytest
import torch

from profiler import advise_report, recommend
from profiler.advise_config import AdviseConfig, Constraint, Setting, drop_points

# Float sums whose order differs from the hand formula's: only the last bits may differ.
REL = 1e-12


# --- advisor: report, recommendation, table, files --------------------------------------------

def test_accuracy_drop_exactly_at_the_bound_is_met():
    """The advisor's own run (issue: dense 36 of 100 right, m16 35 of 100): the drop is 1
    point, and ``--max-accuracy-drop 1`` must take it. In floats 100 · (0.36 − 0.35) is
    1.0000000000000009, which refused the setting; a drop of 2 points is still refused."""
    assert 100 * (0.36 - 0.35) > 1  # the float noise this test is about
    dense = {"accuracy": 0.36}
    one = Constraint("accuracy_drop", 1.0)
    assert one.met({"accuracy": 0.35, "agreement": 0.72}, dense)
    assert not one.met({"accuracy": 0.34, "agreement": 0.9}, dense)
    assert drop_points(dense, {"accuracy": 0.35}) == 1.0
    # Agreement 57 of 100 at a bound of 57 %: 0.57 as typed (56.99999999999999 as 100 · 0.57).
    assert Constraint("agreement", 0.57).met({"agreement": 57 / 100}, dense)
    assert not Constraint("agreement", 0.58).met({"agreement": 57 / 100}, dense)


def test_refusal_names_the_setting_closest_to_the_failed_constraint():
    """Under an accuracy-drop bound the refusal quotes the smallest drop (m16: 2 points,
    agreement 60 %), not the setting of the best agreement (m8: 90 %, drop 5 points); the
    row's drop is 2.0 exactly (100 · (0.37 − 0.35) is 2.0000000000000018 in floats)."""
    cfg = small_cfg(Constraint("accuracy_drop", 1.0), ns=[256])
    done = {("quality", "dense"): quality(0.37, 1.0, 0.0, 0.0),
            ("quality", M8.name): quality(0.32, 0.9, 0.0, 0.0),
            ("quality", M16.name): quality(0.35, 0.6, 0.0, 0.0)}
    rep = recommend.report(cfg, done, [])
    assert rep["rows"][2]["accuracy_drop_points"] == 2.0
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets accuracy drop ≤ 1 points at N = 256 (smallest accuracy drop 2 "
        "points, agreement 60.0 % (m16 k16 s2 official))")
    assert advise_report.markdown(rep).count("| +2.0 ± 0.0 |") == 1


def test_refusal_under_an_agreement_bound_names_the_best_agreement():
    """Under an agreement bound the refusal quotes the best agreement (m8: 90 %, though its
    accuracy drop is the larger, 5 points), and the shortfall is the agreement negated."""
    cfg = small_cfg(Constraint("agreement", 0.95), ns=[256])
    done = {("quality", "dense"): quality(0.37, 1.0, 0.0, 0.0),
            ("quality", M8.name): quality(0.32, 0.9, 0.0, 0.0),
            ("quality", M16.name): quality(0.35, 0.6, 0.0, 0.0)}
    rep = recommend.report(cfg, done, [])
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets agreement with dense ≥ 95.0 % at N = 256 (best agreement 90.0 %, "
        "accuracy drop 5.0 points (m8 k8 s1 paper))")
    assert cfg.constraint.shortfall({"agreement": 0.9, "accuracy": 0.32},
                                    {"accuracy": 0.37}) == -0.9


M8 = Setting(8, 8, 1, "paper")
M16 = Setting(16, 16, 2, "official")


def lat(p50, lo, hi, dense_p50=None, peak=None):
    """One finished latency unit (``advise._latency``'s fields)."""
    out = {"p50_ms": p50, "min_ms": lo, "max_ms": hi, "stages_ms": {"attention": p50 / 2},
           "peak_memory_bytes": peak, "peak_memory_kind": "analytic_activation_estimate"}
    return out | ({} if dense_p50 is None else {"dense_p50_ms": dense_p50})


def quality(acc, agree, kl, se):
    return {"accuracy": acc, "agreement": agree, "kl": kl, "drop_se_points": se}


def small_cfg(constraint, ns=(512, 2048), grid=(M8, M16)):
    return AdviseConfig(checkpoint="ckpt/x", ns=list(ns), grid=list(grid),
                        constraint=constraint, size=40, min_length=100, max_length=300,
                        dtype="float32", mita_backend="torch", repeats=3)


def small_report():
    """Dense 75 %; m8 drops 12.5 points (refused), m16 exactly 3.125 (met, the constraint's
    value) and was not timed at N = 2048 (skipped). Dense's 2048 timings are noisy (50 > 1.5 ×
    30); m8's at 2048 are at the limit (6 = 1.5 × 4: not noisy)."""
    done = {("quality", "dense"): quality(0.75, 1.0, 0.0, 0.0),
            ("latency", "dense", 512): lat(8.0, 7.5, 8.5, peak=1 << 20),
            ("latency", "dense", 2048): lat(32.0, 30.0, 50.0, peak=1 << 22),
            ("quality", M8.name): quality(0.625, 0.875, 0.125, 5.0),
            ("latency", M8.name, 512): lat(2.0, 2.0, 2.0, 8.0),
            ("latency", M8.name, 2048): lat(4.0, 4.0, 6.0, 32.0),
            ("quality", M16.name): quality(0.71875, 0.90625, 0.0625, 2.5),
            ("latency", M16.name, 512): lat(5.0, 5.0, 5.0, 8.0, peak=7)}
    cfg = small_cfg(Constraint("accuracy_drop", 3.125))
    return recommend.report(cfg, done, [("latency", M16.name, 2048)], 36)


def test_report_rows_retention_and_speedups():
    rep = small_report()
    dense, m8, m16 = rep["rows"]
    assert dense == {"setting": "dense", "m": None, "k": None, "s": None, "shared_scale": None,
                     "accuracy": 0.75, "agreement": 1.0, "kl": 0.0, "drop_se_points": 0.0,
                     "retention": 1.0, "accuracy_drop_points": 0.0,
                     "latency": {512: lat(8.0, 7.5, 8.5, peak=1 << 20),
                                 2048: lat(32.0, 30.0, 50.0, peak=1 << 22)}}
    # retention = 0.625 / 0.75 = 5/6; drop 100 · (0.75 − 0.625) = 12.5 points.
    assert (m8["setting"], m8["m"], m8["k"], m8["s"], m8["shared_scale"]) == (
        "m8 k8 s1 paper", 8, 8, 1, "paper")
    assert m8["retention"] == pytest.approx(5 / 6, rel=REL)
    assert m8["accuracy_drop_points"] == 12.5
    assert m8["latency"][512] == lat(2.0, 2.0, 2.0, 8.0) | {"speedup": 4.0}
    assert m8["latency"][2048]["speedup"] == 8.0  # 32 / 4
    assert m16["retention"] == pytest.approx(0.71875 / 0.75, rel=REL)  # 23/24
    assert m16["accuracy_drop_points"] == 3.125
    assert m16["latency"] == {512: lat(5.0, 5.0, 5.0, 8.0, peak=7) | {"speedup": 1.6}}
    assert rep["noisy"] == [["dense", 2048]]
    assert rep["skipped"] == [["latency", "m16 k16 s2 official", 2048]]
    assert rep["constraint"] == "accuracy drop ≤ 3.125 points"
    c = rep["config"]
    assert (c["sequences"], c["ns"], c["grid"], c["constraint"], c["out"]) == (
        36, [512, 2048], ["m8 k8 s1 paper", "m16 k16 s2 official"],
        "accuracy drop ≤ 3.125 points", "runs/advise")
    # Without n_data the configured size is reported; without dense quality, no retention.
    done = {("quality", M8.name): quality(0.5, 0.5, 0.0, 0.0)}
    rep = recommend.report(small_cfg(Constraint("agreement", 0.5), grid=[M8]), done, [])
    assert rep["config"]["sequences"] == 40
    assert "retention" not in rep["rows"][1] and "accuracy_drop_points" not in rep["rows"][1]
    assert "accuracy" not in rep["rows"][0] and rep["rows"][0]["latency"] == {}
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets agreement with dense ≥ 50.0 % at N = 512 (no setting finished)")


def test_recommendation_fields_and_answers():
    rec512, rec2048 = small_report()["recommendations"]
    assert rec512 == {"n": 512, "setting": "m16 k16 s2 official", "p50_ms": 5.0,
                      "dense_p50_ms": 8.0, "speedup": 1.6, "accuracy": 0.71875,
                      "agreement": 0.90625, "kl": 0.0625, "accuracy_drop_points": 3.125,
                      "retention": pytest.approx(23 / 24, rel=REL),
                      "answer": "N = 512: m16 k16 s2 official — 1.60× dense's speed (5.0 ms vs "
                                "8.0 ms, timed side by side), agreement 90.6 %, accuracy "
                                "71.9 % (dense 75.0 %, retention 95.8 %)"}
    assert rec2048 == {"n": 2048, "setting": None,
                       "answer": "no setting meets accuracy drop ≤ 3.125 points at N = 2048 "
                                 "(1 setting(s) meet it but none was timed at N = 2048 within "
                                 "the budget)"}


def test_recommendation_when_none_beats_or_none_meets():
    a, b, c = (Setting(x, x) for x in (4, 8, 16))
    cfg = small_cfg(Constraint("agreement", 0.75), ns=[256], grid=[a, b, c])
    done = {("quality", "dense"): quality(0.5, 1.0, 0.0, 0.0),
            ("quality", a.name): quality(0.5, 0.875, 0.0, 0.0),
            ("latency", a.name, 256): lat(4.0, 4.0, 4.0, 4.0),  # exactly dense's speed
            ("quality", b.name): quality(0.5, 0.75, 0.0, 0.0),  # exactly at the constraint
            ("latency", b.name, 256): lat(5.0, 5.0, 5.0, 4.0),  # 0.8×
            ("quality", c.name): quality(0.375, 0.5, 0.0, 0.0),  # refused, but 4× dense
            ("latency", c.name, 256): lat(1.0, 1.0, 1.0, 4.0)}
    rep = recommend.report(cfg, done, [])
    # A speed-up of exactly 1 does not beat dense; the fastest meeting setting is named.
    assert rep["recommendations"] == [{"n": 256, "setting": None, "answer": (
        "N = 256: dense is faster — MiTA does not pay off here (the fastest setting meeting "
        "agreement with dense ≥ 75.0 %, m4 k4 s1 paper, runs at 1.00× dense's speed)")}]
    assert rep["overall"] == {"setting": None, "answer": "no setting meets agreement with "
                                                         "dense ≥ 75.0 % and beats dense at "
                                                         "every N in [256]"}
    # Nothing meets 90 %: the best agreement (a's 87.5 %, the first setting row) is quoted.
    cfg.constraint = Constraint("agreement", 0.9)
    rep = recommend.report(cfg, done, [])
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets agreement with dense ≥ 90.0 % at N = 256 (best agreement 87.5 %, "
        "accuracy drop 0.0 points (m4 k4 s1 paper))")
    # No setting measured at all: nothing to quote.
    rep = recommend.report(cfg, {("quality", "dense"): done[("quality", "dense")]}, [])
    assert rep["recommendations"][0]["answer"] == (
        "no setting meets agreement with dense ≥ 90.0 % at N = 256 (no setting finished)")


def test_dense_right_on_nothing_and_a_setting_timed_alone():
    """Dense 0 % accurate: retention undefined ('-'), no division by zero. A latency without
    dense timed beside it has no speed-up: not recommended, not in the overall choice."""
    cfg = small_cfg(Constraint("accuracy_drop", 50.0), ns=[64, 128], grid=[M8, M16])
    done = {("quality", "dense"): quality(0.0, 1.0, 0.0, 0.0),
            ("quality", M8.name): quality(0.25, 0.5, 0.0, 0.0),
            ("latency", M8.name, 64): lat(1.0, 1.0, 1.0, 2.0),
            ("latency", M8.name, 128): lat(1.0, 1.0, 1.0),
            ("latency", M16.name, 64): lat(3.0, 3.0, 3.0, 6.0)}
    rep = recommend.report(cfg, done, [])
    assert rep["rows"][1]["retention"] is None and rep["rows"][0]["retention"] is None
    assert rep["rows"][1]["latency"][128] == lat(1.0, 1.0, 1.0)  # no speed-up key
    assert rep["recommendations"][0]["answer"] == (
        "N = 64: m8 k8 s1 paper — 2.00× dense's speed (1.0 ms vs 2.0 ms, timed side by side), "
        "agreement 50.0 %, accuracy 25.0 % (dense 0.0 %, retention -)")
    assert rep["recommendations"][1]["answer"] == (
        "no setting meets accuracy drop ≤ 50 points at N = 128 (1 setting(s) meet it but none "
        "was timed at N = 128 within the budget)")
    assert rep["overall"]["setting"] is None
    table = advise_report.markdown(rep).split("\n")[4:7]
    assert table == [
        "| dense | - | - | - | - | 0.0 % | - | - | - | 100.0 % | 0.0000 | - | - | - |",
        "| m8 k8 s1 paper | 8 | 8 | 1 | paper | 25.0 % | - | - | -25.0 ± 0.0 | 50.0 % | 0.0000 "
        "| - | 1.0 vs 2.0 (2.00×) | 1.0 |",
        # m16 was timed but its quality never finished: seven '-' for the quality columns.
        "| m16 k16 s2 official | 16 | 16 | 2 | official | - | - | - | - | - | - | - | "
        "3.0 vs 6.0 (2.00×) | - |"]
    # A speed-up on dense's own row (a hand-edited report) is still not shown for dense.
    rep["rows"][0]["latency"][64] = lat(2.0, 2.0, 2.0, 2.0) | {"speedup": 1.0}
    assert "| 0.0 % | - | - | - | 100.0 % | 0.0000 | - | 2.0 | - |" in advise_report.markdown(
        rep)


def test_overall_is_the_lowest_geometric_mean_time_ratio():
    """x: 8× and 1.1× (geometric mean √8.8 ≈ 2.97, arithmetic 4.55); y: 3× and 3× (3): y wins
    on the geometric mean. z is 100× at one N but exactly dense's speed at the other: out."""
    x, y, z = (Setting(m, m) for m in (4, 8, 16))
    cfg = small_cfg(Constraint("agreement", 0.5), ns=[256, 1024], grid=[x, y, z])
    done = {("quality", "dense"): quality(0.5, 1.0, 0.0, 0.0)}
    for s, ratios in ((x, (8.0, 1.1)), (y, (3.0, 3.0)), (z, (100.0, 1.0))):
        done[("quality", s.name)] = quality(0.5, 0.5, 0.0, 0.0)
        for n, r in zip((256, 1024), ratios, strict=True):
            done[("latency", s.name, n)] = lat(1.0, 1.0, 1.0, r)
    overall = recommend.report(cfg, done, [])["overall"]
    assert overall == {"setting": "m8 k8 s1 paper", "speedups": {256: 3.0, 1024: 3.0},
                       "answer": "for N in [256, 1024]: m8 k8 s1 paper",
                       "snippet": "# deploy/serve_config.yaml: applications[0].args\n"
                                  "args:\n  checkpoint: ckpt/x\n  mita_setting:\n"
                                  "    num_landmarks: 8\n    topk: 8\n"
                                  "    route_topk: 1\n    shared_scale: paper\n"}


def test_serve_snippet_text():
    row = {"m": 32, "k": 16, "s": 2, "shared_scale": "official"}
    checkpoint = small_cfg(Constraint("agreement", 0.5)).checkpoint
    assert advise_report.serve_snippet(row, checkpoint) == (
        "# deploy/serve_config.yaml: applications[0].args\nargs:\n  checkpoint: ckpt/x\n"
        "  mita_setting:\n    num_landmarks: 32\n    topk: 16\n    route_topk: 2\n"
        "    shared_scale: official\n")


SMALL_MARKDOWN = (
    "Advisor: checkpoint ckpt/x, data generated (36 sequences, 100 < length < 300), cpu, dtype "
    f"float32, backend torch, batch 1, p50 of 3, torch {torch.__version__}. Constraint: "
    "accuracy drop ≤ 3.125 points. Metric: accuracy (--metric accuracy). Drop = dense's "
    "accuracy minus the setting's in points (100 × the difference), ± its paired standard error "
    "(exact for paired outcomes): a constraint tighter than ~2 SE is within noise. Scores ± "
    "their standard error (macro-F1 and balanced accuracy: bootstrap). A setting's p50 cell: "
    "its p50 vs that of dense timed beside it (interleaved forwards), × = dense's over the "
    "setting's; dense's row: dense timed alone, another measurement.\n"
    "\n"
    "| setting | m | k | s | scale | accuracy | macro-F1 | balanced accuracy | accuracy drop "
    "(± SE) points | agreement | KL(dense‖MiTA) | retention | p50 ms N=512: setting vs dense "
    "(×) | p50 ms N=2048: setting vs dense (×) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    "| dense | - | - | - | - | 75.0 % | - | - | - | 100.0 % | 0.0000 | 100.0 % | 8.0 | 32.0 |\n"
    # each ratio beside the two p50s it divides (dense's own row: dense timed alone)
    "| m8 k8 s1 paper | 8 | 8 | 1 | paper | 62.5 % | - | - | +12.5 ± 5.0 | 87.5 % | 0.1250 | "
    "83.3 % | 2.0 vs 8.0 (4.00×) | 4.0 vs 32.0 (8.00×) |\n"
    "| m16 k16 s2 official | 16 | 16 | 2 | official | 71.9 % | - | - | +3.1 ± 2.5 | 90.6 % | "
    "0.0625 | 95.8 % | 5.0 vs 8.0 (1.60×) | - |\n"
    "\n"
    "Recommendation (the largest speed-up over dense among the settings that meet the "
    "constraint):\n"
    "\n"
    "- N = 512: m16 k16 s2 official — 1.60× dense's speed (5.0 ms vs 8.0 ms, timed side by "
    "side), agreement 90.6 %, accuracy 71.9 % (dense 75.0 %, retention 95.8 %)\n"
    "- no setting meets accuracy drop ≤ 3.125 points at N = 2048 (1 setting(s) meet it but "
    "none was timed at N = 2048 within the budget)\n"
    "- no setting meets accuracy drop ≤ 3.125 points and beats dense at every N in "
    "[512, 2048]\n"
    "\n"
    "Noisy timings (slowest forward > 1.5× the fastest): dense at N = 2048. The machine was "
    "busy or its clock unsteady: rerun with more --repeats on an idle machine.\n"
    "\n"
    "Not run (time budget): 1 units; run again to resume.\n")


def test_advisor_markdown_whole_text():
    rep = small_report()
    assert advise_report.markdown(rep) == SMALL_MARKDOWN
    # As read back from advise.json: N keys are strings.
    assert advise_report.markdown(json.loads(json.dumps(rep))) == SMALL_MARKDOWN


def test_advisor_markdown_with_a_snippet_file_data_and_many_noisy_points():
    cfg = small_cfg(Constraint("agreement", 0.5), ns=[64], grid=[M8])
    cfg.data = "my.tsv"
    done = {("quality", "dense"): quality(0.5, 1.0, 0.0, 0.0),
            ("quality", M8.name): quality(0.25, 0.5, 0.5, 1.375),
            ("latency", M8.name, 64): lat(2.0, 1.0, 2.0, 3.0)}
    rep = recommend.report(cfg, done, [], 2)
    rep["noisy"] = [[f"s{i}", 64] for i in range(7)]
    assert advise_report.markdown(rep) == (
        "Advisor: checkpoint ckpt/x, data my.tsv (2 sequences), cpu, dtype float32, backend "
        f"torch, batch 1, p50 of 3, torch {torch.__version__}. Constraint: agreement with dense "
        "≥ 50.0 %. Metric: accuracy (--metric accuracy). Drop = dense's accuracy minus the "
        "setting's in points (100 × the difference), ± its paired standard error (exact for "
        "paired outcomes): a constraint tighter than ~2 SE is within noise. Scores ± their "
        "standard error (macro-F1 and balanced accuracy: bootstrap). A setting's p50 cell: its "
        "p50 vs that of dense timed beside it (interleaved forwards), × = dense's over the "
        "setting's; dense's row: dense timed alone, another measurement.\n\n"
        "| setting | m | k | s | scale | accuracy | macro-F1 | balanced accuracy | accuracy drop "
        "(± SE) points | agreement | KL(dense‖MiTA) | retention | p50 ms N=64: setting vs dense "
        "(×) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| dense | - | - | - | - | 50.0 % | - | - | - | 100.0 % | 0.0000 | 100.0 % | - |\n"
        "| m8 k8 s1 paper | 8 | 8 | 1 | paper | 25.0 % | - | - | +25.0 ± 1.4 | 50.0 % | 0.5000 "
        "| 50.0 % | 2.0 vs 3.0 (1.50×) |\n\n"
        "Recommendation (the largest speed-up over dense among the settings that meet the "
        "constraint):\n\n"
        "- N = 64: m8 k8 s1 paper — 1.50× dense's speed (2.0 ms vs 3.0 ms, timed side by "
        "side), agreement 50.0 %, accuracy 25.0 % (dense 50.0 %, retention 50.0 %)\n"
        "- for N in [64]: m8 k8 s1 paper\n\n"
        "```yaml\n# deploy/serve_config.yaml: applications[0].args\nargs:\n  checkpoint: "
        "ckpt/x\n  mita_setting:\n    num_landmarks: 8\n    topk: 8\n    route_topk: 1\n"
        "    shared_scale: paper\n```\n\n"
        "Noisy timings (slowest forward > 1.5× the fastest): s0 at N = 64, s1 at N = 64, s2 at "
        "N = 64, s3 at N = 64, s4 at N = 64, s5 at N = 64 …. The machine was busy or its clock "
        "unsteady: rerun with more --repeats on an idle machine.\n")
    rep["noisy"] = rep["noisy"][:6]  # six: all shown, no ellipsis
    assert "s5 at N = 64. The machine" in advise_report.markdown(rep)


def test_advisor_files_hold_the_reports_numbers(tmp_path):
    rep = small_report()
    (tmp_path / "serve_snippet.yaml").write_text("an earlier run's recommendation")
    files = advise_report.write_outputs(rep, tmp_path)
    assert files == {k: tmp_path / f"{name}" for k, name in (
        ("md", "advise.md"), ("json", "advise.json"), ("csv", "advise.csv"),
        ("png", "frontier.png"))}
    assert not (tmp_path / "serve_snippet.yaml").exists()  # never left to be deployed
    assert files["json"].read_text().startswith('{\n  "config": {\n    "checkpoint": "ckpt/x",')
    assert files["json"].read_text().endswith("\n}\n")
    # Into a folder not there yet (parents too); no earlier snippet to remove: no error.
    assert sorted(advise_report.write_outputs(rep, tmp_path / "a" / "b")) == ["csv", "json", "md",
                                                                        "png"]
    assert files["md"].read_text() == SMALL_MARKDOWN
    back = json.loads(files["json"].read_text())
    assert back["rows"][1]["latency"]["2048"]["speedup"] == 8.0
    assert back["recommendations"][0]["speedup"] == 1.6
    with open(files["csv"], newline="") as f:
        table = list(csv.reader(f))
    r8, r16 = 5 / 6, 23 / 24  # 0.625 / 0.75 and 0.71875 / 0.75
    # Units without scores (mita.tools.scores): the score columns beyond accuracy are empty, and
    # there are no per-class F1 columns.
    no_scores = ["", "", "", "", "", ""]
    assert table == [
        ["setting", "m", "k", "s", "shared_scale", "accuracy", "accuracy_se", "macro_f1",
         "macro_f1_se", "balanced_accuracy", "balanced_accuracy_se", "majority_rate", "metric",
         "drop_points", "drop_se_points", "agreement", "kl", "retention",
         "n", "p50_ms", "min_ms", "max_ms", "dense_p50_ms", "speedup", "peak_memory_bytes"],
        ["dense", "", "", "", "", "0.75", *no_scores, "accuracy", "0.0", "0.0", "1.0", "0.0",
         "1.0", "512", "8.0", "7.5", "8.5", "", "", "1048576"],
        ["dense", "", "", "", "", "0.75", *no_scores, "accuracy", "0.0", "0.0", "1.0", "0.0",
         "1.0", "2048", "32.0", "30.0", "50.0", "", "", "4194304"],
        ["m8 k8 s1 paper", "8", "8", "1", "paper", "0.625", *no_scores, "accuracy", "12.5",
         "5.0", "0.875", "0.125", str(r8), "512", "2.0", "2.0", "2.0", "8.0", "4.0", ""],
        ["m8 k8 s1 paper", "8", "8", "1", "paper", "0.625", *no_scores, "accuracy", "12.5",
         "5.0", "0.875", "0.125", str(r8), "2048", "4.0", "4.0", "6.0", "32.0", "8.0", ""],
        ["m16 k16 s2 official", "16", "16", "2", "official", "0.71875", *no_scores, "accuracy",
         "3.125", "2.5", "0.90625", "0.0625", str(r16), "512", "5.0", "5.0", "5.0", "8.0",
         "1.6", "7"],
        ["m16 k16 s2 official", "16", "16", "2", "official", "0.71875", *no_scores, "accuracy",
         "3.125", "2.5", "0.90625", "0.0625", str(r16), "2048", "", "", "", "", "", ""]]
    img = matplotlib.image.imread(files["png"])
    assert img.shape[0] > 100 and img.shape[1] > 100
    # A setting for every N: its snippet is written, with exactly the report's text.
    cfg = small_cfg(Constraint("agreement", 0.5), ns=[64], grid=[M8])
    done = {("quality", "dense"): quality(0.5, 1.0, 0.0, 0.0),
            ("quality", M8.name): quality(0.5, 0.5, 0.0, 0.0),
            ("latency", M8.name, 64): lat(1.0, 1.0, 1.0, 2.0)}
    files = advise_report.write_outputs(recommend.report(cfg, done, []), tmp_path / "new")
    assert files["yaml"] == tmp_path / "new" / "serve_snippet.yaml"
    assert files["yaml"].read_text() == (
        "# deploy/serve_config.yaml: applications[0].args\nargs:\n  checkpoint: ckpt/x\n"
        "  mita_setting:\n    num_landmarks: 8\n    topk: 8\n    route_topk: 1\n"
        "    shared_scale: paper\n")
