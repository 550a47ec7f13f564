"""``ModelConfig``: the model's hyper-parameters, validated once here and handed whole to the
modules that use them (``EncoderClassifier``, ``DenseAttention``, ``MiTAAttention``), with the
one check of a MiTA setting (``check_setting``), its one parser (``parse_setting``), the one
top-k clamp and the names of the attentions and backends, and the reading of a checkpoint's
``config.json`` (``checkpoint_metadata``, ``checkpoint_config``: no torch, so the service's
start-up reads a checkpoint's settings without importing it). Imports no other ``mita``
module: every layer above reads its rules from here."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

ATTENTIONS = ("dense", "mita")
SHARED_SCALES = ("paper", "official")
BACKENDS = ("auto", "torch", "cpu", "triton")


def check_setting(num_landmarks: int, topk: int, route_topk: int,
                  shared_scale: str = "paper") -> None:
    """The one check of a MiTA setting (§3.2): m, k, s ints ≥ 1, s ≤ m (a query picks s of
    the m routed experts), ``shared_scale`` in ``SHARED_SCALES``. ``ModelConfig`` and
    ``mita_attention`` both call it. Raises ValueError naming the bad value."""
    for name, value in (("num_landmarks", num_landmarks), ("topk", topk),
                        ("route_topk", route_topk)):
        try:  # Python, NumPy and torch integers; not floats or bools
            ok = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name!r} must be an int ≥ 1, got {value!r}")
    if route_topk > num_landmarks:
        raise ValueError(f"'route_topk' s = {route_topk} exceeds 'num_landmarks' m = "
                         f"{num_landmarks}")
    if shared_scale not in SHARED_SCALES:
        raise ValueError(f"'shared_scale' must be one of {SHARED_SCALES}, got "
                         f"{shared_scale!r}")


def check_backend(backend: str) -> None:
    """The one check of a MiTA backend name (``mita_attention``'s ``backend``). Raises
    ValueError naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def clamp_topk(topk: int, n: int) -> int:
    """k tokens per routed expert for a sequence of N = n tokens: min(k, N) (a landmark
    cannot pick more keys than exist). Every path (attention, cost model, memory estimate)
    clamps through here."""
    return min(topk, n)


_SETTING = re.compile(r"(\d+)[xX](\d+)(?:[xX](\d+))?")


def parse_setting(text: str, route_topk: bool = True,
                  forms: str = "MxK or MxKxS (e.g. 32x32 or 32x32x2)") -> tuple[int, int, int]:
    """A MiTA setting written ``"MxK"`` or ``"MxKxS"`` (``x`` or ``X``; the sweep's and the
    advisor's command lines) → ``(num_landmarks, topk, route_topk)``, s = 1 when absent.
    ``route_topk=False`` refuses the S part (the sweep takes s from its own option); ``forms``
    names the accepted forms in the error. Raises ValueError: ``text`` is not one of the forms,
    or ``check_setting`` refuses the numbers."""
    match = _SETTING.fullmatch(text)
    if not match or (match[3] is not None and not route_topk):
        raise ValueError(f"setting {text!r} is not {forms}")
    m, topk, s = int(match[1]), int(match[2]), int(match[3] or 1)
    try:
        check_setting(m, topk, s)
    except ValueError as e:
        raise ValueError(f"setting {text!r}: {e}") from None
    return m, topk, s


# Largest value of each size field: a config.json beyond these asks for more memory than any
# machine has, and is refused before anything is allocated.
LIMITS = {"vocab_size": 1 << 20, "num_classes": 1 << 16, "dim": 16384, "depth": 256,
          "num_heads": 256, "ffn_dim": 1 << 17, "max_len": 1 << 24, "num_landmarks": 1 << 16,
          "topk": 1 << 24, "route_topk": 1 << 16}

# Fields added after checkpoints were first written, with the value that means what those
# checkpoints did (1-D landmark pooling); every other field must be in config.json.
OPTIONAL_FIELDS = {"landmark_grid": None}



def setting_name(m: int, k: int, s: int, shared_scale: str) -> str:
    """A MiTA setting as the advisor's reports name it (their ``setting`` column) and the
    gateway looks it up in one: ``setting_name(16, 16, 1, "paper")`` = ``"m16 k16 s1 paper"``."""
    return f"m{m} k{k} s{s} {shared_scale}"

def check_grid(grid, num_landmarks: int, max_len: int | None = None,
               prefix: str = "") -> tuple[int, int]:
    """The one check of a 2-D landmark grid (``ModelConfig`` and
    ``mita.pretrained.PretrainedSetting``): two ints ≥ 1 (H, W) — a JSON list is taken — with
    at most ``max_len`` cells, and m = ``num_landmarks`` a perfect square (2-D pooling to
    p × p, §3.2). Returns the grid as a tuple. Raises ValueError, its message led by
    ``prefix`` (``"config field "`` for a checkpoint's config)."""
    if (not isinstance(grid, (list, tuple)) or len(grid) != 2
            or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in grid)):
        raise ValueError(f"{prefix}'landmark_grid' must be null or two ints ≥ 1 (H, W), got "
                         f"{grid!r}")
    if max_len is not None and grid[0] * grid[1] > max_len:
        raise ValueError(f"{prefix}'landmark_grid' {list(grid)} has more cells than "
                         f"'max_len' ({max_len})")
    if math.isqrt(num_landmarks) ** 2 != num_landmarks:
        raise ValueError(f"{prefix}'landmark_grid' needs 'num_landmarks' to be a perfect "
                         f"square (2-D pooling to p×p), got {num_landmarks}")
    return tuple(grid)


@dataclass(frozen=True)
class ModelConfig:
    """Model hyper-parameters; round-trips through ``config.json``.

    MiTA's setting (§3.2): ``num_landmarks`` m (= routed experts), ``topk`` k (tokens per
    routed expert, clamped to N at run time), ``route_topk`` s (experts per query),
    ``shared_scale`` (``"paper"``: eq. 11's 1/√d; ``"official"``: the authors' 1/d) and
    ``landmark_grid`` (None: 1-D pooling into m contiguous segments; ``(H, W)``: 2-D pooling
    of an H×W token grid, so N must be H·W and m a perfect square). Raises ValueError naming
    the field."""

    vocab_size: int = 16
    num_classes: int = 10
    pad_id: int = 0
    dim: int = 64
    depth: int = 2
    num_heads: int = 2
    ffn_dim: int = 128
    max_len: int = 1_048_576
    attention: str = "mita"
    num_landmarks: int = 16  # m
    topk: int = 16  # k
    route_topk: int = 1  # s
    shared_scale: str = "paper"
    landmark_grid: tuple[int, int] | None = None

    def __post_init__(self):
        for name, most in LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise ValueError(f"config field {name!r} must be an int in [1, {most}], got "
                                 f"{value!r}")
        for name in ("num_landmarks", "topk"):
            if getattr(self, name) > self.max_len:
                raise ValueError(f"config field {name!r} ({getattr(self, name)}) exceeds "
                                 f"'max_len' ({self.max_len})")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"config field 'attention' must be one of {ATTENTIONS}, "
                             f"got {self.attention!r}")
        try:
            check_setting(self.num_landmarks, self.topk, self.route_topk, self.shared_scale)
        except ValueError as e:
            raise ValueError(f"config: {e}") from None
        if self.dim % self.num_heads or self.dim % 2:
            raise ValueError(f"config field 'dim' ({self.dim}) must be even and divisible by "
                             f"num_heads ({self.num_heads})")
        if not isinstance(self.pad_id, int) or isinstance(self.pad_id, bool) or not (
                0 <= self.pad_id < self.vocab_size):
            raise ValueError(f"config field 'pad_id' must be in [0, {self.vocab_size})")
        if self.landmark_grid is not None:
            self._check_grid()

    def _check_grid(self) -> None:
        grid = check_grid(self.landmark_grid, self.num_landmarks, self.max_len,
                          "config field ")
        object.__setattr__(self, "landmark_grid", grid)  # JSON gives a list

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``, validated again (ValueError)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Raises ValueError naming unknown fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


CONFIG_FILE = "config.json"  # a checkpoint folder's settings (its weights: mita.model)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"duplicate key(s) {twice}")
    return dict(pairs)


def checkpoint_config(folder: str | Path, meta: dict | None = None,
                      **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint's config.json with ``overrides`` replacing fields
    (``meta``: its parsed ``checkpoint_metadata``, read here when None). Every field must be
    written out — a default would stand in for what the weights' shapes do not pin down
    (attention, m, k, s, shared_scale, pad_id) — except ``OPTIONAL_FIELDS``, which take the
    value that means what older checkpoints did. Raises ValueError naming the absent,
    unknown or invalid fields; FileNotFoundError without config.json."""
    meta = checkpoint_metadata(folder) if meta is None else meta
    absent = sorted({f.name for f in dataclasses.fields(ModelConfig)} - set(meta["config"])
                    - set(OPTIONAL_FIELDS))
    if absent:
        raise ValueError(f"{Path(folder) / CONFIG_FILE}: config lacks field(s) {absent}")
    return ModelConfig.from_dict(OPTIONAL_FIELDS | meta["config"] | overrides)


def checkpoint_metadata(folder: str | Path) -> dict:
    """The parsed ``config.json`` of a checkpoint: ``config`` (an object), ``weights_sha256``
    and training metadata (``training``, an object, when present). A transformers model
    folder (a ``config.json`` with ``model_type``) is read by
    ``mita.pretrained.served.folder_metadata`` (needs the ``pretrained`` extra), which adds
    ``pretrained``.

    Raises: FileNotFoundError without the file; ValueError (naming the file) when it is not
    UTF-8 JSON, repeats a key, nests too deeply, or has not that shape."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ValueError(f"{path}: not valid JSON ({str(e) or 'nested too deeply'})") from None
    if isinstance(meta, dict) and "model_type" in meta and "config" not in meta:
        from .pretrained.served import folder_metadata  # torch and transformers: only here

        return folder_metadata(folder)
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: expected an object with a 'config' object")
    if not isinstance(meta.get("training", {}), dict):
        raise ValueError(f"{path}: 'training' must be an object")
    return meta
