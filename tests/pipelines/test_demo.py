import json

import pytest

from pipelines import demo


@pytest.mark.slow
def test_demo_on_generated_data_when_datasets_are_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "ML1M", tmp_path / "absent" / "sequences.txt")
    rc = demo.main(["--output", str(tmp_path / "out"), "--ranks", "8", "--batch-size-per-rank", "16",
                    "--train-steps", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "using generated heavy-tailed samples" in out
    before = float(out.split("bubble before:")[1].split("%")[0])
    after = float(out.split("bubble after:")[1].split("%")[0])
    assert before > 10 and after < 0.1 * before
    shards = tmp_path / "out" / "nightly" / "latest" / "shards"
    assert any((shards / name).exists() for name in ("_manifest.json", "manifest.json"))
    assert "cost model:        hstu" in out  # the CLI default, said so
    page = (tmp_path / "out" / "nightly" / "latest" / "report.html").resolve()
    assert page.read_text().count("<img ") == 4 and page.as_uri() in out


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_training_writes_report_and_tensorboard(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "ML1M", tmp_path / "absent" / "sequences.txt")
    small = demo.synthetic_input
    monkeypatch.setattr(demo, "synthetic_input", lambda out: small(out, num_samples=20_000))
    rc = demo.main(["--output", str(tmp_path / "out"), "--ranks", "8", "--batch-size-per-rank", "16",
                    "--train-steps", "6", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert (tmp_path / "out" / "train-report.html").read_text().count("<img ") == 7
    tb = tmp_path / "out" / "tensorboard"
    assert f"tensorboard --logdir {tb}" in out and "training report:" in out
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())


@pytest.mark.slow
def test_demo_json_summary_on_stdout_readable_lines_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "ML1M", tmp_path / "absent" / "sequences.txt")
    small = demo.synthetic_input
    monkeypatch.setattr(demo, "synthetic_input", lambda out: small(out, num_samples=20_000))
    rc = demo.main(["-o", str(tmp_path / "out"), "--ranks", "8", "--batch-size-per-rank", "16",
                    "--train-steps", "0", "--no-progress", "--json"])
    cap = capsys.readouterr()
    obj = json.loads(cap.out)  # stdout is the JSON object alone
    assert rc == 0 and obj["cost_model"] == "hstu" and obj["num_ranks"] == 8
    assert obj["predicted_bubble"] < obj["baseline_predicted_bubble"] and obj["report"].endswith("report.html")
    assert "bubble before:" in cap.err and "train" not in obj
