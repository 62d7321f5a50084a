"""The training face: flags (``flags``), the YAML configuration (the ``config``
package: read by ``config.loader``, checked by ``config.checks`` and ``config.schema``
into a ``config.parse.Config``, built by ``config.builders``), the ``Trainer``
(``trainer``, on ``batches``, ``data_cursor``, ``metrics``, ``progress`` and
``sharding``), checkpoints (``trainer_checkpoints``, on ``checkpoint``,
``checkpoint_dcp``, ``rng`` and ``signals``), learning-rate scaling (``lr_scaling``),
monitors (``monitors``) and the ``mbcompile`` command (the ``cli`` package: ``cli.main``
parses, one module per command)."""
