"""Tests of operations.py, the operational side: argument types, path checks, checkpoints that
prove themselves, logs of whole lines, and data files validated where they are read.
Run: python -m pytest -q test_operations.py
"""
import argparse
import math
import os
from pathlib import Path

import pytest

import operations
from operations import UserError, check_path, user_path


# ----------------------------------------------------------------------------- argument types
REFUSED = {
    'positive_int': ['0', '-3', '1.5', 'x', '', '1e3'],
    'non_negative_int': ['-1', '2.0', 'nan'],
    'seed_int': ['-1', str(2 ** 63), 'inf'],
    'numpy_seed': ['-1', str(2 ** 32)],
    'positive_float': ['0', '-1e-9', 'inf', '-inf', 'nan', '1e400', 'x'],
    'non_negative_float': ['-1e-9', 'inf', 'nan', '-inf'],
    'fraction': ['1', '-0.1', 'nan', 'inf', '1.5'],
    'probability': ['0', '1', 'nan', '-0.5', 'inf'],
}
ACCEPTED = {
    'positive_int': [('1', 1), (' 7 ', 7)],
    'non_negative_int': [('0', 0)],
    'seed_int': [('0', 0), (str(2 ** 63 - 1), 2 ** 63 - 1)],
    'numpy_seed': [(str(2 ** 32 - 1), 2 ** 32 - 1)],
    'positive_float': [('1e-300', 1e-300), ('2.5e-4', 2.5e-4)],
    'non_negative_float': [('0', 0.0), ('-0', 0.0), ('3', 3.0)],
    'fraction': [('0', 0.0), ('0.999', 0.999)],
    'probability': [('0.37', 0.37), ('1e-9', 1e-9)],
}


@pytest.mark.parametrize('name', sorted(REFUSED))
def test_argument_types_refuse_out_of_range_and_non_finite_in_one_line(name, capsys):
    parser = argparse.ArgumentParser(prog='x')
    parser.add_argument('--flag', type=getattr(operations, name))
    for s in REFUSED[name]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([f'--flag={s}'])  # (argparse reads '-1e-9' as a flag)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and err.startswith('x: error: argument --flag: must be '), (s, err)
        assert 'invalid' not in err and (repr(s) in err or s.strip() in err), (s, err)
    for s, v in ACCEPTED[name]:
        got = parser.parse_args([f'--flag={s}']).flag
        assert got == v and type(got) is type(v), (s, got)


def test_argument_type_messages_name_the_allowed_range():
    cases = {'positive_float': 'a finite number > 0', 'non_negative_float': 'a finite number >= 0',
             'fraction': 'a finite number in [0, 1)', 'probability': 'a finite number in (0, 1)',
             'positive_int': 'an integer >= 1', 'seed_int': 'an integer in [0, 2**63)',
             'numpy_seed': 'an integer in [0, 2**32)'}
    for name, rule in cases.items():
        with pytest.raises(argparse.ArgumentTypeError, match=rf'^must be {__import__("re").escape(rule)}, got'):
            getattr(operations, name)('-5')


def test_thread_count_stays_within_the_cores():
    cores = os.cpu_count() or 1
    assert operations.thread_count(str(cores)) == cores
    for s in ('0', str(cores + 1), str(10 ** 12), 'x'):
        with pytest.raises(argparse.ArgumentTypeError, match='must be'):
            operations.thread_count(s)


def test_range_factories_at_their_ends():
    t = operations.float_range(1, lo_open=True)   # e.g. hnet's ratio target > 1
    assert t('1.0001') == 1.0001
    for s in ('1', '0.5', 'nan', 'inf'):
        with pytest.raises(argparse.ArgumentTypeError, match=r'> 1, got'):
            t(s)
    t = operations.int_range(2, 5)
    assert [t(str(i)) for i in (2, 5)] == [2, 5]
    for s in ('1', '6'):
        with pytest.raises(argparse.ArgumentTypeError, match=r'in \[2, 5\], got'):
            t(s)


# ----------------------------------------------------------------------------- paths
@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A folder with a file, a directory and a FIFO; the test runs inside it."""
    monkeypatch.chdir(tmp_path)
    Path('f').write_text('x')
    Path('d').mkdir()
    os.mkfifo('fifo')
    return tmp_path


LONG = 'x' * 300                        # one name over the usual 255-byte limit (ENAMETOOLONG)
DEEP = '/'.join(['y' * 200] * 25)       # 25 levels: a path over the 4096-byte limit
PATH_CASES = [
    ('f', 'file', None), ('d', 'dir', None), ('d/new.tsv', 'new-file', None), ('f', 'new-file', None),
    ('d', 'new-dir', None), ('a/b/c', 'new-dir', None),
    ('nope', 'file', 'no such file'), ('nope', 'dir', 'no such directory'),
    ('d', 'file', 'is a directory, not a regular file'),
    ('fifo', 'file', 'is a FIFO (named pipe), not a regular file'),
    ('/dev/null', 'file', 'is a character device, not a regular file'),
    ('fifo', 'new-file', 'is a FIFO (named pipe), not a regular file'),
    ('d', 'new-file', 'is a directory, not a regular file'),
    ('f', 'dir', 'is a file, not a directory'), ('f', 'new-dir', 'is a file, not a directory'),
    ('f/x', 'dir', 'f is a file, not a directory'), ('f/x/y', 'new-dir', 'f is a file, not a directory'),
    ('f/x.png', 'new-file', 'f is a file, not a directory'),
    ('no/such/x.png', 'new-file', 'the folder no/such does not exist'),
    (LONG, 'file', 'is 300 bytes, longer than the 255'), (LONG, 'new-dir', 'is 300 bytes, longer than the 255'),
    ('d/' + LONG, 'new-file', 'is 300 bytes, longer than the 255'),
    (DEEP, 'file', 'bytes long, over the 4096'), (DEEP, 'new-dir', 'bytes long, over the 4096'),
    ('', 'file', 'an empty path'), ('a\nb', 'new-dir', None),
]


@pytest.mark.parametrize('path, kind, words', PATH_CASES, ids=[f'{k}:{p[:12]!r}' for p, k, _ in PATH_CASES])
def test_check_path_each_case_in_one_line(tree, path, kind, words):
    if words is None:
        assert check_path(path, kind, '--out') == Path(path)
        return
    with pytest.raises(UserError) as e:
        check_path(path, kind, '--out')
    msg = str(e.value)
    assert '\n' not in msg and len(msg) < 300 and msg.startswith('--out ') and words in msg, msg
    assert e.value.code == 1


def test_check_path_unreadable_and_unwritable(tree, monkeypatch):
    # (root reads everything: the permission test asks os.access, which the check uses)
    monkeypatch.setattr(os, 'access', lambda p, mode: False)
    for path, kind, words in (('f', 'file', 'not readable'), ('d', 'dir', 'not readable'),
                              ('f', 'new-file', 'not writable'), ('d/x', 'new-file', 'd is not writable'),
                              ('d/a/b', 'new-dir', 'd is not writable')):
        with pytest.raises(UserError, match=words):
            check_path(path, kind)


def test_user_path_is_an_argparse_type_exiting_2(tree, capsys):
    parser = argparse.ArgumentParser(prog='x')
    parser.add_argument('--ckpt', type=user_path('file'))
    parser.add_argument('--out', type=user_path('new-dir'))
    assert parser.parse_args(['--ckpt', 'f', '--out', 'runs/a']).out == Path('runs/a')
    for argv, words in ((['--ckpt', 'd'], 'argument --ckpt: d: is a directory'),
                        (['--out', 'f/run'], 'argument --out: f/run: f is a file, not a directory')):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err
