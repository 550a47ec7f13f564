"""The service graph in one function: two classifier deployments behind the gateway.

``serve run deploy/serve_config.yaml`` or ``python -m service`` import ``build_app`` from
here; every tunable (replicas, queue limits, A/B weights, batch size) lives in the config file.
"""

from __future__ import annotations

from ray.serve import Application

from .classifier import Classifier
from .gateway import Gateway

DEFAULT_CHECKPOINT = "checkpoints/listops-default"


def build_app(args: dict) -> Application:
    """Args: ``checkpoint`` (folder, relative to the project root unless absolute; default
    the shipped ``checkpoints/listops-default``), ``device`` (``auto`` | ``cpu`` | ``cuda``)
    and ``mita_backend`` (``mita_attention``'s backend, default ``auto``). Both classifier
    deployments load the same checkpoint."""
    checkpoint = args.get("checkpoint", DEFAULT_CHECKPOINT)
    device = args.get("device", "auto")
    backend = args.get("mita_backend", "auto")
    mita = Classifier.options(name="MiTAClassifier").bind(checkpoint, "mita", device, backend)
    dense = Classifier.options(name="DenseClassifier").bind(checkpoint, "dense", device)
    return Gateway.bind(mita, dense)
