"""The service graph in one function: two classifier deployments behind the gateway.

``serve run deploy/serve_config.yaml`` or ``python -m service`` import ``build_app`` from
here; every tunable (replicas, queue limits, A/B weights, batch size) lives in the config file.
"""

from __future__ import annotations

from ray.serve import Application

from .classifier import Classifier
from .gateway import Gateway
from .schemas import AppArgs, validated


def build_app(args: dict) -> Application:
    """Args: ``checkpoint`` (folder, relative to the project root unless absolute; default
    the shipped ``checkpoints/listops-default``), ``device`` (``auto`` | ``cpu`` | ``cuda``),
    ``mita_backend`` (``mita_attention``'s backend, default ``auto``) and ``dtype`` (``auto``
    | ``float32`` | ``bfloat16`` | ``float16``; auto: bfloat16 on CUDA, float32 on CPU). Both
    classifier deployments load the same checkpoint in the same dtype.

    ``cuda_graphs`` (default true): replay unstaged forwards from CUDA graphs on CUDA.
    Parsed strictly by ``schemas.AppArgs``.

    Raises ValueError naming every refused arg (at deploy time, not in a replica).
    """
    a = validated(AppArgs, args, "application args")
    mita = Classifier.options(name="MiTAClassifier").bind(
        a.checkpoint, "mita", a.device, a.mita_backend, a.dtype, a.cuda_graphs)
    dense = Classifier.options(name="DenseClassifier").bind(
        a.checkpoint, "dense", a.device, "auto", a.dtype, a.cuda_graphs)
    return Gateway.bind(mita, dense)
