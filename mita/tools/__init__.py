"""What the commands share: argument types and the parser (``argtypes``), progress bars
(``progress``), plots and CSV tables (``plots``), and the scores of a classifier's predictions
that hold on skewed data (``scores``). No torch."""
