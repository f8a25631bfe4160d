"""Training EAGLE-3 heads for a served model on this machine (``train.py``),
with training-time test (``ttt.py``), from text or chat records (``data.py``);
``cli.py`` is the ``mlx-lm-server-drafter`` command."""
