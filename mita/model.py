"""The long-sequence encoder classifier and its checkpoint format.

Token embedding + sinusoidal position encoding (computed on the fly, so any N up to
``max_len`` = 1,048,576 works) → ``depth`` pre-norm blocks (attention + FFN) → mean pooling
over valid tokens → LayerNorm → linear head. ``attention="dense"|"mita"`` only swaps the
attention module; both variants have the same parameters, so one checkpoint serves both.

A checkpoint is a folder with ``config.json`` (the ``ModelConfig`` fields plus the SHA-256 of
the weights) and ``model.safetensors``. Pickles are never loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .config import CONFIG_FILE, ModelConfig, check_backend, checkpoint_config, checkpoint_metadata
from .hooks import NULL_HOOK, StageHook, check_cancelled
from .layers import ATTENTION_MODULES, MiTAAttention
from .stages import check_padding_mask

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


_POSITION_TABLES: dict[tuple, Tensor] = {}


def sinusoidal_positions(n: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    """``(n, dim)`` sinusoidal encoding (Vaswani et al., 2017, §3.5): sin on even, cos on odd
    channels, wavelengths 2π…10000·2π. No table caps N: one table per (dim, device, dtype) is
    kept, grown to the next power of two ≥ n when a longer sequence comes, and sliced (a
    1M-token table took ~1 ms per layer stack to rebuild on every forward). Rows are the same
    values ``_sinusoidal(n, …)`` gives (each row depends only on its position)."""
    key = (dim, str(torch.device(device) if device is not None else torch.device("cpu")),
           dtype)
    table = _POSITION_TABLES.get(key)
    if table is None or table.shape[0] < n:
        table = _sinusoidal(1 << max(0, n - 1).bit_length(), dim, device, dtype)
        _POSITION_TABLES[key] = table
    return table[:n]


def _sinusoidal(n: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                     * (-math.log(10000.0) / dim))
    angles = pos * freq
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1).to(dtype)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm block: x + attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        # ModelConfig refused any name outside config.ATTENTIONS, the keys of this mapping
        self.attn = ATTENTION_MODULES[cfg.attention](cfg)
        self.ffn = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None,
                hook: StageHook = NULL_HOOK) -> Tensor:
        """``key_padding_mask`` already checked by ``EncoderClassifier.forward``."""
        x = x + self.attn(self.norm1(x), key_padding_mask, hook, check_mask=False)
        with hook.stage("ffn"):
            return x + self.ffn(self.norm2(x))


class EncoderClassifier(nn.Module):
    """Sequence classifier. ``forward(ids, key_padding_mask=None, hook=NULL_HOOK)``.

    Args: ``ids`` ``(B, N)`` int64 token ids; ``key_padding_mask`` ``(B, N)`` bool, True =
    padding (``None`` means no padding; ``padding_mask(ids)`` derives it from ``pad_id``).
    Returns: ``(B, num_classes)`` float32 logits. Activations run in the parameters' dtype
    (``model.to(torch.bfloat16)`` for 16-bit serving); mean pooling sums in float32.
    Raises: ValueError when N exceeds ``max_len``, differs from a ``landmark_grid``'s H·W,
    or a row is all padding.
    """

    def __init__(self, cfg: ModelConfig, init_embedding: bool = True):
        super().__init__()
        self.config = cfg
        # init_embedding=False: the embedding's weight is left uninitialised (load_checkpoint's
        # shape check on the meta device, where nn.init.normal_ runs torch's Python reference
        # kernels and its first call imports torch._dynamo: 2-3 s of CPU in every process).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_id,
                                  _weight=None if init_embedding else
                                  torch.empty(cfg.vocab_size, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def padding_mask(self, ids: Tensor) -> Tensor:
        return ids == self.config.pad_id

    def forward(self, ids: Tensor, key_padding_mask: Tensor | None = None,
                hook: StageHook = NULL_HOOK) -> Tensor:
        B, N = ids.shape
        if N > self.config.max_len:
            raise ValueError(f"sequence length {N} exceeds max_len {self.config.max_len}")
        grid = self.config.landmark_grid
        if grid is not None and grid[0] * grid[1] != N:  # an image model: exactly its grid
            raise ValueError(f"landmark_grid {grid} has {grid[0] * grid[1]} cells but N = {N}")
        check_padding_mask(key_padding_mask, B, N)  # once per forward, not once per layer
        with hook.stage("embed"):
            x = self.embed(ids) + sinusoidal_positions(N, self.config.dim, ids.device,
                                                       self.embed.weight.dtype)
        for i, block in enumerate(self.blocks):
            check_cancelled()  # hooks.cancellable: the callers may have gone meanwhile
            with hook.layer(i):
                x = block(x, key_padding_mask, hook)
        with hook.stage("head"):
            # Pool in float32 whatever the model's dtype: a bfloat16 sum over 10^6 tokens
            # (or a bfloat16 token count) would keep 8 bits.
            if key_padding_mask is None:
                pooled = x.mean(1, dtype=torch.float32)
            else:
                keep = (~key_padding_mask).to(x.dtype)[..., None]
                pooled = (x * keep).sum(1, dtype=torch.float32) / (~key_padding_mask).sum(
                    1, keepdim=True)
            return self.head(self.norm(pooled.to(x.dtype))).float()


def tied_variant(model: EncoderClassifier, attention: str, **changes) -> EncoderClassifier:
    """A model with ``attention`` (``"dense"`` or ``"mita"``; ``changes``: other
    ``ModelConfig`` fields, e.g. MiTA's m, k, s) that shares every parameter tensor with
    ``model`` — training one trains both; the paper's swap without retraining. Raises
    ValueError for a config ``ModelConfig`` refuses."""
    other = EncoderClassifier(model.config.replace(attention=attention, **changes))
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        other.get_submodule(module_name).register_parameter(leaf, param)
    return other.train(model.training)


def build_model(cfg: ModelConfig) -> EncoderClassifier:
    return EncoderClassifier(cfg)


def set_mita_backend(model: nn.Module, backend: str) -> None:
    """Set ``backend`` (``"auto"``, ``"torch"``, ``"cpu"``, ``"triton"``; see
    ``mita_attention``) on every ``MiTAAttention`` in ``model``. Raises ValueError for an
    unknown name."""
    check_backend(backend)
    for module in model.modules():
        if isinstance(module, MiTAAttention):
            module.backend = backend
    if hasattr(model, "set_mita_backend"):  # mita.pretrained.served.PretrainedClassifier
        model.set_mita_backend(backend)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(model: EncoderClassifier, folder: str | Path, **extra) -> Path:
    """Write ``config.json`` (config fields + ``weights_sha256``) and ``model.safetensors``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, folder / WEIGHTS_FILE)
    meta = {"config": dataclasses.asdict(model.config),
            "weights_sha256": _sha256(folder / WEIGHTS_FILE), **extra}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu",
                    **overrides) -> EncoderClassifier:
    """Load a checkpoint folder; ``overrides`` replace config fields (e.g. ``attention``).

    Raises:
        FileNotFoundError: missing ``config.json`` or ``model.safetensors``.
        ValueError: malformed ``config.json``, unknown or invalid config fields, a weights
            file whose SHA-256 differs from ``config.json``, tensors whose names or shapes
            do not match the config, tensors that are not floating point, or non-finite
            weights (the message names them; ``check_weights``).
    """
    folder = Path(folder)
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {p}")
    meta = checkpoint_metadata(folder)
    if "pretrained" in meta:
        raise ValueError(f"{folder}: a transformers model folder, not this product's "
                         "checkpoint (service.engine.load_served loads both)")
    cfg = checkpoint_config(folder, meta, **overrides)
    expected = meta.get("weights_sha256")
    actual = _sha256(weights_path)
    if expected != actual:
        raise ValueError(f"{weights_path}: SHA-256 {actual} does not match config.json's "
                         f"weights_sha256 {expected}; refusing to load")
    # Names and shapes first, from a model on the meta device and the file's header: a
    # config that does not fit the weights is refused before its parameters are allocated.
    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in
                EncoderClassifier(cfg, init_embedding=False).state_dict().items()}
    try:
        with safe_open(weights_path, framework="pt") as f:
            have = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    except SafetensorError as e:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from None
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    wrong = sorted(f"{n}: checkpoint {have[n]} vs config {want[n]}"
                   for n in set(want) & set(have) if have[n] != want[n])
    if missing or unexpected or wrong:
        def few(names: list[str]) -> str:  # a wrong depth would list thousands
            return f"{len(names)} {names[:4]}{' ...' if len(names) > 4 else ''}"
        raise ValueError(f"{weights_path} does not fit the config: missing {few(missing)}, "
                         f"unexpected {few(unexpected)}, shape mismatch {few(wrong)}")
    model = EncoderClassifier(cfg)
    try:
        state = load_file(weights_path, device=str(device))
    except SafetensorError as e:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from None
    own = model.state_dict()
    check_weights(state, own, weights_path)
    model.load_state_dict(state)
    return model.to(device).eval()


WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_weights(state: dict[str, Tensor], own: dict[str, Tensor], path: Path) -> None:
    """The tensors of a checkpoint against the model the config builds (float32 parameters).

    Refuses (ValueError naming the tensors) any tensor that is not float16, bfloat16,
    float32 or float64 (an int64 or bool tensor would be cast silently by ``load_state_dict``:
    an int64 head truncates every weight; float8 has no finiteness check) and any value that
    is not finite in the model's dtype. Another float dtype (float16, bfloat16, float64)
    is converted to the model's dtype by ``load_state_dict``, with one logged warning naming
    the tensors, since it changes the weights' precision.
    """
    bad = sorted(f"{n} ({t.dtype})" for n, t in state.items() if t.dtype not in WEIGHT_DTYPES)
    if bad:
        raise ValueError(f"{path}: tensors that are not float16/bfloat16/float32/float64: "
                         f"{bad}; the model's parameters are "
                         f"{next(iter(own.values())).dtype}")
    # After conversion: a float64 weight past float32's range becomes inf on loading.
    nonfinite = sorted(n for n, t in state.items()
                       if not bool(torch.isfinite(t.to(own[n].dtype)).all()))
    if nonfinite:
        raise ValueError(f"{path}: tensors with NaN or infinite values (in "
                         f"{next(iter(own.values())).dtype}): {nonfinite}")
    converted = sorted(f"{n} ({t.dtype})" for n, t in state.items()
                       if t.dtype != own[n].dtype)
    if converted:
        log.warning("%s: converting %d tensor(s) to %s: %s", path, len(converted),
                    next(iter(own.values())).dtype, ", ".join(converted))
