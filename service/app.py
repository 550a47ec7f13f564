"""The service graph in one function: two classifier deployments behind the gateway.

``serve run deploy/serve_config.yaml`` or ``python -m service`` import ``build_app`` from
here; every tunable (replicas, queue limits, A/B weights, batch size) lives in the config file.
"""

from __future__ import annotations

from ray.serve import Application

from mita.config import ModelConfig, checkpoint_config, checkpoint_metadata, setting_name
from mita.data.task import Task, checkpoint_task

from . import resolve_checkpoint
from .classifier import Classifier
from .gateway import Gateway
from .settings import DEPLOYMENTS, AppArgs, validated


def served_config(args: dict) -> tuple[AppArgs, ModelConfig, Task]:
    """The parsed application args, the ``ModelConfig`` the MiTA classifier will serve (the
    checkpoint's, with ``mita_setting`` applied) and the checkpoint's ``Task`` (label names,
    tokenizer; ``mita.data.task``). Used by ``build_app`` and by ``python -m service --check``
    (``preflight.verify_checkpoints``), so both refuse the same. Raises ValueError for refused
    args, a malformed config.json or task, or a setting ``ModelConfig`` refuses;
    FileNotFoundError for a checkpoint without config.json."""
    a = validated(AppArgs, args, "application args")
    folder = resolve_checkpoint(a.checkpoint)
    meta = checkpoint_metadata(folder)
    cfg = checkpoint_config(folder, meta)
    task = checkpoint_task(meta, cfg, folder)
    try:
        cfg = cfg.replace(attention="mita", **a.mita_setting.overrides())
    except ValueError as e:
        raise ValueError(f"application args mita_setting: {e}") from None
    return a, cfg, task


def build_app(args: dict) -> Application:
    """Args: ``checkpoint`` (folder, relative to the project root unless absolute; default
    the shipped ``checkpoints/listops-default``), ``device`` (``auto`` | ``cpu`` | ``cuda``),
    ``mita_backend`` (``mita_attention``'s backend, default ``auto``) and ``dtype`` (``auto``
    | ``float32`` | ``bfloat16`` | ``float16``; auto: bfloat16 on CUDA, float32 on CPU). Both
    classifier deployments load the same checkpoint in the same dtype.

    ``cuda_graphs`` (default true): replay unstaged forwards from CUDA graphs on CUDA.
    ``mita_setting``: the MiTA classifier's m, k, s and shared scale, replacing the
    checkpoint's (``settings.MiTASetting``). Parsed strictly by ``settings.AppArgs``.

    The gateway validates token ids against the checkpoint's vocabulary and tokenizes text
    with its tokenizer (its config.json, ``mita.data.task``).

    Raises as ``served_config`` (at deploy time, not in a replica).
    """
    a, cfg, task = served_config(args)
    setting = a.mita_setting.overrides()
    mita = Classifier.options(name=DEPLOYMENTS["mita"]).bind(
        a.checkpoint, "mita", a.device, a.mita_backend, a.dtype, a.cuda_graphs, setting)
    dense = Classifier.options(name=DEPLOYMENTS["dense"]).bind(
        a.checkpoint, "dense", a.device, "auto", a.dtype, a.cuda_graphs)
    return Gateway.options(name=DEPLOYMENTS["gateway"]).bind(
        mita, dense, task,
        setting_name(cfg.num_landmarks, cfg.topk, cfg.route_topk, cfg.shared_scale))
