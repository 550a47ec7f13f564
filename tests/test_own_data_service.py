"""A user's checkpoint served over HTTP beside the ListOps one: two applications under two route
prefixes in one Serve config, each with its own task — text tokenized by the checkpoint's
tokenizer, ``label_name`` in the answer, ``/v1/models`` showing the task — answering what the
plain engine answers in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ray.serve.schema import ServeDeploySchema

from mita.config import checkpoint_config, checkpoint_metadata
from mita.task import checkpoint_task
from mita.train import main as train_main
from service.config_file import read_yaml
from service.engine import ClassifierEngine

ROOT = Path(__file__).resolve().parents[1]
NOVELS = ["Emma", "Mansfield Park", "Northanger Abbey", "Persuasion", "Pride and Prejudice",
          "Sense and Sensibility"]


TINY = ["--dim", "16", "--ffn-dim", "32", "--num-heads", "2", "--depth", "1",
        "--num-landmarks", "4", "--topk", "4", "--threads", "1", "--batch-size", "8"]


IMAGES = "checkpoints/fashion-mnist-14x14"
# The shipped image checkpoint's right answers on the sample's 100 images, MiTA and dense
# alike (its validation accuracy on the first 2,000 test images: 77.6 % MiTA, 77.3 % dense).
SAMPLE_RIGHT = 75


def with_documented_apps(session: ServeDeploySchema, checkpoints: dict[str, str]
                         ) -> ServeDeploySchema:
    """The session's config and, beside it, the second application of
    ``deploy/serve_config.own-data.yaml`` once per ``{route prefix: checkpoint}`` (its
    replicas asking for no CPU, as the session's: the suite shares two cores)."""
    raw = session.model_dump(exclude_unset=True)
    for prefix, checkpoint in checkpoints.items():
        own = read_yaml(ROOT / "deploy/serve_config.own-data.yaml")["applications"][1]
        own |= {"name": f"own{prefix.replace('/', '-')}", "route_prefix": prefix}
        own["args"]["checkpoint"] = str(checkpoint)
        for d in own["deployments"]:
            d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_cpus": 0}
        raw["applications"].append(own)
    return ServeDeploySchema.model_validate(raw)


@pytest.fixture(scope="module")
def own_apps(service, tmp_path_factory):
    """At /own a checkpoint trained here on the shipped Austen sample (real text, six novels)
    with a subword tokenizer learned from it (the byte-level default: test_labelled_data), at
    /images the shipped Fashion-MNIST checkpoint (2-D landmark pooling), both beside ListOps
    in one redeploy; the session's config again afterwards."""
    from service import launch

    ck = tmp_path_factory.mktemp("own") / "austen"
    train_main(["--train", str(ROOT / "examples/austen-512.tsv"), "--valid",
                str(ROOT / "examples/austen-512-valid.tsv"), "--out", str(ck), "--steps", "4",
                "--eval-every", "4", "--max-len", "400", "--subword-vocab", "400", *TINY])
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
    local = engine.run([np.array(ids, dtype=np.int32)])[0]
    labels = NOVELS
    for body in ({"text": text, "variant": "mita"}, {"ids": ids, "variant": "mita"}):
        r = c.post("/own/v1/classify", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["n"] == len(ids) < len(text.encode()) and got["variant"] == "mita"
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
                    "max_length": 400, "truncate": "tail", "grid": None}
    # the ListOps application at / is unchanged, and names its labels by their values
    r = c.post("/v1/classify", json={"text": "[MAX 2 9 ]"})
    assert r.status_code == 200 and r.json()["label_name"] == str(r.json()["label"])
    assert c.post("/v1/classify", json={"text": "[MAX 2"}).status_code == 422
    assert c.get("/v1/models").json()["task"]["name"] == "listops"


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
