"""Bad input to a command is refused with one line naming the command and the file (or flag),
exit status 2, never a traceback: broken gzip and mismatched IDX files (``python -m
mita.data.images``, ``python -m mita.data.datasets fashion-mnist``), a folder given as an output
file (``python -m mita.training.evaluate --json/--predictions``), a file given as an output folder
(``python -m mita.data.datasets --out``, ``python -m profiler sweep --out``) and the sweep's
checks, answered by the ``sweep`` subcommand's parser."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from mita.data import datasets
from mita.data.datasets import main as datasets_main
from mita.data.images import main as images_main
from mita.training import evaluate
from profiler.__main__ import main as profiler_main

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU machine")


def refused(main, argv, capsys) -> str:
    """The last line ``main(argv)`` writes to stderr; it must exit with status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def idx(array: np.ndarray) -> bytes:
    """``array`` (uint8) in the IDX format: 0, 0, dtype 0x08, ndim, big-endian dims, data."""
    return (bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
            + array.astype(np.uint8).tobytes())


IMAGES = np.arange(3 * 4 * 6, dtype=np.uint8).reshape(3, 4, 6)
GOOD_GZ = gzip.compress(idx(IMAGES), mtime=0)
TRUNCATED = "a truncated gzip file (it ends before its end-of-stream marker)"
# the first deflate block's header byte 0x07: BFINAL 1, BTYPE 11 (reserved)
BROKEN_GZ = {
    "truncated": (GOOD_GZ[:20], TRUNCATED),
    "corrupt": (GOOD_GZ[:10] + b"\x07" + GOOD_GZ[11:], "not a valid gzip file (Error -3 "
                "while decompressing data: invalid block type)"),
    "not gzip": (idx(IMAGES), "not a valid gzip file (Not a gzipped file (b'\\x00\\x00'))"),
}


@pytest.mark.parametrize("case", BROKEN_GZ)
def test_images_refuse_a_broken_gzip_file_by_name(tmp_path, capsys, case):
    data, why = BROKEN_GZ[case]
    (tmp_path / "im.idx.gz").write_bytes(data)
    (tmp_path / "lab.idx").write_bytes(idx(np.array([0, 1, 2], np.uint8)))
    for images, labels, bad in (("im.idx.gz", "lab.idx", "im.idx.gz"),
                                ("lab.idx", "im.idx.gz", "im.idx.gz")):
        argv = [str(tmp_path / images), str(tmp_path / labels), "--out",
                str(tmp_path / "x.jsonl")]
        assert refused(images_main, argv, capsys) == (
            f"python -m mita.data.images: error: {tmp_path / bad}: {why}")


def test_images_refuse_files_that_do_not_pair_naming_them(tmp_path, capsys):
    im, lab, out = tmp_path / "im.idx", tmp_path / "lab.idx", str(tmp_path / "x.jsonl")
    im.write_bytes(idx(IMAGES))
    lab.write_bytes(idx(np.array([0, 1], np.uint8)))
    assert refused(images_main, [str(im), str(lab), "--out", out], capsys) == (
        f"python -m mita.data.images: error: {im} holds 3 images but {lab} holds 2 labels")
    # refused with --limit too: files that do not pair are the wrong files
    assert refused(images_main, [str(im), str(lab), "--out", out, "--limit", "1"], capsys) == (
        f"python -m mita.data.images: error: {im} holds 3 images but {lab} holds 2 labels")
    lab.write_bytes(idx(np.array([0, 10, 3], np.uint8)))
    assert refused(images_main, [str(im), str(lab), "--out", out, "--names", "fashion-mnist"],
                   capsys) == (f"python -m mita.data.images: error: {lab}: label 10 has no "
                               "name (names of 0…9)")
    assert refused(images_main, [str(lab), str(lab), "--out", out], capsys) == (
        f"python -m mita.data.images: error: {lab}: expected (n, H, W) images, got shape (3,)")
    assert refused(images_main, [str(im), str(im), "--out", out], capsys) == (
        f"python -m mita.data.images: error: {im}: expected (n,) labels, got shape (3, 4, 6)")
    missing = tmp_path / "none.idx.gz"
    assert refused(images_main, [str(missing), str(lab), "--out", out], capsys) == (
        f"python -m mita.data.images: error: {missing}: No such file or directory")


def test_fashion_mnist_names_the_packaged_file_it_cannot_read(tmp_path, capsys, monkeypatch):
    root = tmp_path / "pkg"
    files = root / "usr/share/datasets/fashion-mnist"
    files.mkdir(parents=True)
    monkeypatch.setattr(datasets, "unpack", lambda package, out: root)  # no apt-get
    labels = gzip.compress(idx(np.array([0, 1, 2], np.uint8)))
    (files / "train-images-idx3-ubyte.gz").write_bytes(GOOD_GZ[:20])
    (files / "train-labels-idx1-ubyte.gz").write_bytes(labels)
    argv = ["fashion-mnist", "--out", str(tmp_path / "out")]
    assert refused(datasets_main, argv, capsys) == (
        "python -m mita.data.datasets: error: "
        f"{files / 'train-images-idx3-ubyte.gz'}: {TRUNCATED}")
    (files / "train-images-idx3-ubyte.gz").write_bytes(GOOD_GZ)
    (files / "train-labels-idx1-ubyte.gz").write_bytes(labels[:-8] + b"\0" * 8)
    assert refused(datasets_main, argv, capsys) == (
        "python -m mita.data.datasets: error: "
        f"{files / 'train-labels-idx1-ubyte.gz'}: not a valid gzip file (CRC check failed)")
    (files / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx(np.array([0, 11, 2], np.uint8))))
    assert refused(datasets_main, argv, capsys) == (
        "python -m mita.data.datasets: error: "
        f"{files / 'train-labels-idx1-ubyte.gz'}: label 11 has no name (names of 0…9)")


@pytest.mark.parametrize("flag", ["--json", "--predictions"])
def test_evaluate_refuses_a_folder_as_an_output_before_loading(tmp_path, capsys, monkeypatch,
                                                                flag):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(evaluate, "checkpoint_metadata", no_loading)
    monkeypatch.setattr(evaluate, "load_checkpoint", no_loading)
    folder = tmp_path / "out.csv"  # a suffix --predictions takes: the folder is the problem
    folder.mkdir()
    argv = [str(ROOT / "checkpoints/fashion-mnist-14x14"), flag, str(folder),
            "--data", str(ROOT / "examples/fashion-mnist-14x14.jsonl")]
    assert refused(evaluate.main, argv, capsys) == (
        f"python -m mita.training.evaluate: error: {flag} {folder}: is a directory")
    if flag == "--json":  # generated ListOps too
        assert refused(evaluate.main, [str(ROOT / "checkpoints/listops-default"), flag,
                                       str(folder)], capsys) == (
            f"python -m mita.training.evaluate: error: {flag} {folder}: is a directory")


SWEEP = "python -m profiler sweep: error: "


@pytest.mark.parametrize("argv,why", [
    (["--settings", "bogus"], "setting 'bogus' is not 'fig5' or MxK (e.g. 32x128)"),
    (["--settings", "0x4"], "setting '0x4': 'num_landmarks' must be an int ≥ 1, got 0"),
    (["--dim", "33"], "config field 'dim' (33) must be even and divisible by num_heads (2)"),
    pytest.param(["--device", "cuda"], "device 'cuda': this machine's torch "
                 f"({torch.__version__}) sees 0 CUDA device(s)", marks=NO_CUDA),
    pytest.param(["--mita-backend", "triton"], "mita_backend 'triton' needs a CUDA device",
                 marks=NO_CUDA),
], ids=["settings-bogus", "settings-0x4", "dim-33", "device-cuda", "backend-triton"])
def test_sweep_refusals_are_the_sweep_subcommands(tmp_path, capsys, argv, why):
    with pytest.raises(SystemExit) as e:
        profiler_main(["sweep", *argv, "--out", str(tmp_path / "sweep")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m profiler sweep [-h]")  # the sweep's usage
    assert err.splitlines()[-1] == SWEEP + why
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("command", ["datasets", "sweep"])
def test_a_file_as_the_out_folder_is_refused(tmp_path, capsys, command):
    """Both commands make --out with ``argtypes.output_folder`` before their work."""
    main, argv, prefix = {
        "datasets": (datasets_main, ["austen"], "python -m mita.data.datasets: error: "),
        "sweep": (profiler_main, ["sweep"], SWEEP)}[command]
    f = tmp_path / "taken"
    f.write_text("x")
    assert refused(main, [*argv, "--out", str(f)], capsys) == (
        f"{prefix}--out {f}: is a file, not a folder")
    assert refused(main, [*argv, "--out", str(f / "sub")], capsys) == (
        f"{prefix}--out {f / 'sub'}: Not a directory")
    assert f.read_text() == "x"
