"""The shipped GPU config placed by Ray's own scheduler on a machine with one GPU.

Ray's GPUs are logical resources: ``ray.init(num_gpus=1)`` declares one on this CPU machine,
and Ray assigns it (``CUDA_VISIBLE_DEVICES``) to the replicas that ask for a share. The
classifiers run on the CPU here (``device: cpu``); what is tested is the placement: both
variants' replicas are scheduled at once on GPU 0, so the A/B comparison can run on a
single-GPU host. Runs in a fresh process (this session's service owns the in-process Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..helpers import free_port

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import httpx, ray
    from service import launch

    http_port, metrics_port = int(sys.argv[1]), int(sys.argv[2])
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", namespace="serve", num_cpus=2, num_gpus=1, include_dashboard=False,
             _node_ip_address="127.0.0.1", _metrics_export_port=metrics_port)
    config = launch.load_config(launch.GPU_CONFIG, {
        "http_options": {"port": http_port}, "args": {"device": "cpu"},
        "deployments": {name: {"ray_actor_options": {"num_cpus": 0}}
                        for name in ("Gateway", "MiTAClassifier", "DenseClassifier")}})
    try:
        url = launch.start(config, metrics_port=metrics_port, timeout_s=240)
        with httpx.Client(base_url=url, timeout=120) as client:
            models = client.get("/v1/models").json()["variants"]
            answers = [client.post("/v1/classify", json={"text": "[MAX 2 [MIN 4 7 ] 0 ]",
                                                         "variant": v}).status_code
                       for v in ("mita", "dense")]
        status = {name: dict(d.replica_states) for name, d in
                  ray.serve.status().applications["mita-serve"].deployments.items()}
        print("RESULT " + json.dumps({
            "gpu_ids": {v: models[v]["gpu_ids"] for v in models},
            "dtype": {v: models[v]["dtype"] for v in models},
            "answers": answers, "replicas": status,
            "gpus_left": ray.available_resources().get("GPU", 0.0)}))
    finally:
        launch.stop()
''')


def test_gpu_config_places_both_classifiers_on_one_gpu(tmp_path):
    script = tmp_path / "place.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(free_port()), str(free_port())],
                          capture_output=True, text=True, timeout=420, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["gpu_ids"] == {"mita": ["0"], "dense": ["0"]}  # one GPU, both variants
    assert result["replicas"]["MiTAClassifier"] == {"RUNNING": 1}
    assert result["replicas"]["DenseClassifier"] == {"RUNNING": 1}
    assert result["answers"] == [200, 200]
    assert result["gpus_left"] == pytest.approx(0.5)  # 2 × 0.25 taken
    assert result["dtype"] == {"mita": "float32", "dense": "float32"}  # auto on a CPU device
