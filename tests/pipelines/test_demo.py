import pytest

from pipelines import demo


@pytest.mark.slow
def test_demo_on_generated_data_when_datasets_are_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "ML1M", tmp_path / "absent" / "sequences.txt")
    rc = demo.main(["--out", str(tmp_path / "out"), "--ranks", "8", "--batch-size-per-rank", "16",
                    "--train-steps", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "using generated heavy-tailed samples" in out
    before = float(out.split("bubble before:")[1].split("%")[0])
    after = float(out.split("bubble after:")[1].split("%")[0])
    assert before > 10 and after < 0.1 * before
    assert (tmp_path / "out" / "nightly" / "latest" / "shards" / "_manifest.json").exists()
