"""``ModelConfig``: the model's hyper-parameters, validated once here and handed whole to the
modules that use them (``EncoderClassifier``, ``DenseAttention``, ``MiTAAttention``), with the
one check of a MiTA setting (``check_setting``), its one parser (``parse_setting``), the one
top-k clamp and the names of the attentions and backends, and the reading of a checkpoint's
``config.json`` (``checkpoint_metadata``, ``checkpoint_config``: no torch, so the service's
start-up reads a checkpoint's settings without importing it). Imports no other ``mita``
module: every layer above reads its rules from here."""

from __future__ import annotations

import dataclasses
import hashlib
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
    folder (a ``config.json`` with ``model_type``): ``pretrained_metadata``.

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
        return pretrained_metadata(folder, meta)
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: expected an object with a 'config' object")
    if not isinstance(meta.get("training", {}), dict):
        raise ValueError(f"{path}: 'training' must be an object")
    return meta


# A transformers model folder (config.json with ``model_type``, as ``save_pretrained`` writes
# it) is read here, without transformers or torch, so the service's start-up, its gateway and
# the advisor take it as a checkpoint; ``mita.pretrained.served`` loads its weights.
PRETRAINED_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PRETRAINED_TOKENIZER = "tokenizer.json"  # the model's fast tokenizer, special tokens included
PRETRAINED_TRAINING = "training.json"  # python -m mita.training --model's record
# config.json's names of what ModelConfig reads: transformers' own, then DistilBERT's
_PRETRAINED_FIELDS = {"dim": ("hidden_size", "dim"), "depth": ("num_hidden_layers", "n_layers"),
                      "num_heads": ("num_attention_heads", "n_heads"),
                      "ffn_dim": ("intermediate_size", "hidden_dim")}
# Models whose position ids start at pad_token_id + 1 (RoBERTa's scheme): 514 positions hold
# 512 tokens.
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm",
                    "data2vec-text", "xmod")
PRETRAINED_SETTING_FIELDS = ("num_landmarks", "topk", "route_topk", "shared_scale",
                             "landmark_grid", "backend")


def pretrained_positions(raw: dict) -> int:
    """The most tokens a transformers model takes (``raw``: its config as a dict): text, its
    ``max_position_embeddings`` (RoBERTa's offset taken off); image, its patches and prefix
    tokens (the class token, DeiT's distillation token)."""
    if "image_size" in raw:
        side = raw["image_size"] // raw["patch_size"]
        return side * side + (2 if raw.get("model_type") == "deit" else 1)
    n = int(raw["max_position_embeddings"])
    return n - int(raw["pad_token_id"]) - 1 if raw.get("model_type") in OFFSET_POSITIONS else n


def default_pretrained_setting(raw: dict) -> dict:
    """A transformers model's MiTA setting when it has none: images, m = k = 25 (the paper's
    DeiT, §4.1) over the patch grid (m = 4 for grids under 10 × 10); text, m = k = 16, 1-D
    pooling."""
    if "image_size" in raw:
        side = raw["image_size"] // raw["patch_size"]
        m = 25 if side >= 10 else 4
        grid = (side, side)
    else:
        m, grid = 16, None
    return {"num_landmarks": m, "topk": m, "route_topk": 1, "shared_scale": "paper",
            "landmark_grid": grid, "backend": "auto"}


def pretrained_setting(raw: dict, where: str = "config") -> dict:
    """The MiTA setting of a transformers config (its ``mita`` entry, else
    ``default_pretrained_setting``), checked: ``check_setting``, ``check_backend``,
    ``check_grid``. Raises ValueError naming ``where`` and the field."""
    setting = raw.get("mita")
    if setting is None:
        return default_pretrained_setting(raw)
    if not isinstance(setting, dict) or set(setting) - set(PRETRAINED_SETTING_FIELDS):
        raise ValueError(f"{where}: 'mita' must be an object with fields "
                         f"{list(PRETRAINED_SETTING_FIELDS)}, got {setting!r:.120}")
    out = default_pretrained_setting({}) | {"landmark_grid": None} | setting
    try:
        check_setting(out["num_landmarks"], out["topk"], out["route_topk"],
                      out["shared_scale"])
        check_backend(out["backend"])
        if out["landmark_grid"] is not None:
            out["landmark_grid"] = check_grid(out["landmark_grid"], out["num_landmarks"])
    except ValueError as e:
        raise ValueError(f"{where}: 'mita' {e}") from None
    return out


def pretrained_model_config(raw: dict, setting: dict, attention: str = "mita") -> dict:
    """The ``ModelConfig`` fields a transformers model (``raw``: its config as a dict) is
    measured as — the analytic FLOPs, the activation estimate and the top-k choice read hidden
    size, layers, heads, FFN width, classes and the MiTA ``setting``. Text: its vocabulary,
    padding id and positions; image: pixel ids 1 … 256 (257 ids, never padded), image_size²
    of them. Raises KeyError for a config without those sizes."""
    image = "image_size" in raw

    def field(name: str) -> int | None:
        return next((raw[k] for k in _PRETRAINED_FIELDS[name] if raw.get(k) is not None), None)
    dim = field("dim")
    if dim is None or field("depth") is None or field("num_heads") is None:
        raise KeyError("hidden_size, num_hidden_layers or num_attention_heads")
    return {"vocab_size": 257 if image else int(raw["vocab_size"]),
            "num_classes": len(raw.get("id2label") or {"0": 0, "1": 1}),
            "pad_id": 0 if image else int(raw.get("pad_token_id") or 0),
            "dim": int(dim), "depth": int(field("depth")), "num_heads": int(field("num_heads")),
            "ffn_dim": int(field("ffn_dim") or 4 * dim),
            "max_len": raw["image_size"] ** 2 if image else pretrained_positions(raw),
            "attention": attention, "num_landmarks": setting["num_landmarks"],
            "topk": setting["topk"], "route_topk": setting["route_topk"],
            "shared_scale": setting["shared_scale"], "landmark_grid": setting["landmark_grid"]}


def pretrained_labels(raw: dict) -> list[str] | None:
    """A transformers head's label names in index order (``id2label``), or None for
    transformers' defaults (``LABEL_0``, …: an untrained head)."""
    id2label = raw.get("id2label") or {}
    names = [str(id2label.get(str(i), id2label.get(i))) for i in range(len(id2label))]
    return None if names == [f"LABEL_{i}" for i in range(len(names))] else names


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def pretrained_metadata(folder: str | Path, raw: dict) -> dict:
    """``checkpoint_metadata`` of a transformers model folder (``raw``: its config.json):
    ``config`` the ``pretrained_model_config`` with its MiTA setting, ``weights_sha256`` over
    its safetensors files, ``training`` its ``training.json`` and ``pretrained``: its
    ``architecture``, ``model_type``, ``kind`` (text or image), ``labels``, ``positions``,
    ``image_size`` and ``saved_setting`` (its config's own ``mita``, None without). Raises
    ValueError naming the folder: no safetensors weights, a text model without tokenizer.json,
    an untrained head, a decoder or cross-attention config, a bad setting, sizes it lacks."""
    folder = Path(folder)
    weights = sorted(folder.glob("*.safetensors"))
    if not any((folder / w).is_file() for w in PRETRAINED_WEIGHTS) or not weights:
        raise ValueError(f"{folder}: no weights ({' or '.join(PRETRAINED_WEIGHTS)}; "
                         "save_pretrained writes them)")
    kind = "image" if "image_size" in raw and "patch_size" in raw else "text"
    if kind == "text" and not (folder / PRETRAINED_TOKENIZER).is_file():
        raise ValueError(f"{folder}: a text model without its tokenizer ({PRETRAINED_TOKENIZER}, "
                         "the fast tokenizer its save_pretrained writes)")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise ValueError(f"{folder}: a decoder or cross-attention config (is_decoder / "
                         "add_cross_attention): MiTA here is bidirectional self-attention")
    labels = pretrained_labels(raw)
    if labels is None:
        raise ValueError(f"{folder}: its classification head is untrained (transformers' "
                         "default labels LABEL_0 …): fine-tune it on your labelled file first, "
                         f"python -m mita.training --model {folder} --train FILE --out DIR, "
                         "and serve DIR")
    setting = pretrained_setting(raw, f"{folder / CONFIG_FILE}")
    try:
        cfg = pretrained_model_config(raw, setting)
        ModelConfig.from_dict(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder / CONFIG_FILE}: not a model this product measures ({e})"
                         ) from None
    training = {}
    if (folder / PRETRAINED_TRAINING).is_file():
        try:
            training = json.loads((folder / PRETRAINED_TRAINING).read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{folder / PRETRAINED_TRAINING}: not valid JSON ({e})") from None
    return {"config": cfg, "weights_sha256": _sha256_files(weights),
            "training": training if isinstance(training, dict) else {},
            "pretrained": {"architecture": (raw.get("architectures") or [raw["model_type"]])[0],
                           "model_type": raw["model_type"], "kind": kind, "labels": labels,
                           "positions": pretrained_positions(raw),
                           "image_size": raw.get("image_size") if kind == "image" else None,
                           "saved_setting": raw.get("mita") and setting}}

