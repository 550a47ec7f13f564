"""Data and the task, without torch: ListOps (``listops``), the TSV readers (``tsv``), the
vocabulary, a checkpoint's tokenizers (``tokenizers``) and task (``task``), your labelled files
(``labelled``), IDX images as pixel ids (``images``, also a command) and the data-set command
(``datasets``, ``make data``)."""
