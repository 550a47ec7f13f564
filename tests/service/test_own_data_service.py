"""A user's checkpoint served over HTTP beside the ListOps one: two applications under two route
prefixes in one Serve config, each with its own task — text tokenized by the checkpoint's
tokenizer, ``label_name`` in the answer, ``/v1/models`` showing the task — answering what the
plain engine answers in this process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from loadtest.__main__ import main as loadtest_main
from mita.config import checkpoint_config, checkpoint_metadata
from mita.data.task import checkpoint_task
from mita.training.train import main as train_main
from service.engine import ClassifierEngine
from service.settings import VARIANTS

from ..helpers import wait_for, with_documented_apps

ROOT = Path(__file__).resolve().parents[2]
NOVELS = ["Emma", "Mansfield Park", "Northanger Abbey", "Persuasion", "Pride and Prejudice",
          "Sense and Sensibility"]


# The Austen checkpoint's trained length (--max-len, in subword tokens): its 512-byte windows
# are ~320 tokens (0.63 per byte), so every text is longer and is cut, in training and serving.
MAX_LEN = 128
TINY = ["--dim", "16", "--ffn-dim", "32", "--num-heads", "2", "--depth", "1",
        "--num-landmarks", "4", "--topk", "4", "--threads", "1", "--batch-size", "8"]


IMAGES = "checkpoints/fashion-mnist-14x14"
# The shipped image checkpoint's right answers on the sample's 100 images, MiTA and dense
# alike (its validation accuracy on the first 2,000 test images: 77.6 % MiTA, 77.3 % dense).
SAMPLE_RIGHT = 75


# sharing: answers, counts and refusals, nothing timed: runs beside the tests/own_ray/
# tests instead of waiting for the cores lock (tests/lanes.py)
pytestmark = pytest.mark.sharing


@pytest.fixture(scope="module")
def own_apps(service, tmp_path_factory):
    """At /own a checkpoint trained here on the shipped Austen sample (real text, six novels)
    with a subword tokenizer learned from it (the byte-level default: test_labelled_data) and
    ``--max-len MAX_LEN`` (shorter than every text: each is cut), at
    /images the shipped Fashion-MNIST checkpoint (2-D landmark pooling), both beside ListOps
    in one redeploy; the session's config again afterwards."""
    from service import launch

    ck = tmp_path_factory.mktemp("own") / "austen"
    train_main(["--train", str(ROOT / "examples/austen-512.tsv"), "--valid",
                str(ROOT / "examples/austen-512-valid.tsv"), "--out", str(ck), "--steps", "4",
                "--eval-every", "4", "--max-len", str(MAX_LEN), "--subword-vocab", "400",
                *TINY])
    session = launch.load_config(launch.CPU_CONFIG, service.overrides)
    launch.deploy(with_documented_apps(session, {"/own": ck, "/images": IMAGES}))
    try:
        yield ck
    finally:
        launch.deploy(session)  # Serve deletes the applications the config no longer names


def test_a_users_checkpoint_answers_with_label_names_beside_listops(service, own_apps):
    c = service.client
    line = (ROOT / "examples/austen-512-valid.tsv").read_text().split("\n")[1]
    title, text = line.split("\t")
    assert title == "Emma"
    engine = ClassifierEngine(own_apps, "mita", "cpu", "torch", "auto")
    meta = checkpoint_metadata(own_apps)
    tok = checkpoint_task(meta, checkpoint_config(own_apps), own_apps).tokenizer
    ids = tok.encode(text)
    assert MAX_LEN < len(ids) < len(text.encode())
    local = engine.run([np.array(ids[:MAX_LEN], dtype=np.int32)])[0]  # cut as trained
    labels = NOVELS
    for body in ({"text": text, "variant": "mita"}, {"ids": ids, "variant": "mita"}):
        r = c.post("/own/v1/classify", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["n"] == MAX_LEN and got["variant"] == "mita"
        assert (got["original_n"], got["truncated"]) == (len(ids), "tail")
        assert got["label"] == local["label"] and got["label_name"] == labels[got["label"]]
        assert got["probabilities"] == pytest.approx(local["probabilities"], abs=1e-6)
    # the ListOps grammar is the ListOps checkpoint's only: here "[MAX 2" is just bytes
    assert c.post("/own/v1/classify", json={"text": "[MAX 2"}).status_code == 200
    r = c.post("/own/v1/classify", json={"ids": [1, 400]})
    assert r.status_code == 422 and "[1, 399]" in r.json()["error"]
    task = c.get("/own/v1/models").json()["task"]
    assert task == {"name": "austen-512", "labels": labels,
                    "tokenizer": {"kind": "sentencepiece", "file": "tokenizer.model",
                                  "vocab_size": 400}, "takes_text": True,
                    "max_length": MAX_LEN, "truncate": "tail", "grid": None,
                    "architecture": None, "positions": None}
    # the ListOps application at / is unchanged, and names its labels by their values
    r = c.post("/v1/classify", json={"text": "[MAX 2 9 ]"})
    assert r.status_code == 200 and r.json()["label_name"] == str(r.json()["label"])
    assert c.post("/v1/classify", json={"text": "[MAX 2"}).status_code == 422
    assert c.get("/v1/models").json()["task"]["name"] == "listops"


def test_a_long_text_is_served_as_training_cut_it(service, own_apps):
    """Serve exactly what was trained (issue 61, item 1). The checkpoint was trained on the
    first MAX_LEN tokens of each text (--max-len, --truncate tail): a longer text — as JSON
    text, as JSON ids, as binary ids, as a batch item — gets the answer of its first MAX_LEN
    tokens, from MiTA and from dense, and says it was cut (n, original_n, truncated). The same
    ids reach the same classifier through the same path (deterministic: each sequence its own
    unpadded forward, and far fewer than staged_profile_every = 100 forwards here, so none is
    a sampled staged one), so the probabilities are compared exactly, tolerance 0; against
    this process's engine (the PyTorch stages, not the service's compiled CPU kernels), to
    1e-6 as in the test above. A text
    of more tokens than the gateway's max_n is cut, not refused: max_n applies to what is
    served."""
    c = service.client
    rows = (ROOT / "examples/austen-512-valid.tsv").read_text().split("\n")
    text = rows[2].split("\t")[1]
    tok = checkpoint_task(checkpoint_metadata(own_apps), checkpoint_config(own_apps),
                          own_apps).tokenizer
    ids = tok.encode(text)
    assert len(ids) > MAX_LEN
    cut = ids[:MAX_LEN]
    # a text of more tokens than /own's max_n (16,384 in deploy/serve_config.own-data.yaml;
    # ~0.63 tokens per byte), its body (~40 KB) far below max_body_bytes (4 MiB)
    max_n = c.get("/own/v1/models").json()["ab_policy"]["max_n"]
    huge = " ".join(row.split("\t")[1] for row in rows[1:] if "\t" in row)
    while len(tok.encode(huge)) <= max_n:
        huge += " " + huge
    huge_ids = tok.encode(huge)
    for variant in VARIANTS:
        engine = ClassifierEngine(own_apps, variant, "cpu", "torch", "auto")
        local = engine.run([np.array(cut, dtype=np.int32)])[0]
        plain = c.post("/own/v1/classify", json={"ids": cut, "variant": variant})
        assert plain.status_code == 200, plain.text
        want = plain.json()
        assert want["n"] == MAX_LEN and not {"original_n", "truncated"} & set(want)
        assert want["label"] == local["label"]
        assert want["probabilities"] == pytest.approx(local["probabilities"], abs=1e-6)
        answers = [c.post("/own/v1/classify", json={"text": text, "variant": variant}),
                   c.post("/own/v1/classify", json={"ids": ids, "variant": variant}),
                   c.post("/own/v1/classify/binary", params={"dtype": "int32",
                                                             "variant": variant},
                          content=np.array(ids, dtype="<i4").tobytes(),
                          headers={"content-type": "application/octet-stream"})]
        batch = c.post("/own/v1/classify/batch", json={"items": [
            {"text": text, "variant": variant}, {"ids": cut, "variant": variant}]})
        assert batch.status_code == 200, batch.text
        for r in answers:
            assert r.status_code == 200, r.text
        got = [r.json() for r in answers] + batch.json()["results"]
        for g in got[:-1]:
            assert g == want | {"original_n": len(ids), "truncated": "tail"}
        assert got[-1] == want  # the batch's cut item: nothing cut, nothing reported
        r = c.post("/own/v1/classify", json={"text": huge, "variant": variant})
        assert r.status_code == 200, r.text
        assert (r.json()["n"], r.json()["original_n"], r.json()["truncated"]) == (
            MAX_LEN, len(huge_ids), "tail")
        assert len(huge_ids) > max_n
    # a model without a trained length (ListOps at /) still refuses a sequence past its max_n
    listops_max_n = c.get("/v1/models").json()["ab_policy"]["max_n"]
    r = c.post("/v1/classify/binary", content=bytes([3]) * (listops_max_n + 1),
               headers={"content-type": "application/octet-stream"})
    assert r.status_code == 422 and r.json()["error"] == (
        f"sequence length N = {listops_max_n + 1} exceeds max_n = {listops_max_n}")


def test_the_shipped_image_model_answers_images_with_2d_pooling(service, own_apps):
    """The shipped Fashion-MNIST checkpoint at /images: the sample's 100 real test images (ten
    per class) answered as the engine answers them here, with their class names; a sequence
    of another length refused; /v1/models shows the 14×14 grid."""
    c = service.client
    rows = [json.loads(line) for line in (ROOT / "examples/fashion-mnist-14x14.jsonl")
            .read_text().splitlines()]
    engine = ClassifierEngine(ROOT / IMAGES, "mita", "cpu", "torch", "auto")
    models = c.get("/images/v1/models").json()
    labels = models["task"]["labels"]
    assert models["task"]["grid"] == [14, 14]
    assert models["variants"]["mita"]["config"]["landmark_grid"] == [14, 14]
    right = 0
    for row in rows:
        r = c.post("/images/v1/classify", json={"ids": row["ids"], "variant": "mita"})
        assert r.status_code == 200, r.text
        got = r.json()
        local = engine.run([np.array(row["ids"], dtype=np.int32)])[0]
        assert got["label"] == local["label"] and got["label_name"] == labels[got["label"]]
        right += got["label_name"] == row["label"]
    assert right == SAMPLE_RIGHT
    r = c.post("/images/v1/classify", json={"ids": rows[0]["ids"][:-1]})
    assert r.status_code == 422 and r.json()["error"] == (
        "this model classifies 14×14 grids (2-D landmark pooling): a sequence must have "
        "exactly 196 tokens, got 195")


def test_an_ids_checkpoint_is_load_tested_with_its_rows_and_never_sent_listops(
        service, own_apps, tmp_path, capsys):
    """The load tester against the image checkpoint at /images (ids only, a 14×14 grid: 196
    tokens): with ``--data`` (its sample's rows) every request is answered; without, the
    command refuses before it sends anything, and the service's own request counts say so."""
    images = f"{service.url}/images"
    rows = ROOT / "examples/fashion-mnist-14x14.jsonl"

    def classify_requests() -> int:  # every classify request the /images gateway recorded
        return sum(r["count"] for r in httpx.get(f"{images}/v1/stats", timeout=30).json()[
            "requests"])

    before = classify_requests()
    with pytest.raises(SystemExit) as e:
        loadtest_main(["run", "--url", images, "--n", "196", "--requests", "2", "--warmup",
                       "0", "--out", str(tmp_path / "refused")])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "python -m loadtest: error: the target serves task 'fashion-mnist-14x14' (ids only, "
        "vocabulary 257); generated ListOps expressions are not its input: pass --data FILE "
        "with its rows (a file in the format it was trained on)\n")
    assert not (tmp_path / "refused" / "loadtest.json").exists()

    summary = loadtest_main(["run", "--url", images, "--data", str(rows), "--n", "196",
                             "--variants", "mita", "dense", "--requests", "4", "--warmup", "1",
                             "--concurrency", "2", "--out", str(tmp_path / "run")])
    assert [(r["n"], r["variant"], r["sent"], r["ok"], r["errors"], r["served_n"])
            for r in summary["rows"]] == [(196, "dense", 4, 4, {}, [196, 196]),
                                          (196, "mita", 4, 4, {}, [196, 196])]
    assert summary["input"]["per_n"][0]["text"] == (
        "N = 196: 4 sequences of 1 row (rows 1–4 of 100), none cut; 196 ids sent")
    assert summary["error_budget"]["passed"] and summary["warnings"] == []
    md = (tmp_path / "run" / "loadtest.md").read_text()
    assert f"rows of {rows} (ids)" in md and "Target task: 'fashion-mnist-14x14'" in md
    # 2 phases × (1 warm-up + 4 timed) arrived, and nothing from the refused run
    assert wait_for(lambda: classify_requests() - before >= 10)
    assert classify_requests() - before == 10
