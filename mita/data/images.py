"""Images as pixel sequences (the command: ``python -m mita.data.images IMAGES LABELS --out
FILE.jsonl``).

Reads an image set in the IDX format of MNIST and Fashion-MNIST (``*-images-idx3-ubyte`` and
``*-labels-idx1-ubyte``, gzipped or not) and writes JSON lines ``{"ids": [...], "label":
name}``: each grey-scale image read row by row, pixel value p as id p + 1 (0 stays padding,
as for bytes: 257 ids). Train on it with ``python -m mita.training --train FILE.jsonl
--landmark-grid HxW`` so MiTA pools its landmarks in 2-D over the H×W grid, as the paper does
on images (§3.2, Fig. 2).

``--names``: the class names by label value (Fashion-MNIST's: ``FASHION_MNIST``);
``--limit``: the first n images only; ``--pool F``: average F×F pixel blocks first (28×28 →
14×14 with F = 2, a quarter of the tokens).
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from pathlib import Path

import numpy as np

from ..tools.argtypes import POSITIVE_INT, Parser

# Fashion-MNIST's classes by label value (github.com/zalandoresearch/fashion-mnist, README).
FASHION_MNIST = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                 "Sneaker", "Bag", "Ankle boot")
_DTYPES = {0x08: np.uint8}


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (gzipped when its name ends in ``.gz``) as an array of its shape. Raises
    ValueError naming the file when it is not valid gzip (a ``.gz`` name), the header is not
    an unsigned-byte IDX or the size does not match it; OSError when it cannot be read."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except EOFError:
            raise ValueError(f"{path}: a truncated gzip file (it ends before its end-of-stream "
                             "marker)") from None
        except (gzip.BadGzipFile, zlib.error) as e:  # not gzip, corrupt data, a bad CRC
            raise ValueError(f"{path}: not a valid gzip file ({e})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _DTYPES:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (header {raw[:4].hex()})")
    ndim = raw[3]
    dims = tuple(int(x) for x in np.frombuffer(raw, ">u4", ndim, 4))
    data = np.frombuffer(raw, _DTYPES[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} = {int(np.prod(dims))} values, the file "
                         f"holds {data.size}")
    return data.reshape(dims)


def read_pair(images_path: str | Path, labels_path: str | Path,
              names: tuple[str, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(n, H, W)`` images and their ``(n,)`` labels read from two IDX files (``read_idx``).
    Raises ValueError naming the file when a shape is wrong, the counts differ or (with
    ``names``, the class names by label value) a label has no name; raises as ``read_idx``."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected (n, H, W) images, got shape {images.shape}")
    if labels.ndim != 1:
        raise ValueError(f"{labels_path}: expected (n,) labels, got shape {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds "
                         f"{len(labels)} labels")
    if names is not None and len(labels) and int(labels.max()) >= len(names):
        raise ValueError(f"{labels_path}: label {int(labels.max())} has no name (names of "
                         f"0…{len(names) - 1})")
    return images, labels


def pool(images: np.ndarray, factor: int) -> np.ndarray:
    """``(n, H, W)`` uint8 images averaged over ``factor``×``factor`` blocks (rounded half
    up) → ``(n, H/f, W/f)``. Raises ValueError when f does not divide H and W."""
    n, h, w = images.shape
    if factor < 1 or h % factor or w % factor:
        raise ValueError(f"--pool {factor} does not divide the {h}×{w} images")
    blocks = images.reshape(n, h // factor, factor, w // factor, factor).astype(np.float64)
    return np.floor(blocks.mean(axis=(2, 4)) + 0.5).astype(np.uint8)


def rows(images: np.ndarray, labels: np.ndarray, names: tuple[str, ...] | None):
    """JSON-lines rows of ``(n, H, W)`` images and their ``(n,)`` labels (``names``: the
    class names by label value, else the values). Raises ValueError when the counts differ
    or a label has no name."""
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if names is not None and len(labels) and int(labels.max()) >= len(names):
        raise ValueError(f"label {int(labels.max())} has no name (names of 0…{len(names) - 1})")
    for img, lab in zip(images, labels, strict=True):
        name = names[int(lab)] if names is not None else int(lab)
        yield {"ids": (img.reshape(-1).astype(np.int64) + 1).tolist(), "label": name}


def write_jsonl(path: str | Path, images: np.ndarray, labels: np.ndarray,
                names: tuple[str, ...] | None) -> int:
    """``rows`` written to ``path`` as compact JSON lines; returns how many. Raises as
    ``rows``."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows(images, labels, names):
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m mita.data.images", description=__doc__)
    p.add_argument("images", type=Path, help="IDX images (e.g. train-images-idx3-ubyte.gz)")
    p.add_argument("labels", type=Path, help="IDX labels (e.g. train-labels-idx1-ubyte.gz)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines to write")
    p.add_argument("--names", choices=("fashion-mnist", "values"), default="values",
                   help="class names: Fashion-MNIST's, or the label values")
    p.add_argument("--limit", type=POSITIVE_INT, default=None)
    p.add_argument("--pool", type=POSITIVE_INT, default=1)
    a = p.parse_args(argv)
    names = FASHION_MNIST if a.names == "fashion-mnist" else None
    try:
        images, labels = read_pair(a.images, a.labels, names)
        images, labels = images[:a.limit], labels[:a.limit]
        images = pool(images, a.pool) if a.pool > 1 else images
        write_jsonl(a.out, images, labels, names)
    except (OSError, ValueError) as e:  # OSError: the file it names and why
        p.error(f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename
                else str(e))
    h, w = images.shape[1:]
    print(f"{len(images)} images of {h}×{w} → {a.out} (train with --landmark-grid {h}x{w})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
