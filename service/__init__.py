"""service package: the Ray Serve app (gateway, classifiers, metrics, launcher)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
