"""The models fstrain trains: SASRec and HSTU over jagged histories, their objectives and loss.

=================  =====================================================================
module             what it holds
=================  =====================================================================
``config``         :class:`Config` (model settings; the ``fstrain train`` model flags come
                   from its fields) and the names of models, objectives, tables
``recommender``    :class:`SequentialRecommender`: item ``EmbeddingCollection`` + the dense
                   tower (blocks and the sampled-softmax loss)
``sasrec``         SASRec's causal softmax attention block
``hstu``           the HSTU layer (Zhai et al., ICML 2024)
``negatives``      the step's shared (or per-sample) negatives, appended to a batch
``dropout``        dropout masks keyed by (seed, step, sample, position)
``jagged``         the per-length-bucket loop both attention kinds use
=================  =====================================================================
"""

from fstrain.models.config import (MODELS, NEGATIVE_KEY, NEGATIVE_MODES, OBJECTIVE_FOR_SAMPLES, OBJECTIVES, TABLE_NAME,
                                   Config, objective_for)
from fstrain.models.negatives import attach_negatives, with_negatives
from fstrain.models.recommender import DenseTower, SequentialRecommender, make_embedding_collection, objective_inputs
from fstrain.models.sasrec import length_buckets

__all__ = ["MODELS", "NEGATIVE_KEY", "NEGATIVE_MODES", "OBJECTIVES", "OBJECTIVE_FOR_SAMPLES", "TABLE_NAME", "Config",
           "DenseTower", "SequentialRecommender", "attach_negatives", "length_buckets", "make_embedding_collection",
           "objective_for", "objective_inputs", "with_negatives"]
