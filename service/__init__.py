"""service package: the Ray Serve app (gateway, classifiers, metrics, launcher)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder; relative paths are taken from the project root."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p
