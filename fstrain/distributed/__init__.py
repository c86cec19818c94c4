"""Running on several ranks: process groups, sharding, optimizers, transports, peer-failure watch.

=================  =====================================================================
module             what it holds
=================  =====================================================================
``backends``       the one table of backend names (``--backend``) and their devices
``env``            :class:`DistEnv` and ``init_distributed`` (torchrun's environment)
``sharding``       the item table row-wise over ranks, the dense tower DDP with SUM
``optim``          :class:`OptimConfig`: dense AdamW, the table's fused optimizer
``pec``            the same model with the table wrapped for torchrec's PEC pipeline
``watchdog``       a stalled or dead peer ends every rank with one line naming it
``comm/``          the embedding all-to-all transports (gloo/NCCL, shared memory, copy engines)
=================  =====================================================================
"""
