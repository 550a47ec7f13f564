"""A busy port and a bad config are refused by python -m service before Ray starts (a Ray of its
own would otherwise start)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml


@pytest.mark.slow
def test_busy_port_and_bad_config_refused_before_ray_starts(tmp_path):
    """``python -m service`` on a port another process listens on exits at once naming the
    port (it waited ~37 s for Ray's start-up timeout before); a config with a bad user_config
    exits naming the deployment and field."""
    import socket
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = yaml.safe_load((root / "deploy" / "serve_config.yaml").read_text())
        config["http_options"]["port"] = port
        (tmp_path / "busy.yaml").write_text(yaml.safe_dump(config))
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "service", "--config",
                               str(tmp_path / "busy.yaml")], capture_output=True, text=True,
                              timeout=120, cwd=root)
        took = time.monotonic() - start
    assert done.returncode == 1 and took < 30, (took, done.stderr[-800:])
    assert (f"refusing to start: port {port} on 127.0.0.1 is in use" in done.stderr
            and "http_options.port" in done.stderr), done.stderr[-800:]
    config["http_options"]["port"] = 8000
    config["applications"][0]["deployments"][1]["user_config"]["deterministic"] = "false"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "service", "--config", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 1
    assert (f"refusing to start: {tmp_path / 'bad.yaml'}: application 'mita-serve' deployment "
            "'MiTAClassifier' user_config: deterministic: Input should be a valid boolean"
            ) in done.stderr
