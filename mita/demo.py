"""Classify a few fresh ListOps sequences with the shipped checkpoint, dense vs MiTA."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .data.listops import ListOpsConfig, encode, generate
from .model import checkpoint_metadata, load_checkpoint

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "listops-default"


def main(checkpoint: Path = DEFAULT_CHECKPOINT) -> None:
    cfg = checkpoint_metadata(checkpoint)["config"]
    models = {a: load_checkpoint(checkpoint, attention=a) for a in ("dense", "mita")}
    print(f"checkpoint {checkpoint} (m={cfg['num_landmarks']} k={cfg['topk']} "
          f"s={cfg['route_topk']})")
    for text, label in generate(5, seed=424242, cfg=ListOpsConfig(500, 2000)):
        ids = torch.tensor([encode(text)])
        line = [f"N={ids.shape[1]:5d} label={label}"]
        for name, model in models.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                pred = int(model(ids).argmax())
            line.append(f"{name}: {pred} ({1e3 * (time.perf_counter() - t0):.1f} ms)")
        print("  ".join(line))


if __name__ == "__main__":
    main()
