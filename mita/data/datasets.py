"""Real labelled data from Debian's packages, offline once fetched: ``python -m mita.data.datasets
NAME --out DIR`` (``make data`` fetches both).

- ``fashion-mnist``: Debian's ``dataset-fashion-mnist`` (Zalando's Fashion-MNIST, 70,000
  28×28 grey-scale images of 10 kinds of clothing; MIT licence). Written as JSON lines of
  pixel ids (``mita.data.images``), average-pooled 2×2 to 14×14 (196 tokens, the grid of the
  MiTA paper's ImageNet models): ``train.jsonl`` (60,000) and ``test.jsonl`` (10,000).
- ``austen``: Debian's ``r-cran-janeaustenr`` (Jane Austen's six novels from Project
  Gutenberg, public domain; package MIT), read without R by the ``rdata`` package. Each novel's
  text (lines joined by spaces) is cut into windows of ``--window`` characters labelled with
  the novel: the first 90 % of each novel's windows are ``train.tsv``, the last 10 %
  ``valid.tsv`` (no window of the validation text is next to a training one but at one edge
  per novel). ``baseline.json``: a character 1–4-gram naive Bayes (scikit-learn) on the same
  split, the reference a model must beat.
- ``austen-persuasion``: the same package's novels as paragraphs (the text between blank
  lines; at least ``MIN_PARAGRAPH`` characters, so chapter headings drop out), labelled
  ``Persuasion`` or ``other``: a real skewed binary task (Persuasion holds ~10 % of the
  paragraphs) with lengths from 40 characters to ~15 KB. The last 10 % of each novel's
  paragraphs are ``valid.tsv``, the rest ``train.tsv``.

``apt-get download`` and ``dpkg-deb -x`` fetch and unpack the package into ``DIR/debs``; run
as a user who may use apt. Nothing is fetched at training or test time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np

from ..tools.argtypes import POSITIVE_INT, Parser, output_folder
from .images import FASHION_MNIST, pool, read_pair, write_jsonl

PACKAGES = {"fashion-mnist": "dataset-fashion-mnist", "austen": "r-cran-janeaustenr",
            "austen-persuasion": "r-cran-janeaustenr"}
AUSTEN_TITLES = {"emma": "Emma", "mansfieldpark": "Mansfield Park",
                 "northangerabbey": "Northanger Abbey", "persuasion": "Persuasion",
                 "prideprejudice": "Pride and Prejudice",
                 "sensesensibility": "Sense and Sensibility"}
VALID_SHARE = 0.1
MIN_PARAGRAPH = 40  # characters: shorter "paragraphs" are headings ("CHAPTER IV")


def unpack(package: str, out: Path) -> Path:
    """``apt-get download`` the Debian package into ``out/debs`` and unpack it there; returns
    the unpacked root. Raises RuntimeError naming the failing command."""
    # Absolute: the commands run inside out/debs, where a relative out (the Makefile's
    # `--out data/fashion-mnist`) no longer names the package file.
    debs = out.resolve() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not list(debs.glob(f"{package}_*.deb")):
        _run(["apt-get", "download", package], debs)
    deb = sorted(debs.glob(f"{package}_*.deb"))[-1]
    root = debs / package
    _run(["dpkg-deb", "-x", str(deb), str(root)], debs)
    return root


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-300:]}")


def fashion_mnist(out: Path, factor: int = 2) -> dict:
    """``out/train.jsonl`` (60,000 rows) and ``out/test.jsonl`` (10,000) of Fashion-MNIST's
    images average-pooled ``factor``×``factor`` (28×28 → 14×14 at 2) as pixel ids, labelled
    with the class names; returns the row counts, grid and licence. Raises RuntimeError
    (apt-get, dpkg-deb) or ValueError (``read_pair``, ``pool``)."""
    root = unpack(PACKAGES["fashion-mnist"], out) / "usr/share/datasets/fashion-mnist"
    counts = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = read_pair(root / f"{prefix}-images-idx3-ubyte.gz",
                                   root / f"{prefix}-labels-idx1-ubyte.gz", FASHION_MNIST)
        images = pool(images, factor) if factor > 1 else images
        counts[split] = write_jsonl(out / f"{split}.jsonl", images, labels, FASHION_MNIST)
    h, w = images.shape[1:]
    return {"rows": counts, "grid": f"{h}x{w}", "licence": "MIT (Zalando SE)"}


def austen_books(root: Path) -> dict[str, str]:
    """The six novels' texts (lines joined by spaces) from the package's lazy-load database
    (``data/Rdata.rdx`` indexes zlib-compressed R objects in ``Rdata.rdb``)."""
    return {title: " ".join(" ".join(lines).split())
            for title, lines in austen_lines(root).items()}


def austen_paragraphs(root: Path) -> dict[str, list[str]]:
    """Each novel's paragraphs: runs of non-blank lines joined by spaces (whitespace
    collapsed), those of at least ``MIN_PARAGRAPH`` characters, in the novel's order."""
    out = {}
    for title, lines in austen_lines(root).items():
        paragraphs, current = [], []
        for line in [*lines, ""]:
            if line.strip():
                current.append(line)
            elif current:
                paragraphs.append(" ".join(" ".join(current).split()))
                current = []
        out[title] = [x for x in paragraphs if len(x) >= MIN_PARAGRAPH]
    return out


def austen_lines(root: Path) -> dict[str, list[str]]:
    """The six novels' lines as the package holds them (blank lines between paragraphs)."""
    import rdata

    data = root / "usr/lib/R/site-library/janeaustenr/data"
    with warnings.catch_warnings():  # rdata: "Unknown file type: assumed RDS"
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_data(
            gzip.decompress((data / "Rdata.rdx").read_bytes())))
        rdb = (data / "Rdata.rdb").read_bytes()
        books = {}
        for name, (offset, length) in index["variables"].items():
            blob = rdb[int(offset):int(offset) + int(length)]
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
            books[AUSTEN_TITLES[str(name)]] = [str(x) for x in lines]
    return books


def austen(out: Path, window: int) -> dict:
    """``out/train.tsv`` and ``out/valid.tsv`` of ``window``-character windows of the six
    novels labelled with their titles (the last ``VALID_SHARE`` of each novel's windows for
    validation) and ``out/baseline.json`` (``ngram_baseline``); returns the row counts,
    window and baseline. Raises RuntimeError (apt-get, dpkg-deb) or ImportError (rdata,
    scikit-learn: the ``data`` extra)."""
    books = austen_books(unpack(PACKAGES["austen"], out))
    split, baseline = write_split(out, {title: [text[i:i + window] for i in range(
        0, len(text) - window + 1, window)] for title, text in books.items()})
    return {"rows": {k: len(v) for k, v in split.items()}, "window": window,
            "baseline": baseline, "licence": "public domain texts; package MIT"}


def write_split(out: Path, books: dict[str, list[str]], label=lambda title: title
                ) -> tuple[dict[str, list[tuple[str, str]]], dict]:
    """``out/train.tsv`` and ``out/valid.tsv`` (a ``label<TAB>text`` header, tabs in a text
    written as spaces) of each book's texts in order, labelled ``label(title)``: the last
    ``VALID_SHARE`` (at least one) of each book's texts for validation, the rest for training;
    and ``out/baseline.json`` (``ngram_baseline``). Returns the split and the baseline."""
    split: dict[str, list[tuple[str, str]]] = {"train": [], "valid": []}
    for title, texts in books.items():
        cut = len(texts) - max(1, round(VALID_SHARE * len(texts)))
        split["train"] += [(label(title), x) for x in texts[:cut]]
        split["valid"] += [(label(title), x) for x in texts[cut:]]
    for name, part in split.items():
        (out / f"{name}.tsv").write_text("label\ttext\n" + "".join(
            f"{y}\t{x.replace(chr(9), ' ')}\n" for y, x in part), encoding="utf-8")
    baseline = ngram_baseline(split["train"], split["valid"])
    (out / "baseline.json").write_text(json.dumps(baseline, indent=2) + "\n")
    return split, baseline


def austen_persuasion(out: Path) -> dict:
    """``out/train.tsv`` and ``out/valid.tsv``: the novels' paragraphs (``austen_paragraphs``)
    labelled ``Persuasion`` or ``other`` (the last ``VALID_SHARE`` of each novel's paragraphs
    for validation), and ``out/baseline.json`` (``ngram_baseline``); returns the row and class
    counts and the baseline. Raises as ``austen``."""
    books = austen_paragraphs(unpack(PACKAGES["austen-persuasion"], out))
    split, baseline = write_split(out, books, lambda title: (
        "Persuasion" if title == "Persuasion" else "other"))
    return {"rows": {k: len(v) for k, v in split.items()},
            "persuasion_rows": {k: sum(y == "Persuasion" for y, _ in v)
                                for k, v in split.items()},
            "min_paragraph_chars": MIN_PARAGRAPH, "baseline": baseline,
            "licence": "public domain texts; package MIT"}


def ngram_baseline(train: list[tuple[str, str]], valid: list[tuple[str, str]]) -> dict:
    """Validation accuracy of a character 1–4-gram multinomial naive Bayes (scikit-learn's
    ``CountVectorizer(analyzer="char", ngram_range=(1, 4))`` + ``MultinomialNB``), and of
    always answering the most common training label."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.naive_bayes import MultinomialNB

    vec = CountVectorizer(analyzer="char", ngram_range=(1, 4), max_features=200_000)
    x = vec.fit_transform([t for _, t in train])
    nb = MultinomialNB().fit(x, [y for y, _ in train])
    pred = nb.predict(vec.transform([t for _, t in valid]))
    labels, counts = np.unique([y for y, _ in train], return_counts=True)
    top = labels[counts.argmax()]
    return {"char_1_4_gram_naive_bayes": float(np.mean(pred == [y for y, _ in valid])),
            "majority_class": float(np.mean([y == top for y, _ in valid])),
            "model": "sklearn CountVectorizer(char, 1-4) + MultinomialNB"}


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="python -m mita.data.datasets", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=tuple(PACKAGES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--window", type=POSITIVE_INT, default=1024,
                   help="austen: characters per window (default 1024)")
    p.add_argument("--pool", type=POSITIVE_INT, default=2,
                   help="fashion-mnist: average F×F pixel blocks (default 2: 14×14)")
    a = p.parse_args(argv)
    try:
        output_folder("--out", a.out)
    except ValueError as e:
        p.error(str(e))
    try:
        info = (fashion_mnist(a.out, a.pool) if a.name == "fashion-mnist"
                else austen_persuasion(a.out) if a.name == "austen-persuasion"
                else austen(a.out, a.window))
    except (OSError, RuntimeError, ValueError) as e:  # OSError: the file it names and why
        p.error(f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename
                else str(e))
    except ImportError as e:
        p.error(f"{e.name} is missing: pip install '.[data]' (make data does)")
    info |= {"package": PACKAGES[a.name]}
    (a.out / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), file=sys.stdout)
    return info


if __name__ == "__main__":
    main()
