"""The sample schema and the shard format: the contract every FreeScale stage speaks.

Sample schema (one Parquet row per training sample; docs/format.md):

=================  ===============  ==================================================
column             Arrow type       meaning
=================  ===============  ==================================================
``sample_id``      int64            unique id of the sample
``user_id``        int64            the user whose history this is
``item_ids``       list<int64>      history, oldest first, at most ``max_seq_len`` items
``target_item_id`` int64            the next item (the label)
``timestamps``     list<int64>      optional, aligned with ``item_ids`` (unix seconds)
``seq_len``        int32            optional, ``len(item_ids)`` stored so later passes
                                    need not decode the lists (written by convert/synth)
=================  ===============  ==================================================

Sequence length ``L = len(item_ids)``. Shards add ``step`` (int32) and ``rank`` (int32): these two
names are reserved (an input column of either name is refused; see :data:`RESERVED_COLUMNS`).
"""

from __future__ import annotations

import pyarrow as pa


SAMPLE_ID = "sample_id"
USER_ID = "user_id"
ITEM_IDS = "item_ids"
TARGET_ITEM_ID = "target_item_id"
TIMESTAMPS = "timestamps"
SEQ_LEN = "seq_len"
STEP = "step"

REQUIRED_COLUMNS: dict[str, pa.DataType] = {
    SAMPLE_ID: pa.int64(),
    USER_ID: pa.int64(),
    ITEM_IDS: pa.list_(pa.int64()),
    TARGET_ITEM_ID: pa.int64(),
}
OPTIONAL_COLUMNS: dict[str, pa.DataType] = {TIMESTAMPS: pa.list_(pa.int64()), SEQ_LEN: pa.int32()}

#: Columns fsdata adds to rank files; an input may not carry a column of either name.
RANK = "rank"
RESERVED_COLUMNS = (STEP, RANK)



def sample_schema(with_timestamps: bool = False, with_seq_len: bool = False) -> pa.Schema:
    """Arrow schema of a sample file.

    Args:
        with_timestamps: include the optional ``timestamps`` column.
        with_seq_len: include the optional ``seq_len`` column (last).

    Returns:
        ``pa.Schema`` with the required columns (and ``timestamps``) in contract order.
    """
    fields = [pa.field(n, t, nullable=False) for n, t in REQUIRED_COLUMNS.items()]
    if with_timestamps:
        fields.append(pa.field(TIMESTAMPS, OPTIONAL_COLUMNS[TIMESTAMPS], nullable=False))
    if with_seq_len:
        fields.append(pa.field(SEQ_LEN, OPTIONAL_COLUMNS[SEQ_LEN], nullable=False))
    return pa.schema(fields)
