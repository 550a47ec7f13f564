"""``python -m mita.images IMAGES LABELS --out FILE.jsonl``: an IDX image set (MNIST,
Fashion-MNIST) as JSON lines of pixel ids, for ``python -m mita.train --train FILE.jsonl
--landmark-grid HxW`` (``mita.data.images`` says how).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .argtypes import POSITIVE_INT, Parser
from .data.images import FASHION_MNIST, pool, read_idx, write_jsonl


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m mita.images", description=__doc__)
    p.add_argument("images", type=Path, help="IDX images (e.g. train-images-idx3-ubyte.gz)")
    p.add_argument("labels", type=Path, help="IDX labels (e.g. train-labels-idx1-ubyte.gz)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines to write")
    p.add_argument("--names", choices=("fashion-mnist", "values"), default="values",
                   help="class names: Fashion-MNIST's, or the label values")
    p.add_argument("--limit", type=POSITIVE_INT, default=None)
    p.add_argument("--pool", type=POSITIVE_INT, default=1)
    a = p.parse_args(argv)
    try:
        images, labels = read_idx(a.images), read_idx(a.labels)
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(f"expected (n, H, W) images and (n,) labels, got {images.shape} "
                             f"and {labels.shape}")
        images, labels = images[:a.limit], labels[:a.limit]
        images = pool(images, a.pool) if a.pool > 1 else images
        write_jsonl(a.out, images, labels, FASHION_MNIST if a.names == "fashion-mnist" else None)
    except (OSError, ValueError) as e:
        p.error(str(e))
    h, w = images.shape[1:]
    print(f"{len(images)} images of {h}×{w} → {a.out} (train with --landmark-grid {h}x{w})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
