"""The (m, k, s) advisor on the shipped checkpoint and generated ListOps: its quality numbers,
its recommendation, and that the recommended setting, served through the serve config's
``mita_setting``, gives the advised numbers again."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from mita.data.vocab import Vocabulary
from mita.model import EncoderClassifier, ModelConfig, save_checkpoint
from profiler import advise, advise_report, recommend
from profiler.advise_config import AdviseConfig, Constraint, Setting, default_grid, parse_setting
from service.app import build_app, served_config
from service.engine import ClassifierEngine
from service.settings import AppArgs

from ..helpers import CHECKPOINT

SMALL = dict(checkpoint=CHECKPOINT, ns=[256], size=24, min_length=100, max_length=300,
             repeats=1)


def test_compare_on_a_hand_example_and_on_itself():
    """Real values: argmax ties go to the first class (as ``np.argmax``); KL(ref ‖ probs) =
    ½ ln(0.5/0.25) + ½ ln(0.5/0.75) = ½ ln(4/3) for row 0, 0 for row 1 (mean: half that)."""
    ref = np.array([[0.5, 0.5], [0.9, 0.1]])
    probs = np.array([[0.25, 0.75], [0.9, 0.1]])
    got = advise.compare(ref, probs, np.array([1, 0]))
    assert got["accuracy"] == 1.0 and got["agreement"] == 0.5
    assert got["kl"] == pytest.approx(0.5 * 0.5 * math.log(4 / 3), rel=1e-12)
    # Paired SE of the accuracy difference: only row 0 differs (dense wrong, this right),
    # b = 0, c = 1, n = 2: 100·√(1 − 1/2)/2 points.
    assert got["drop_se_points"] == pytest.approx(100 * math.sqrt(0.5) / 2, rel=1e-12)
    # MiTA compared with itself, on the served model's real probabilities.
    cfg = AdviseConfig(grid=[], constraint=Constraint("agreement", 0.99), **SMALL)
    data = advise.load_data(cfg, 10)
    engine = ClassifierEngine(CHECKPOINT, "mita", "cpu", cuda_graphs=False)
    p = np.array([r["probabilities"] for r in engine.run([s for s, _ in data])])
    again = np.array([r["probabilities"] for r in engine.run([s for s, _ in data])])
    same = advise.compare(p, again, np.array([y for _, y in data]))
    assert same["agreement"] == 1.0 and same["kl"] == 0.0 and same["drop_se_points"] == 0.0
    assert same["accuracy"] == np.mean(p.argmax(1) == [y for _, y in data])


def test_sequence_of_length_is_the_data_cut_to_n():
    data = [([1, 2, 3], 0), ([4, 5], 1)]
    assert advise.sequence_of_length(data, 7).tolist() == [1, 2, 3, 4, 5, 1, 2]
    assert advise.sequence_of_length(data, 2).tolist() == [1, 2]


def test_default_grid_and_setting_parsing():
    grid = default_grid([1024, 4096, 16384], ["paper"])
    # Fig. 5: m = k = 16, 32, 64 for these N, with the fixed 8…64: four sides, s = 1 and 2.
    assert [(s.m, s.k, s.s) for s in grid] == [(8, 8, 1), (8, 8, 2), (16, 16, 1), (16, 16, 2),
                                              (32, 32, 1), (32, 32, 2), (64, 64, 1),
                                              (64, 64, 2)]
    assert parse_setting("32x16x2", "official") == Setting(32, 16, 2, "official")
    for bad in ("32", "4x4x5", "0x4", "axb"):
        with pytest.raises(ValueError, match="setting"):
            parse_setting(bad)


@pytest.mark.slow
def test_recommended_setting_through_the_serve_config_reproduces_the_advice(tmp_path):
    """A two-setting grid; then the snippet is parsed as the serve config's application args
    (``settings.AppArgs``) and served by the classifier engine the deployment runs: the same
    accuracy, agreement and KL (one unpadded forward per sequence on both sides: exact)."""
    out = tmp_path / "advise"
    cfg = AdviseConfig(grid=[parse_setting("4x4"), parse_setting("16x16")],
                       constraint=Constraint("accuracy_drop", 100.0), out=out,
                       **SMALL)
    rep = advise.run_advise(cfg)
    assert rep["skipped"] == [] and rep["config"]["sequences"] == 24
    rows = {r["setting"]: r for r in rep["rows"]}
    row = rows["m16 k16 s1 paper"]
    lat = row["latency"][256]
    assert lat["speedup"] == lat["dense_p50_ms"] / lat["p50_ms"]  # timed side by side
    assert lat["min_ms"] <= lat["p50_ms"] <= lat["max_ms"]
    assert row["retention"] == row["accuracy"] / rows["dense"]["accuracy"]
    # Which setting wins depends on this machine's timings (tested on fixed numbers below);
    # the quality of whichever is served does not.
    snippet = advise_report.serve_snippet(row, cfg.checkpoint)
    args = AppArgs.model_validate(yaml.safe_load(snippet)["args"])
    data = advise.load_data(cfg, 10)
    labels = np.array([y for _, y in data])
    served = ClassifierEngine(args.checkpoint, "mita", "cpu", cuda_graphs=False,
                              setting=args.mita_setting.overrides())
    assert served.info["config"]["num_landmarks"] == row["m"]
    dense = ClassifierEngine(args.checkpoint, "dense", "cpu", cuda_graphs=False)
    got = advise.compare(*(np.array([r["probabilities"] for r in e.run([s for s, _ in data])])
                           for e in (dense, served)), labels)
    keys = ("accuracy", "agreement", "kl", "drop_se_points")
    assert {k: got[k] for k in keys} == {k: row[k] for k in keys}

    files = advise_report.write_outputs(rep, out)
    assert json.loads(files["json"].read_text())["overall"]["setting"] == rep["overall"][
        "setting"]
    assert files["png"].stat().st_size > 10_000
    assert ("yaml" in files) == (rep["overall"]["setting"] is not None)

    # Resumable: a bigger grid with the same inputs runs only the new setting's two units.
    lines = (out / advise.RUN_FILE).read_text().splitlines()
    assert len(lines) == 1 + 2 + 2 * 2  # header, dense and two settings (quality + N = 256)
    cfg.grid.append(parse_setting("8x8x2"))
    rep2 = advise.run_advise(cfg)
    assert len((out / advise.RUN_FILE).read_text().splitlines()) == len(lines) + 2
    assert [r["accuracy"] for r in rep2["rows"][:3]] == [r["accuracy"] for r in rep["rows"]]
    # Other inputs in the same folder: refused, naming what differs.
    cfg.size = 12
    with pytest.raises(ValueError, match=r"other inputs \(differs in size\)"):
        advise.run_advise(cfg)


def _units(dense_acc, settings):
    """Finished units for ``report``: dense quality, and per setting (name → (accuracy,
    agreement, {N: (setting ms, dense ms timed beside it)}))."""
    done = {("quality", "dense"): {"accuracy": dense_acc, "agreement": 1.0, "kl": 0.0,
                                   "drop_se_points": 0.0}}
    for name, (acc, agree, lat) in settings.items():
        done[("quality", name)] = {"accuracy": acc, "agreement": agree, "kl": 0.1,
                                   "drop_se_points": 1.0}
        for n, (ms, dense_ms) in lat.items():
            done[("latency", name, n)] = {
                "p50_ms": ms, "min_ms": ms, "max_ms": ms, "dense_p50_ms": dense_ms,
                "stages_ms": {}, "peak_memory_bytes": None, "peak_memory_kind": "x"}
            done[("latency", "dense", n)] = {
                "p50_ms": dense_ms, "min_ms": dense_ms, "max_ms": 2 * dense_ms,
                "stages_ms": {}, "peak_memory_bytes": None, "peak_memory_kind": "x"}
    return done


def test_recommendation_on_fixed_numbers():
    """The largest side-by-side speed-up among settings meeting the constraint and beating
    dense; 'dense is faster' when none beats it; retention '-' when dense gets nothing right;
    one setting for all N only if it beats dense at every N."""
    a, b, c = (parse_setting(x) for x in ("8x8", "16x16", "32x32"))
    cfg = AdviseConfig(grid=[a, b, c], constraint=Constraint("agreement", 0.8),
                       **(SMALL | {"ns": [1024, 4096]}))
    done = _units(0.5, {a.name: (0.40, 0.70, {1024: (1.0, 4.0), 4096: (2.0, 40.0)}),
                        b.name: (0.50, 0.85, {1024: (3.0, 4.0), 4096: (5.0, 40.0)}),
                        c.name: (0.55, 0.90, {1024: (5.0, 4.0), 4096: (4.0, 40.0)})})
    rep = recommend.report(cfg, done, [], 24)
    r1024, r4096 = rep["recommendations"]
    assert (r1024["setting"], r1024["speedup"]) == (b.name, 4.0 / 3.0)  # a fails agreement
    assert (r4096["setting"], r4096["speedup"]) == (c.name, 10.0)
    assert r4096["retention"] == 0.55 / 0.5 and r4096["accuracy_drop_points"] == pytest.approx(-5)
    assert rep["overall"]["setting"] == b.name  # c is slower than dense at N = 1024
    assert "\n    num_landmarks: 16\n    topk: 16\n" in rep["overall"]["snippet"]
    assert rep["noisy"] == [["dense", 1024], ["dense", 4096]]  # max = 2 × min
    # Nothing beats dense at N = 1024 once b is slower too.
    done[("latency", b.name, 1024)]["p50_ms"] = 8.0
    rep = recommend.report(cfg, done, [], 24)
    assert rep["recommendations"][0]["answer"] == (
        "N = 1024: dense is faster — MiTA does not pay off here (the fastest setting meeting "
        "agreement with dense ≥ 80.0 %, m32 k32 s1 paper, runs at 0.80× dense's speed)")
    assert rep["overall"]["setting"] is None
    # Dense right on no sequence: retention undefined, shown as '-', no crash.
    rep = recommend.report(cfg, _units(0.0, {c.name: (0.1, 0.9, {1024: (1.0, 4.0),
                                                                4096: (1.0, 40.0)})}), [], 24)
    assert rep["rows"][3]["retention"] is None
    assert rep["recommendations"][0]["answer"].endswith("(dense 0.0 %, retention -)")
    row = ("| m32 k32 s1 paper | 32 | 32 | 1 | paper | 10.0 % | - | - | -10.0 ± 1.0 | 90.0 % | "
           "0.1000 | - |")
    assert row in advise_report.markdown(rep)


@pytest.mark.slow
def test_no_setting_meets_and_the_budget_stops_cleanly(tmp_path):
    cfg = AdviseConfig(grid=[parse_setting("1x1")],
                       constraint=Constraint("agreement", 1.0),
                       out=tmp_path / "a", **SMALL)
    rep = advise.run_advise(cfg)
    row = rep["rows"][1]
    assert row["agreement"] < 1.0  # one landmark, one key: not dense's answers
    assert rep["recommendations"][0]["setting"] is None
    assert rep["recommendations"][0]["answer"].startswith(
        "no setting meets agreement with dense ≥ 100.0 % at N = 256 (best agreement "
        f"{100 * row['agreement']:.1f} %")
    assert rep["overall"] == {"setting": None, "answer": "no setting meets agreement with "
                                                         "dense ≥ 100.0 % and beats dense at "
                                                         "every N in [256]"}
    (tmp_path / "a" / "serve_snippet.yaml").write_text("an earlier recommendation")
    assert "yaml" not in advise_report.write_outputs(rep, tmp_path / "a")
    assert not (tmp_path / "a" / "serve_snippet.yaml").exists()  # never left to deploy
    # A budget already spent: nothing runs, every unit is listed as skipped, no crash.
    cfg.budget_s, cfg.out = 0.0, tmp_path / "b"
    rep = advise.run_advise(cfg)
    assert len(rep["skipped"]) == 4 and rep["recommendations"][0]["setting"] is None
    assert "Not run (time budget): 4 units" in advise_report.markdown(rep)


def test_serve_config_mita_setting_is_checked_at_deploy(tmp_path):
    with pytest.raises(ValueError, match=r"mita_setting: config: 'route_topk' s = 3 exceeds "
                                         r"'num_landmarks' m = 2"):
        build_app({"mita_setting": {"num_landmarks": 2, "route_topk": 3}})
    with pytest.raises(ValueError, match="mita_setting"):
        build_app({"mita_setting": {"m": 2}})
    # MiTASetting holds types only: a count below 1 is ModelConfig's to refuse (LIMITS: 2^24)
    with pytest.raises(ValueError, match=r"mita_setting: config field 'topk' must be an int in "
                                         r"\[1, 16777216\], got 0"):
        build_app({"mita_setting": {"topk": 0}})
    app = build_app({"mita_setting": {"num_landmarks": 32, "topk": 8}})
    assert app is not None
    # A 2-D landmark grid fixes N = H·W: served, and its task says so (a request of another N
    # gets 422: mita.data.task.Task.length_refusal)
    grid = ModelConfig(num_landmarks=4, topk=4, landmark_grid=(4, 6))
    save_checkpoint(EncoderClassifier(grid), tmp_path / "grid")
    _, _, task = served_config({"checkpoint": str(tmp_path / "grid")})
    assert task.grid == (4, 6) and task.length_refusal(24) is None
    assert task.length_refusal(25) == ("this model classifies 4×6 grids (2-D landmark pooling): "
                                       "a sequence must have exactly 24 tokens, got 25")


def test_data_outside_the_checkpoints_vocabulary_is_refused(tmp_path):
    """Byte-level text against the 16-id ListOps checkpoint: 'h' is byte 104 → id 105."""
    path = tmp_path / "text.tsv"
    path.write_text("1\thello\n0\tworld\n")
    cfg = AdviseConfig(grid=[], constraint=Constraint("agreement", 0.99),
                       **(SMALL | {"size": 2}), data=str(path), data_format="text")
    with pytest.raises(ValueError, match=r"row 1 has token id 105, not in the checkpoint's "
                                         r"vocabulary \(ids 0…15 but the padding id 0\); does "
                                         r"--format text suit"):
        advise.load_data(cfg, 10, Vocabulary(16, 0))
    assert advise.load_data(cfg, 10)[0] == ([105, 102, 109, 109, 112], 1)
    with pytest.raises(ValueError, match=r"text.tsv:1: label 1 outside \[0, 1\)"):
        advise.load_data(cfg, 1)
