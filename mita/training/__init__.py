"""Training: the loop and its resumable state (``fit``), the ListOps command
(``python -m mita.training``, ``train``), training on your own labelled file and the three-way
``--compare`` (``train_data``), and a checkpoint's evaluation (``python -m
mita.training.evaluate``). Nothing outside the tests and benchmarks imports it."""
