"""``python -m service --check``: every check the start makes that needs nothing started."""

from __future__ import annotations

import socket

import pytest
import yaml

from service import __main__ as cli
from service import launch, preflight

from .helpers import free_port


def config_file(tmp_path, **http_options) -> str:
    raw = yaml.safe_load(launch.CPU_CONFIG.read_text())
    raw["http_options"].update(http_options)
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_check_refuses_an_http_host_the_start_refuses(tmp_path, capsys):
    """Found by a user: ``http_options.host: 8.8.8.8`` passed ``--check`` ("OK") and the start
    then refused it ("cannot listen on 8.8.8.8:8000"). Both now go through one preflight."""
    path = config_file(tmp_path, host="8.8.8.8")
    with pytest.raises(SystemExit) as refused:
        cli.main(["--check", "--config", path, "--dashboard-host", "off"])
    assert str(refused.value).startswith("mita-serve: cannot listen on 8.8.8.8:8000 ("), (
        refused.value)
    assert "OK" not in capsys.readouterr().out
    config = launch.load_config(path)
    with pytest.raises(OSError, match=r"^cannot listen on 8\.8\.8\.8:8000 .* is "
                                      r"http_options\.host an address of this machine\?"):
        preflight.preflight(config, metrics_port=free_port())


def test_check_warns_of_a_busy_port_the_start_refuses(tmp_path, capsys):
    """A port in use fails the start; ``--check`` (run before ``serve deploy`` of the running
    instance's next config, whose ports are its own) says so and passes."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = config_file(tmp_path, port=port)
        cli.main(["--check", "--config", path, "--dashboard-host", "off",
                  "--metrics-port", str(free_port())])
        out = capsys.readouterr().out
        with pytest.raises(OSError, match=rf"^port {port} on 127\.0\.0\.1 is in use"):
            preflight.preflight(launch.load_config(path), metrics_port=free_port())
    assert f"mita-serve: warning: port {port} on 127.0.0.1 is in use" in out, out
    assert out.rstrip().endswith("OK (the file, its user_configs, checkpoints, devices and "
                                 "listening addresses)"), out
