"""``fstrain train``'s flags are generated from :class:`fstrain.config.TrainConfig` and keep every
flag name and default of earlier releases (public contracts); ``--config`` / ``--print-config``."""

from __future__ import annotations

import argparse
import dataclasses
import re
import pytest

from tests.conftest import REPO_ROOT

#: ``fstrain train``'s visible flags before the config was generated from the dataclasses.
OLD_FLAGS = ['--attention', '--attention-dim', '--backend', '--bucket-ratio', '--checkpoint-dir',
             '--checkpoint-every-steps', '--collective-timeout-seconds', '--dense-lr', '--dropout', '--embedding-dim',
             '--eval-data', '--eval-every-epochs', '--eval-every-steps', '--eval-max-users', '--help', '--json',
             '--linear-dim', '--log-every', '--log-every-steps', '--max-seq-len', '--max-steps', '--metrics-dir',
             '--model', '--negatives', '--no-l2-normalize', '--no-progress', '--num-heads', '--num-items',
             '--num-layers', '--num-negatives', '--objective', '--pipeline', '--progress', '--quiet', '--resume',
             '--seed', '--simulate-ranks', '--sparse-lr', '--sparse-optimizer', '--step-mode', '--temperature',
             '--tensorboard-dir', '--verbose', '--version', '--weight-decay', '-h', '-q', '-v']

#: What the hand-written parser of earlier releases gave for ``fstrain train shards/`` (its dests).
OLD_DEFAULTS = {'shards': 'shards/', 'max_steps': None, 'log_every_steps': 10, 'checkpoint_dir': None,
                'checkpoint_every_steps': 0, 'resume': False, 'metrics_dir': None, 'tensorboard_dir': None,
                'pipeline': 'auto', 'step_mode': 'measured', 'backend': 'auto', 'collective_timeout_seconds': 120.0,
                'dense_lr': 0.001, 'weight_decay': 0.0, 'sparse_lr': 0.05, 'sparse_optimizer': 'rowwise_adagrad',
                'eval_data': None, 'eval_every_steps': 0, 'eval_every_epochs': 0, 'eval_max_users': None,
                'simulate_ranks': False, 'model': 'sasrec', 'objective': None, 'num_items': None, 'embedding_dim': 64,
                'num_layers': 2, 'num_heads': 2, 'attention_dim': None, 'linear_dim': None, 'num_negatives': 128,
                'negatives': 'step', 'temperature': 0.05, 'l2_normalize': True, 'dropout': 0.2, 'max_seq_len': 512,
                'bucket_ratio': 1.25, 'attention': 'bucketed', 'seed': 0}

#: Command lines the README, docs, benchmarks and the demo run, and what that parser gave for them
#: (only the values that differ from ``OLD_DEFAULTS``).
CASES = [
    (['train', 'shards/', '--max-steps', '100', '--log-every-steps', '10'],
     {'max_steps': 100}),
    (['train', 'shards/', '--checkpoint-dir', 'ckpt/', '--checkpoint-every-steps', '50', '--resume', '--metrics-dir',
      'run/'],
     {'checkpoint_dir': 'ckpt/', 'checkpoint_every_steps': 50, 'resume': True, 'metrics_dir': 'run/'}),
    (['train', 'shards/', '--eval-data', 'eval.parquet', '--eval-every-steps', '50', '--metrics-dir', 'run/'],
     {'metrics_dir': 'run/', 'eval_data': 'eval.parquet', 'eval_every_steps': 50}),
    (['train', 'shards', '--eval-data', 'eval.parquet', '--eval-every-epochs', '10', '--max-seq-len', '200',
      '--pipeline', 'none'],
     {'shards': 'shards', 'pipeline': 'none', 'eval_data': 'eval.parquet', 'eval_every_epochs': 10,
      'max_seq_len': 200}),
    (['train', 's', '--simulate-ranks', '--max-steps', '7', '--seed', '3', '--eval-data', 'e.parquet', '--metrics-dir',
      'r', '--max-seq-len', '50', '--pipeline', 'none', '--step-mode', 'plain', '--log-every-steps', '0',
      '--eval-max-users', '500', '--json'],
     {'shards': 's', 'max_steps': 7, 'log_every_steps': 0, 'metrics_dir': 'r', 'pipeline': 'none', 'step_mode': 'plain',
      'eval_data': 'e.parquet', 'eval_max_users': 500, 'simulate_ranks': True, 'max_seq_len': 50, 'seed': 3}),
    (['train', 's', '--pipeline', 'prioritized', '--backend', 'shm', '--max-steps', '20', '--log-every-steps', '5',
      '--metrics-dir', 'm', '--tensorboard-dir', 'tb', '--max-seq-len', '200', '--embedding-dim', '32', '--num-layers',
      '1', '--num-heads', '2', '--num-negatives', '64', '--sparse-lr', '0.2', '--json', '--no-progress'],
     {'shards': 's', 'max_steps': 20, 'log_every_steps': 5, 'metrics_dir': 'm', 'tensorboard_dir': 'tb',
      'pipeline': 'prioritized', 'backend': 'shm', 'sparse_lr': 0.2, 'embedding_dim': 32, 'num_layers': 1,
      'num_negatives': 64, 'max_seq_len': 200}),
    (['train', 's', '--pipeline', 'pec', '--backend', 'cuda-ce', '--embedding-dim', '64', '--log-every', '3'],
     {'shards': 's', 'log_every_steps': 3, 'pipeline': 'pec', 'backend': 'cuda-ce'}),
    (['train', 's', '--num-negatives', '128', '--negatives', 'sample', '--temperature', '0.05', '--sparse-lr', '0.2',
      '--model', 'hstu', '--dropout', '0.2', '--dense-lr', '0.001', '--weight-decay', '0.01', '--sparse-optimizer',
      'adagrad', '--no-l2-normalize', '--objective', 'last-position', '--num-items', '3707', '--attention-dim', '8',
      '--linear-dim', '8', '--bucket-ratio', '1.5', '--attention', 'reference', '--collective-timeout-seconds', '30',
      '--backend', 'gloo'],
     {'shards': 's', 'backend': 'gloo', 'collective_timeout_seconds': 30.0, 'weight_decay': 0.01, 'sparse_lr': 0.2,
      'sparse_optimizer': 'adagrad', 'model': 'hstu', 'objective': 'last-position', 'num_items': 3707,
      'attention_dim': 8, 'linear_dim': 8, 'negatives': 'sample', 'l2_normalize': False, 'bucket_ratio': 1.5,
      'attention': 'reference'}),
]

#: The old flat names of the fields that moved into a section.
MOVED = {'log_every_steps': 'metrics.log_every_steps', 'checkpoint_dir': 'checkpoint.dir',
         'checkpoint_every_steps': 'checkpoint.every_steps', 'resume': 'checkpoint.resume',
         'metrics_dir': 'metrics.dir',
         'tensorboard_dir': 'metrics.tensorboard_dir', 'pipeline': 'pipeline.name', 'step_mode': 'pipeline.step_mode',
         'backend': 'comm.backend', 'dense_lr': 'optim.dense_lr', 'weight_decay': 'optim.weight_decay',
         'sparse_lr': 'optim.sparse_lr', 'sparse_optimizer': 'optim.sparse_optimizer', 'eval_data': 'eval.data',
         'eval_every_steps': 'eval.every_steps', 'eval_every_epochs': 'eval.every_epochs',
         'eval_max_users': 'eval.max_users'}
MODEL_FIELDS = {'model', 'objective', 'num_items', 'embedding_dim', 'num_layers', 'num_heads', 'attention_dim',
                'linear_dim', 'num_negatives', 'negatives', 'temperature', 'l2_normalize', 'dropout', 'max_seq_len',
                'bucket_ratio', 'attention'}


def _train_parser() -> argparse.ArgumentParser:
    from fstrain.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _config(argv: list[str]):
    from fstrain.cli import _train_config, build_parser, parse_args

    parser = build_parser()
    return _train_config(parse_args(argv, parser), parser)[1]


def _path(old: str) -> str:
    return MOVED.get(old, f"model.{old}" if old in MODEL_FIELDS else old)


def test_every_old_flag_is_still_there():
    flags = {s for a in _train_parser()._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert set(OLD_FLAGS) <= flags, sorted(set(OLD_FLAGS) - flags)


@pytest.mark.parametrize("argv,changed", [(["train", "shards/"], {})] + CASES, ids=lambda x: None)
def test_documented_command_lines_give_the_old_values(argv, changed):
    from fstrain.config import get_path

    cfg = _config(argv)
    for old, value in {**OLD_DEFAULTS, **changed}.items():
        assert get_path(cfg, _path(old)) == value, (argv, old, _path(old))


def test_documented_train_flags_exist():
    """Every ``--flag`` written after ``fstrain train`` in the README, the docs, the benchmarks and the demo parses."""
    flags = {s for a in _train_parser()._actions for s in a.option_strings}
    files = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md"), *(REPO_ROOT / "benchmarks").glob("*.py"),
             *(REPO_ROOT / "pipelines").glob("*.py")]
    used = set()
    for f in files:
        for line in f.read_text().splitlines():
            for m in re.finditer(r"fstrain(\.cli)?\W+train\b", line):  # up to the next command or quote
                rest = re.split(r"fsdata|fstrain (?!train)|`|;|&&|\|", line[m.end():])[0]
                used |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
    assert used, "no fstrain train command found in the docs"
    unknown = sorted(used - flags - {"--nproc-per-node", "--standalone", "--nnodes", "--node-rank", "--master-addr",
                                     "--master-port", "--rdzv-endpoint", "--rdzv-backend"})
    assert not unknown, unknown


def test_each_field_is_a_flag_with_the_dataclass_default():
    """Declared once: a field's flag default is the dataclass default (TrainConfig's sections included)."""
    from fstrain.config import KEY_ROOT, NOT_FLAGS, TrainConfig, get_path, walk_fields

    parser = _train_parser()
    by_dest = {a.dest.removeprefix(KEY_ROOT + "."): a for a in parser._actions}
    ref = TrainConfig(shards="s")
    for path, f, _, doc in walk_fields(TrainConfig):
        if path in NOT_FLAGS or path == "shards":
            continue
        assert path in by_dest, f"{path} has no flag"
        default = by_dest[path].default
        assert (list(default) if isinstance(default, (list, tuple)) else default) == (
            list(get_path(ref, path)) if isinstance(get_path(ref, path), tuple) else get_path(ref, path)), path
        assert doc, f"{path} has no docstring (its --help text)"


def test_model_flag_defaults_come_from_the_model_config():
    from fstrain.models.config import Config

    cfg = _config(["train", "s"])
    assert cfg.model == Config()
    assert dataclasses.replace(cfg.model, embedding_dim=32) == _config(["train", "s", "--embedding-dim", "32"]).model


def test_pipeline_and_comm_fields_reach_the_cli():
    cfg = _config(["train", "s", "--no-pipeline-overlap", "--pipeline-ordered-collectives", "--pipeline-pec-fallback",
                   "--shm-chunk-bytes", "4096", "--shm-num-slots", "8", "--cuda-ce-chunk-bytes", "65536",
                   "--betas", "0.9", "0.99", "--collective-timeout-seconds", "30"])
    assert (cfg.pipeline.overlap, cfg.pipeline.ordered_collectives, cfg.pipeline.pec_fallback) == (False, True, True)
    assert (cfg.comm.shm.chunk_bytes, cfg.comm.shm.num_slots, cfg.comm.cuda_ce.chunk_bytes) == (4096, 8, 65536)
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.comm.shm.timeout_seconds == 30.0  # one timeout: the collective timeout


def _cli(capsys, *args) -> tuple[int, str, str]:
    from fstrain.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_print_config_round_trips_through_config_file(tmp_path, capsys):
    """--print-config's YAML read back with --config gives the same config; flags given win over the file."""
    import yaml

    from fstrain.config import to_dict

    argv = ["train", "shards/", "--embedding-dim", "32", "--pipeline", "none", "--shm-num-slots", "8",
            "--eval-data", "e.parquet", "--betas", "0.8", "0.9"]
    first = _config(argv)
    path = tmp_path / "c.yaml"
    rc, out, err = _cli(capsys, *argv, "--print-config")
    assert rc == 0, err
    assert yaml.safe_load(out) == to_dict(first)
    path.write_text(out)
    assert _config(["train", "--config", str(path)]) == first
    again = _config(["train", "--config", str(path), "--embedding-dim", "16", "--max-steps", "5"])
    assert (again.model.embedding_dim, again.max_steps, again.comm.shm.num_slots) == (16, 5, 8)


@pytest.mark.parametrize("text,message", [
    ("optim:\n  dense_lrr: 0.1\n", "unknown key(s) optim.dense_lrr"),
    ("- a\n- b\n", "must hold a mapping"),
    ("optim: [\n", "is not valid YAML"),
])
def test_bad_config_file_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    rc, _, err = _cli(capsys, "train", "shards/", "--config", str(path))
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_config_file_is_read_by_the_parser_and_flags_win_wherever_they_stand(tmp_path):
    """--config is jsonargparse's config action (one parse): a flag before it still overrides the file,
    and SHARDS on the command line overrides the file's."""
    path = tmp_path / "c.yaml"
    path.write_text("shards: from-file/\nmodel:\n  embedding_dim: 48\noptim:\n  dense_lr: 0.5\n")
    cfg = _config(["train", "--embedding-dim", "16", "--config", str(path)])
    assert (cfg.shards, cfg.model.embedding_dim, cfg.optim.dense_lr) == ("from-file/", 16, 0.5)
    cfg = _config(["train", "cli/", "--config", str(path)])
    assert (cfg.shards, cfg.model.embedding_dim) == ("cli/", 48)
    assert _config(["train", "s/"]).shards == "s/" and _config(["train"]).shards is None
