"""Every bad input: one clear error line naming the fix, exit 2, nothing written."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples


def _table(**over):
    cols = {"sample_id": pa.array([1, 2, 3, 4], pa.int64()), "user_id": pa.array([1, 1, 2, 2], pa.int64()),
            "item_ids": pa.array([[1], [1, 2], [3], [3, 4]], pa.list_(pa.int64())),
            "target_item_id": pa.array([2, 3, 4, 5], pa.int64())}
    cols.update(over)
    return pa.table({k: v for k, v in cols.items() if v is not None})


def _make(tmp_path, kind):
    p = tmp_path / "in.parquet"
    if kind == "missing_column":
        pq.write_table(_table(target_item_id=None), p)
    elif kind == "wrong_type":
        pq.write_table(_table(sample_id=pa.array(["a", "b", "c", "d"])), p)
    elif kind == "wrong_list_type":
        pq.write_table(_table(item_ids=pa.array([[1.5], [1.0], [2.0], [3.0]])), p)
    elif kind == "nulls":
        pq.write_table(_table(user_id=pa.array([1, None, 2, 2], pa.int64())), p)
    elif kind == "null_items":
        pq.write_table(_table(item_ids=pa.array([[1], None, [3], [3]], pa.list_(pa.int64()))), p)
    elif kind == "empty_list":
        pq.write_table(_table(item_ids=pa.array([[1], [], [3], [3]], pa.list_(pa.int64()))), p)
    elif kind == "duplicate_ids":
        pq.write_table(_table(sample_id=pa.array([1, 1, 2, 3], pa.int64())), p)
    elif kind == "empty_file":
        p.write_bytes(b"")
    elif kind == "corrupt":
        write_samples(p, n=64)
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    elif kind == "no_rows":
        pq.write_table(_table().slice(0, 0), p)
    elif kind == "empty_dir":
        p = tmp_path / "dir"
        p.mkdir()
        (p / "notes.txt").write_text("no parquet here")
    elif kind == "wrong_seq_len":
        pq.write_table(_table(seq_len=pa.array([1, 2, 1, 3], pa.int32())), p)
    elif kind == "missing_path":
        p = tmp_path / "nope.parquet"
    return p


CASES = {
    "missing_column": "lacks required columns ['target_item_id']",
    "wrong_type": "expected int64",
    "wrong_list_type": "expected list<int64>",
    "nulls": "null values",
    "null_items": "null values",
    "empty_list": "empty item_ids",
    "duplicate_ids": "not unique",
    "empty_file": "not readable Parquet",
    "corrupt": "not readable Parquet",
    "no_rows": "no rows",
    "empty_dir": "holds no .parquet",
    "missing_path": "does not exist",
}
BALANCE_ONLY = {"wrong_seq_len": "seq_len differs from len(item_ids)"}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("command", ["balance", "profile"])
def test_bad_input(tmp_path, capsys, kind, command):
    inp = _make(tmp_path, kind)
    out = tmp_path / "out"
    args = [command, str(inp)] + ([str(out)] if command == "balance" else [])
    rc = main(args + ["--ranks", "2", "--batch-size-per-rank", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("fsdata: error: ") and len(err.strip().splitlines()) == 1
    assert CASES[kind] in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("kind", sorted(BALANCE_ONLY))
def test_bad_input_found_while_streaming(tmp_path, capsys, kind):
    inp = _make(tmp_path, kind)
    out = tmp_path / "out"
    rc = main(["balance", str(inp), str(out), "--ranks", "2", "--batch-size-per-rank", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and BALANCE_ONLY[kind] in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("args,fragment", [
    (["--ranks", "0", "--batch-size-per-rank", "2"], "--ranks must be >= 1"),
    (["--ranks", "2", "--batch-size-per-rank", "0"], "--batch-size-per-rank must be >= 1"),
    (["--ranks", "64", "--batch-size-per-rank", "32"], "needs at least 2048 samples for one step; the input has 100"),
    (["--ranks", "2", "--batch-size-per-rank", "2", "--cost-model", "cubic"], "unknown cost model 'cubic'"),
    (["--ranks", "2", "--batch-size-per-rank", "2", "--cost-model", "hstu:d_model=x"], "is not a number"),
    (["--ranks", "2", "--batch-size-per-rank", "2", "--cost-model", "/no/such.json"], "does not exist"),
])
def test_impossible_settings(tmp_path, capsys, args, fragment):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    out = tmp_path / "out"
    rc = main(["balance", str(inp), str(out), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_bad_cost_model_file(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=100)
    cm = tmp_path / "cm.json"
    cm.write_text('{"kind": "polynomial", "coefficients": [0, -1, 1]}')
    rc = main(["balance", str(inp), str(tmp_path / "o"), "--ranks", "2", "--batch-size-per-rank", "2",
               "--cost-model", str(cm), "--no-progress"])
    assert rc == 2 and ">= 0" in capsys.readouterr().err


def test_verify_not_an_output(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "_manifest.json not found" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["dense", "offset", "negative", "wide", "repeats", "tiny"])
def test_num_duplicates_counts_what_a_sort_counts(case):
    """The bitmap count (ids within 4N values) and the sort fallback (wider spans) agree with
    :func:`sorted_unique` on shuffled, shifted, negative, sparse and heavily repeated ids."""
    from fsdata.samples.io import DENSE_ID_SPAN, num_duplicates, sorted_unique

    rng = np.random.default_rng(7)
    n = 10_000
    ids = {"dense": rng.permutation(n), "offset": rng.permutation(n) + 10**12,
           "negative": rng.permutation(n) - n // 2, "wide": rng.choice(10**15, n, replace=False),
           "repeats": rng.integers(0, n // 3, n), "tiny": np.array([5, 5])}[case].astype(np.int64)
    if case in ("dense", "offset", "negative", "repeats"):
        assert int(ids.max()) - int(ids.min()) < DENSE_ID_SPAN * len(ids)  # the bitmap path is the one tested
    ids[: n // 100] = ids[n // 100: 2 * (n // 100)] if case != "tiny" else ids[:1]  # some repeats in every case
    assert num_duplicates(ids) == sorted_unique(ids)[1]
    assert num_duplicates(ids) > 0
    assert num_duplicates(np.unique(ids)) == 0
