"""The service graph in one function: two classifier deployments behind the gateway.

``serve run deploy/serve_config.yaml`` or ``python -m service`` import ``build_app`` from
here; every tunable (replicas, queue limits, A/B weights, batch size) lives in the config file.
"""

from __future__ import annotations

from ray.serve import Application

from .classifier import Classifier
from .engine import DTYPE_CHOICES
from .gateway import Gateway

DEFAULT_CHECKPOINT = "checkpoints/listops-default"


def build_app(args: dict) -> Application:
    """Args: ``checkpoint`` (folder, relative to the project root unless absolute; default
    the shipped ``checkpoints/listops-default``), ``device`` (``auto`` | ``cpu`` | ``cuda``),
    ``mita_backend`` (``mita_attention``'s backend, default ``auto``) and ``dtype`` (``auto``
    | ``float32`` | ``bfloat16`` | ``float16``; auto: bfloat16 on CUDA, float32 on CPU). Both
    classifier deployments load the same checkpoint in the same dtype.

    Raises ValueError for a ``dtype`` outside those names (at deploy time, not in a replica).
    """
    checkpoint = args.get("checkpoint", DEFAULT_CHECKPOINT)
    device = args.get("device", "auto")
    backend = args.get("mita_backend", "auto")
    dtype = args.get("dtype", "auto")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"application arg 'dtype' must be one of {DTYPE_CHOICES}, "
                         f"got {dtype!r}")
    mita = Classifier.options(name="MiTAClassifier").bind(checkpoint, "mita", device, backend,
                                                          dtype)
    dense = Classifier.options(name="DenseClassifier").bind(checkpoint, "dense", device,
                                                            "auto", dtype)
    return Gateway.bind(mita, dense)
