"""``python -m mita.training``: train a classifier (``train.main``; ``--help`` lists the flags)."""

from .train import main

main()
