"""The nightly job chains its runs' vocabularies (``--vocab``), so one vocabulary lives on."""

import json

import numpy as np
import polars as pl

from fsdata import Vocabulary
from pipelines.nightly import run_nightly
from tests.pipelines.helpers import at, nightly_config


def _log(path, seed, n_items):
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 60, 1500), rng.integers(0, n_items, 1500)
    path.write_text("user,item\n" + "".join(f"u{u},item-{i}\n" for u, i in zip(users, items)))
    return path


def test_second_run_with_new_items_keeps_old_indices(tmp_path):
    log = _log(tmp_path / "log.csv", 0, 200)
    cfg = nightly_config(input=str(log), format="events", user_col="user", item_col="item", num_ranks=2,
                         batch_size_per_rank=8)
    work = tmp_path / "work"
    r1 = run_nightly(at(cfg, work))
    first = Vocabulary.read(f"{r1['run_dir']}/samples.parquet.vocab")
    manifest = json.loads((work / "latest" / "shards" / "_manifest.json").read_text())
    assert manifest["num_items"] == first.num_items
    assert manifest["vocab"]["path"] == "../samples.parquet.vocab"
    _log(log, 1, 260)  # tomorrow's log: other events, new items
    r2 = run_nightly(at(cfg, work))
    assert r2["run_key"] != r1["run_key"] and r2["published"]
    second = Vocabulary.read(f"{r2['run_dir']}/samples.parquet.vocab")
    old = first.items.select("id", "index")
    assert second.items.head(old.height).select("id", "index").equals(old)  # nothing renumbered
    assert second.items.height > old.height
    new_ids = second.items.slice(old.height)["id"].to_list()
    raw = pl.read_csv(log)["item"].unique(maintain_order=True).to_list()
    assert new_ids == [i for i in raw if i not in set(old["id"].to_list())]  # appended in first appearance order


def test_parquet_or_gz_given_to_the_nightly_job_works_or_is_one_line(tmp_path, capsys):
    import gzip

    from pipelines import nightly

    gz = tmp_path / "seq.txt.gz"
    gz.write_bytes(gzip.compress(b"1 10 11 12\n2 20 21 22\n3 30 31\n"))
    assert nightly.main(["--input", str(gz), "-o", str(tmp_path / "w1"), "--ranks", "2", "--batch-size-per-rank",
                         "1", "--no-progress"]) == 0
    capsys.readouterr()
    events = tmp_path / "events.parquet"
    pl.DataFrame({"user_id": ["a", "a", "b", "b"], "item_id": ["x", "y", "x", "z"]}).write_parquet(events)
    assert nightly.main(["--input", str(events), "-o", str(tmp_path / "w2"), "--ranks", "2",
                         "--batch-size-per-rank", "1", "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "--format events" in err[0]
    assert nightly.main(["--input", str(events), "--format", "events", "-o", str(tmp_path / "w3"), "--ranks", "2",
                         "--batch-size-per-rank", "1", "--no-progress"]) == 0
