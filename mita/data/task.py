"""What a checkpoint classifies: its task name, label names, tokenizer and trained length —
the ``task`` object of its ``config.json`` (written by ``python -m mita.training --train FILE``),
with ``id2label`` / ``label2id`` beside it as Hugging Face writes them.

A checkpoint without ``task`` (the shipped ListOps one, and every checkpoint written before
this) is ListOps when its vocabulary is the ListOps tokenizer's, else a task of token ids
named ``"0"`` … ``"C-1"``. No torch: the service's gateway reads it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import CONFIG_FILE, PRETRAINED_TOKENIZER, ModelConfig
from .labelled import TRUNCATE_SIDES, read_file, truncate, unknown_label
from .tokenizers import LISTOPS, Tokenizer, from_spec
from .vocab import Vocabulary

MAX_LABEL_CHARS = 200


@dataclass(frozen=True)
class Task:
    """``name``; ``labels``: class index → name; ``tokenizer``; ``max_length`` and
    ``truncate``: the training length and the end cut off longer sequences (None: no limit
    was set); ``vocab``: the ids the model takes; ``grid``: the (H, W) token grid of a model
    with 2-D landmark pooling (every sequence then has exactly H·W tokens), else None.
    A pretrained transformers model (``mita.pretrained.served``): ``architecture`` its
    class name, ``positions`` the most tokens its position embeddings take (a longer
    sequence is refused, not cut), ``grid`` an image model's (S, S) pixels."""

    name: str
    labels: tuple[str, ...]
    tokenizer: Tokenizer
    vocab: Vocabulary
    max_length: int | None = None
    truncate: str | None = None
    grid: tuple[int, int] | None = None
    architecture: str | None = None
    positions: int | None = None

    @property
    def listops(self) -> bool:
        return self.tokenizer.kind == "listops"

    def length_refusal(self, n: int) -> str | None:
        """Why a sequence of ``n`` tokens (after the cut) cannot be classified, or None: a
        grid model takes exactly H·W tokens, a pretrained model at most its ``positions``."""
        if self.positions is not None and n > self.positions:
            return (f"sequence length N = {n} exceeds this model's {self.positions} positions "
                    f"({self.architecture}'s position embeddings)")
        if self.grid is not None and self.architecture is not None and n != self.grid[0] ** 2:
            side = self.grid[0]
            return (f"this model ({self.architecture}) classifies {side}×{side} images: a "
                    f"sequence must have exactly {side * side} pixel ids (grey value + 1, "
                    f"row by row), got {n}")
        if self.grid is not None and n != self.grid[0] * self.grid[1]:
            h, w = self.grid
            return (f"this model classifies {h}×{w} grids (2-D landmark pooling): a sequence "
                    f"must have exactly {h * w} tokens, got {n}")
        return None

    def cut(self, ids):
        """``ids`` cut to the trained length as training cut them (``mita.data.labelled.
        truncate``, the one cut of training, serving and evaluation): the first
        ``max_length`` tokens kept for ``truncate="tail"``, the last for ``"head"``; unchanged
        without a ``max_length`` or when not longer. ``ids``: any sliceable sequence (tuple,
        list, 1-D numpy array); returns the same type."""
        if self.max_length is None:
            return ids
        return truncate(ids, self.max_length, self.truncate)

    def labelled_rows(self, path, size: int | None = None) -> tuple[list, list, int]:
        """The first ``size`` (None: all) rows of a labelled file (``mita.data.labelled``
        formats) as this task's model reads them: text tokenized by ``tokenizer``, ids checked
        against it, label names indexed by ``labels``, every sequence cut by ``cut``. Returns
        (``(ids, class index)`` pairs, the file's ``Example`` rows, how many were cut). Raises
        FileNotFoundError, or ValueError ``"path:line: …"`` (``read_file``'s errors, a label
        this task does not have — with the likely cause —, a length a grid model cannot
        take)."""
        index = {name: i for i, name in enumerate(self.labels)}
        examples = read_file(path, self.tokenizer).examples[:size]
        rows, cut = [], 0
        for ex in examples:
            if ex.label not in index:
                raise unknown_label(ex, index, f"the checkpoint's labels ({len(index)}: "
                                    f"{', '.join(self.labels[:5])}{', …' * (len(index) > 5)})")
            ids = self.cut(ex.ids)
            why = self.length_refusal(len(ids))  # after the cut, as training checks it
            if why is not None:
                raise ValueError(f"{ex.path}:{ex.line}: {why}")
            cut += len(ids) < len(ex.ids)
            rows.append((list(ids), index[ex.label]))
        return rows, examples, cut

    def spec(self) -> dict:
        """The ``task`` object of config.json (``checkpoint_task`` reads it back)."""
        return {"name": self.name, "labels": list(self.labels),
                "tokenizer": self.tokenizer.spec(), "max_length": self.max_length,
                "truncate": self.truncate}

    def info(self) -> dict:
        """What ``/v1/models`` shows of it."""
        return {"name": self.name, "labels": list(self.labels),
                "tokenizer": self.tokenizer.spec() | {"vocab_size": self.vocab.size},
                "takes_text": self.tokenizer.takes_text, "max_length": self.max_length,
                "truncate": self.truncate,
                "grid": list(self.grid) if self.grid is not None else None,
                "architecture": self.architecture, "positions": self.positions}


def label_maps(labels) -> dict:
    """``id2label`` (index as a string → name) and ``label2id`` for config.json."""
    return {"id2label": {str(i): n for i, n in enumerate(labels)},
            "label2id": {n: i for i, n in enumerate(labels)}}


def checkpoint_task(meta: dict, cfg: ModelConfig, folder=".") -> Task:
    """The ``Task`` of a checkpoint: ``meta`` is its parsed config.json
    (``checkpoint_metadata``), ``cfg`` its ``ModelConfig``. Raises ValueError (naming the
    file) when ``task`` is malformed or does not fit the model (label count against
    ``num_classes``, tokenizer vocabulary against ``vocab_size``)."""
    if "pretrained" in meta:  # a transformers model folder (checkpoint_metadata)
        return pretrained_task(meta, cfg, folder)
    where = f"{folder}/{CONFIG_FILE}"
    vocab = Vocabulary(cfg.vocab_size, cfg.pad_id)
    spec = meta.get("task")
    if spec is None:
        listops = vocab.listops and cfg.num_classes == 10
        return Task("listops" if listops else "ids",
                    tuple(str(i) for i in range(cfg.num_classes)),
                    LISTOPS if listops else Tokenizer("ids", cfg.vocab_size), vocab,
                    grid=cfg.landmark_grid)
    if not isinstance(spec, dict) or set(spec) != {"name", "labels", "tokenizer",
                                                   "max_length", "truncate"}:
        raise ValueError(f"{where}: 'task' must be an object with name, labels, tokenizer, "
                         "max_length and truncate")
    labels = spec["labels"]
    if (not isinstance(labels, list) or len(labels) != cfg.num_classes
            or any(not isinstance(x, str) or not x or len(x) > MAX_LABEL_CHARS
                   for x in labels) or len(set(labels)) != len(labels)):
        raise ValueError(f"{where}: task 'labels' must be {cfg.num_classes} distinct names "
                         f"(num_classes), each 1-{MAX_LABEL_CHARS} characters")
    try:
        tok = from_spec(spec["tokenizer"], folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: task {e}") from None
    if tok.vocab_size != cfg.vocab_size or cfg.pad_id != 0:
        raise ValueError(f"{where}: the task's tokenizer has {tok.vocab_size} ids (0 padding); "
                         f"the model has vocab_size {cfg.vocab_size}, pad_id {cfg.pad_id}")
    max_length, side = spec["max_length"], spec["truncate"]
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(
            max_length, int) or max_length < 1):
        raise ValueError(f"{where}: task 'max_length' must be null or an int ≥ 1")
    if side not in (None, *TRUNCATE_SIDES) or (side is None) != (max_length is None):
        raise ValueError(f"{where}: task 'truncate' must be one of {TRUNCATE_SIDES} with a "
                         "max_length, null without")
    name = spec["name"]
    if not isinstance(name, str) or not name or len(name) > MAX_LABEL_CHARS:
        raise ValueError(f"{where}: task 'name' must be 1-{MAX_LABEL_CHARS} characters")
    return Task(name, tuple(labels), tok, vocab, max_length, side, cfg.landmark_grid)


def pretrained_task(meta: dict, cfg: ModelConfig, folder) -> Task:
    """The ``Task`` of a transformers model folder (``meta``: its ``checkpoint_metadata``,
    with ``pretrained``): labels from its ``id2label``; text through its own tokenizer
    (``tokenizer.json``, special tokens added, as ``python -m mita.training --model`` tokenized
    its rows), at most its ``positions`` tokens — longer is refused, never cut; an image
    model's rows are image_size² pixel ids. Raises ValueError naming a tokenizer.json that
    does not load."""
    p = meta["pretrained"]
    if p["kind"] == "image":
        side = p["image_size"]
        return Task("pretrained-image", tuple(p["labels"]), Tokenizer("ids", cfg.vocab_size),
                    Vocabulary(cfg.vocab_size, 0), grid=(side, side),
                    architecture=p["architecture"])
    path = Path(folder) / PRETRAINED_TOKENIZER
    tok = Tokenizer("transformers", cfg.vocab_size, path.read_bytes())
    try:
        tok.warm()
    except Exception as e:  # the tokenizers library's own errors on a broken file
        raise ValueError(f"{path}: not a tokenizer this model's library reads "
                         f"({type(e).__name__}: {e})"[:400]) from None
    return Task("pretrained-text", tuple(p["labels"]), tok, Vocabulary(cfg.vocab_size,
                cfg.pad_id), architecture=p["architecture"], positions=p["positions"])

