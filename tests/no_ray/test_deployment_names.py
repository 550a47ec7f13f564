"""The deployment names written out in deploy/ (YAML cannot import them) are
``settings.DEPLOYMENTS``, the names the service gives its deployments."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from service.settings import DEPLOYMENTS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_FILES = [*sorted(DEPLOY.glob("serve_config*.yaml")), DEPLOY / "kuberay" / "rayservice.yaml"]


def applications(path: Path) -> list[dict]:
    """The Serve applications of a config file, or of a RayService's embedded config."""
    raw = yaml.safe_load(path.read_text())
    if raw.get("kind") == "RayService":
        raw = yaml.safe_load(raw["spec"]["serveConfigV2"])
    return raw["applications"]


def test_every_file_that_lists_deployments_is_checked():
    listing = {p for p in DEPLOY.rglob("*.y*ml")
               if re.search(r"^\s*deployments:", p.read_text(), re.M)}
    assert listing == set(SERVE_FILES)


@pytest.mark.parametrize("path", SERVE_FILES, ids=lambda p: p.name)
def test_serve_files_name_the_tables_deployments(path):
    for app in applications(path):
        names = [d["name"] for d in app["deployments"]]
        assert sorted(names) == sorted(DEPLOYMENTS.values()), (path.name, app["name"])


def test_alert_tests_label_deployments_of_the_table():
    """The ``deployment`` label of ``mita_serve_config_refused`` is the deployment's name."""
    text = (DEPLOY / "prometheus" / "alerts_test.yml").read_text()
    labels = re.findall(r'\bdeployment(?:="|: )(\w+)', text)
    assert labels and set(labels) <= set(DEPLOYMENTS.values())
