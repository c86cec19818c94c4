"""What a training run keeps and reports: checkpoints, held-out evaluation, step metrics, the step log.

=================  =====================================================================
module             what it holds
=================  =====================================================================
``checkpoint``     the checkpoint format: save, find, resume, read (one place)
``evaluator``      HR@K / NDCG@K / MRR on a held-out file; ``fstrain evaluate``
``metrics``        per-step, per-rank timings, the measured bubble, JSON/Parquet writers
``nullcontrol``    control steps of ``fstrain train``: the noise floor under the measured bubble
``steplog``        per-step loss and TensorBoard
=================  =====================================================================
"""
