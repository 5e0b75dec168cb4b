"""Tests of runtime.py's log: log.jsonl of whole JSON lines, a cut last line repaired, the
records after a resumed checkpoint's step dropped, a failed write or rewrite that loses nothing.
Run: python -m pytest -q test_runtime.py
"""
import errno
import json
import os
from types import SimpleNamespace

import pytest
import torch

import common
import runtime


# ----------------------------------------------------------------------------- log.jsonl
ARGS = SimpleNamespace()   # train.py's flags: the log reads none of them


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_log(path, recs, tail=b''):
    path.write_bytes(b''.join(json.dumps(r).encode() + b'\n' for r in recs) + tail)


def test_logger_writes_whole_json_lines_and_nothing_to_stdout(tmp_path, capsys):
    log = runtime.Logger(tmp_path, ARGS, dict(kind='config', lr=1e-3))
    log.log(dict(kind='train', step=1, loss=2.5, sf=None))
    log.log(dict(kind='eval', step=1, split='valid', bpc=1.25))
    assert records(tmp_path / 'log.jsonl') == [dict(kind='config', lr=1e-3),
                                               dict(kind='train', step=1, loss=2.5, sf=None),
                                               dict(kind='eval', step=1, split='valid', bpc=1.25)]
    assert capsys.readouterr() == ('', '')
    runtime.Logger(tmp_path, ARGS, dict(kind='config'), rank=1).log(dict(kind='train', step=2))
    assert len(records(tmp_path / 'log.jsonl')) == 3   # other ranks write nothing


@pytest.mark.parametrize('tail',
                         [b'{"kind": "train", "st', b'{"kind": "train"}', b'garbage\n', b'\n',
                          b'[1, 2]\n'])
def test_a_cut_last_line_is_repaired_before_appending(tmp_path, capsys, tail):
    path = tmp_path / 'log.jsonl'
    before = [dict(kind='config'), dict(kind='train', step=1)]
    write_log(path, before, tail)
    runtime.Logger(tmp_path, ARGS, dict(kind='config', again=True))
    assert records(path) == before + [dict(kind='config', again=True)]
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith(f'warning: {path}: dropped its last line'), err
    assert f'({len(tail)} bytes' in err


def test_a_whole_log_is_left_alone(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    write_log(path, [dict(kind='config'), dict(kind='train', step=1)])
    runtime.Logger(tmp_path, ARGS, dict(kind='config'))
    assert len(records(path)) == 3 and capsys.readouterr().err == ''


def partial_then_full(monkeypatch, after=0.5):
    """os.write writes part of the bytes, then the disk is full (ENOSPC)."""
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:int(len(data) * after)]))
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'write', write)
    return calls


@pytest.mark.parametrize('after', [0.0, 0.5, 0.99])
def test_a_full_disk_mid_record_leaves_no_partial_line(tmp_path, monkeypatch, after):
    log = runtime.Logger(tmp_path, ARGS, dict(kind='config'))
    log.log(dict(kind='train', step=1, loss=3.0))
    before = (tmp_path / 'log.jsonl').read_bytes()
    calls = partial_then_full(monkeypatch, after)
    with pytest.raises(OSError) as e:
        log.log(dict(kind='train', step=2, loss=2.0, note='x' * 500))
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1] < calls[0] or after == 0.0   # the second write was the rest
    # named by the log: common.main's one line says which file and why
    assert common.error_line(e.value) == (f'{tmp_path / "log.jsonl"}: No space left on device', 1)
    assert (tmp_path / 'log.jsonl').read_bytes() == before
    log.log(dict(kind='train', step=2, loss=2.0))  # the disk has room again: the log goes on
    assert [r.get('step') for r in records(tmp_path / 'log.jsonl')] == [None, 1, 2]


def test_ctrl_c_mid_record_leaves_no_partial_line(tmp_path, monkeypatch):
    log = runtime.Logger(tmp_path, ARGS, dict(kind='config'))
    before = (tmp_path / 'log.jsonl').read_bytes()
    real_write = os.write

    def write(fd, data):
        if len(data) > 100:
            return real_write(fd, bytes(data[:50]))
        raise KeyboardInterrupt
    monkeypatch.setattr(os, 'write', write)
    with pytest.raises(KeyboardInterrupt):
        log.log(dict(kind='train', step=1, note='y' * 200))
    monkeypatch.undo()
    assert (tmp_path / 'log.jsonl').read_bytes() == before


def test_resume_drops_the_records_after_the_checkpoint_step(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    recs = ([dict(kind='config', seed=1)] + [dict(kind='train', step=s) for s in (2, 4, 6, 8)]
            + [dict(kind='eval', step=4, split='valid'), dict(kind='eval', step=8, split='valid'),
               dict(kind='config', seed=1, resumed_from=8)])
    write_log(path, recs, tail=b'{"kind": "train", "step": 1')
    runtime.Logger(tmp_path, ARGS, dict(kind='config', resumed_from=4), resumed_from=4)
    got = records(path)
    assert [r for r in got if r['kind'] != 'config'] == [dict(kind='train', step=2),
                                                         dict(kind='train', step=4),
                                                         dict(kind='eval', step=4, split='valid')]
    assert [r for r in got if r['kind'] == 'config'] == [recs[0], recs[-1],
                                                         dict(kind='config', resumed_from=4)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and 'dropped its last line' in err[0], err
    assert err[1] == (f'note: {path}: dropped 3 record(s) of steps after step 4, the checkpoint '
                      f'(the resumed run redoes them)')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['log.jsonl']
    runtime.Logger(tmp_path, ARGS, dict(kind='config'), resumed_from=4)   # nothing more to drop
    assert capsys.readouterr().err == '' and len(records(path)) == len(got) + 1


def test_resume_rewrite_that_fails_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / 'log.jsonl'
    write_log(path, [dict(kind='config'), dict(kind='train', step=2), dict(kind='train', step=4)])
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(OSError, match='No space left on device'):
        runtime.Logger(tmp_path, ARGS, dict(kind='config'), resumed_from=2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['log.jsonl']


def test_runtime_a_device_that_is_not_here_is_a_flag_mistake(monkeypatch):
    """--device cuda (or cuda:N, mps) where this process sees no such device: one UserError line
    with exit code 2, as for any other bad flag (train.py, sample.py and bench.py pick the same)."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: False)
    for name in ('cuda', 'cuda:1', 'mps'):
        with pytest.raises(runtime.UserError) as e:
            runtime.pick_device(name)
        assert e.value.code == 2 and f'--device {name}: no ' in str(e.value), str(e.value)
    assert runtime.pick_device() == 'cpu'
