"""``python -m service --check``: every check the start makes that needs nothing started."""

from __future__ import annotations

import socket

import pytest
import yaml

from service import __main__ as cli
from service import launch, preflight

from ..helpers import free_port


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


def warm_start_file(tmp_path, warm_start: str) -> str:
    raw = yaml.safe_load(launch.CPU_CONFIG.read_text())
    gateway = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "Gateway")
    gateway["user_config"]["auto"] = {"warm_start": warm_start}
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("warm_start,why", [
    ("no/such/advise.json", "FileNotFoundError"),
    ("deploy/serve_config.yaml", "ValueError: not an advisor report: not JSON"),
])
def test_check_refuses_a_warm_start_file_the_gateway_cannot_use(tmp_path, capsys, warm_start,
                                                                  why):
    """It was "OK" at --check and at the start; the Gateway then only logged "warm start …
    not used" and served policy auto without the prior."""
    with pytest.raises(SystemExit) as refused:
        cli.main(["--check", "--config", warm_start_file(tmp_path, warm_start),
                  "--dashboard-host", "off", "--metrics-port", str(free_port())])
    assert str(refused.value).startswith(
        f"mita-serve: application 'mita-serve' deployment 'Gateway' user_config: "
        f"auto.warm_start '{warm_start}' cannot be used: {why}"), refused.value
    assert "OK" not in capsys.readouterr().out


def test_check_passes_the_shipped_advisor_report_as_warm_start(tmp_path, capsys):
    cli.main(["--check", "--config", warm_start_file(tmp_path, "benchmarks/advise-cpu/"
                                                               "advise.json"),
              "--dashboard-host", "off", "--metrics-port", str(free_port())])
    assert capsys.readouterr().out.rstrip().endswith("listening addresses)")


def test_a_live_update_with_an_unusable_warm_start_is_refused():
    """``serve deploy`` of such a config: the replica refuses the update and keeps serving
    with the last applied config (counted and shown as any refusal)."""
    from service.live_config import LiveConfig
    from service.routing import check_warm_start
    from service.settings import GatewayConfig

    live = LiveConfig(GatewayConfig, "deployment 'Gateway' user_config", counted=False,
                      check=lambda c: check_warm_start(c, "m16 k16 s1 paper"))
    assert live.update({"policy": "auto", "auto": {
        "warm_start": "benchmarks/advise-cpu/advise.json"}})
    assert not live.update({"policy": "auto", "auto": {"warm_start": "nope.json"}})
    assert live.value.auto.warm_start == "benchmarks/advise-cpu/advise.json"
    assert live.status()["state"] == "refused"
    assert live.status()["error"].startswith(
        "deployment 'Gateway' user_config: auto.warm_start 'nope.json' cannot be used: "
        "FileNotFoundError")
    with pytest.raises(ValueError, match="no row for the served setting 'm4 k4 s1 paper'"):
        check_warm_start(live.value, "m4 k4 s1 paper")
