"""The training face: flags (``flags``), the YAML configuration (``config``: read by
``config_loader``, checked by ``config_checks`` and ``config_schema``, built by
``config_builders``), the ``Trainer`` (``trainer``, on ``batches``, ``data_cursor``,
``metrics`` and ``sharding``), checkpoints (``checkpoint``, ``rng``, ``signals``),
learning-rate scaling (``lr_scaling``), monitors (``monitors``) and the ``mbcompile``
command (``cli``, one ``cli_*`` module per command)."""
