"""The smaller cases of issue 19 (item 13), each with the behaviour it now has."""

from __future__ import annotations

import hashlib
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdata.cli import main
from tests.fsdata.helpers import write_samples


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdata: error:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("fmt, text, where", [
    ("sequences", "1 5 6 7\n2 -4 5 6\n", "line 2"),
    ("sequences", "-1 5 6 7\n", "line 1"),
    ("events", "user,item\n1,5\n1,6\n2,-3\n", "line 4"),
    ("events", "user,item\n-1,5\n-1,6\n", "line 2"),
])
def test_negative_ids_are_refused_by_convert(tmp_path, capsys, fmt, text, where):
    src = tmp_path / ("log.csv" if fmt == "events" else "log.txt")
    src.write_text(text)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "s.parquet"), "--format", fmt]) == 2
    err = _one_line(capsys)
    assert "negative" in err and where in err
    assert not (tmp_path / "s.parquet").exists()


def test_exact_duplicate_events_are_reported(tmp_path, caplog):
    src = tmp_path / "log.csv"
    src.write_text("user,item,ts\n1,5,10\n1,5,10\n1,6,11\n2,7,1\n2,8,2\n")
    with caplog.at_level(logging.WARNING, logger="fsdata"):
        assert main(["convert", str(src), str(tmp_path / "s.parquet"), "--format", "events", "--time-col", "ts"]) == 0
    assert any("1 exact duplicate events" in r.getMessage() for r in caplog.records)


def test_utf8_bom_in_sequences_is_not_a_token(tmp_path):
    plain, bom = tmp_path / "a.txt", tmp_path / "b.txt"
    plain.write_text("1 5 6 7\n2 4 5 6\n")
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert main(["convert", str(bom), str(tmp_path / "b.parquet"), "--format", "sequences"]) == 0
    assert main(["convert", str(plain), str(tmp_path / "a.parquet"), "--format", "sequences"]) == 0
    assert pq.read_table(tmp_path / "b.parquet").equals(pq.read_table(tmp_path / "a.parquet"))


def test_same_log_under_another_path_gives_the_same_samples(tmp_path):
    a, b = tmp_path / "x" / "log.txt", tmp_path / "y" / "log.txt"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("1 5 6 7\n2 4 5 6\n3 9 8\n")
    assert main(["convert", str(a), str(tmp_path / "a.parquet"), "--format", "sequences"]) == 0
    assert main(["convert", str(b), str(tmp_path / "b.parquet"), "--format", "sequences"]) == 0
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    meta = json.loads(pq.read_metadata(tmp_path / "a.parquet").metadata[b"freescale.convert"])
    assert meta["input"] == "log.txt"


def test_events_id_beyond_int64_names_its_line(tmp_path, capsys):
    src = tmp_path / "log.csv"
    src.write_text("user,item\n1,5\n1,6\n1,18446744073709551615\n")
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "s.parquet"), "--format", "events"]) == 2
    err = _one_line(capsys)
    assert "line 4" in err and "2^63" in err


def test_a_null_list_is_counted_once(tmp_path, capsys):
    t = pq.read_table(write_samples(tmp_path / "ok.parquet", n=64))
    items = t.column("item_ids").to_pylist()
    items[3] = None
    t = t.set_column(t.schema.get_field_index("item_ids"), "item_ids", pa.array(items, type=pa.list_(pa.int64())))
    pq.write_table(t, tmp_path / "bad.parquet")
    capsys.readouterr()
    assert main(["balance", str(tmp_path / "bad.parquet"), str(tmp_path / "out"), "--ranks", "2",
                 "--batch-size-per-rank", "4", "--no-progress"]) == 2
    err = _one_line(capsys)
    assert "'item_ids': 1" in err, err


def test_verify_messages_print_plain_numbers(tmp_path, capsys):
    inp = write_samples(tmp_path / "in.parquet", n=200)
    out = tmp_path / "out"
    assert main(["balance", str(inp), str(out), "--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]) == 0
    stats = pq.read_table(out / "_step_stats.parquet")
    cost = stats.column("predicted_cost").to_pylist()
    cost[0] *= 2
    pq.write_table(stats.set_column(3, "predicted_cost", pa.array(cost)), out / "_step_stats.parquet",
                   compression="zstd")
    m = json.loads((out / "_manifest.json").read_text())
    m["step_stats_sha256"] = hashlib.sha256((out / "_step_stats.parquet").read_bytes()).hexdigest()
    (out / "_manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    capsys.readouterr()
    assert main(["verify", str(out), "--no-progress"]) == 2
    err = _one_line(capsys)
    assert "predicted_cost" in err and "np.float64" not in err


_PLAN_UNDER_FSIZE = r"""
import resource, signal, sys
from fsdata.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
sys.exit(main(["plan", sys.argv[1], sys.argv[2], "--ranks", "2", "--batch-size-per-rank", "8", "--no-progress"]))
"""


def test_plan_under_a_file_size_limit_names_the_plan(tmp_path):
    from tests.fsdata.test_safety_paths import _run_py

    inp = write_samples(tmp_path / "in.parquet", n=2000)
    r = _run_py(_PLAN_UNDER_FSIZE, inp, tmp_path / "plan.parquet", cwd=tmp_path)
    assert r.returncode == 2 and "file too large" in r.stderr, r.stderr
    assert str(tmp_path / "plan.parquet") in r.stderr and str(inp) not in r.stderr
    assert not (tmp_path / "plan.parquet").exists()


@pytest.mark.parametrize("column", ["user_id", "target_item_id", "item_ids"])
def test_negative_ids_are_refused_by_balance(tmp_path, capsys, column):
    t = pq.read_table(write_samples(tmp_path / "ok.parquet", n=64))
    if column == "item_ids":
        items = t.column(column).to_pylist()
        items[5][0] = -7
        arr = pa.array(items, type=t.schema.field(column).type)
    else:
        vals = t.column(column).to_pylist()
        vals[5] = -7
        arr = pa.array(vals, type=t.schema.field(column).type)
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, arr), tmp_path / "bad.parquet")
    capsys.readouterr()
    assert main(["balance", str(tmp_path / "bad.parquet"), str(tmp_path / "out"), "--ranks", "2",
                 "--batch-size-per-rank", "4", "--no-progress"]) == 2
    err = _one_line(capsys)
    assert column in err and "-7" in err and ">= 0" in err
