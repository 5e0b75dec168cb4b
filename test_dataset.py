"""Tests of dataset.py, the data loader: meta.json checked field by field, the label set it names,
and a damaged dataset refused in one line at load, never another exception.
Run: python -m pytest -q test_dataset.py
"""
import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dataset
from common import UserError
from conftest import HYPOTHESIS_FIXTURES


# ----------------------------------------------------------------------------- meta.json
def make_dataset(root, unigram=(8, 16)):
    """A tiny dataset in prepare_data.py's layout: token ids, Unigram label sets, meta.json."""
    root.mkdir(parents=True, exist_ok=True)
    alphabet = [' ', 'a', 'b', 'c', '\n']
    rng = np.random.default_rng(0)
    sizes = dict(train=300, valid=60, test=60)
    for s, n in sizes.items():
        rng.integers(0, len(alphabet), n).astype(np.uint8).tofile(root / f'{s}.bin')
        for V in unigram:
            (rng.random(n) < 0.3).astype(np.uint8).tofile(root / f'{s}.unigram-{V}.bin')
    sets = {str(V): dict(vocab_size=V, model=f'unigram-{V}.model',
                         labels={s: f'{s}.unigram-{V}.bin' for s in sizes},
                         settings={'model_type': 'unigram'},
                         fit_words={'distinct_used': 10}, shortening_factor={s: 3.3 for s in sizes},
                         left_context_ceiling={'split': 'valid', 'shortening_factor': 2.9})
            for V in unigram}
    meta = dict(name=root.name, dataset=None, lang='en', alphabet=alphabet,
                vocab_size=len(alphabet),
                space_id=0, newline_id=4, dtype='uint8', sizes=sizes, source=None, slice=None,
                cleaning={'split': 'head'}, inputs=['x.txt'], mean_word_length=4.5,
                defaults={'unigram': 10000, 'prior': 0.2},
                unigram=sets[str(max(unigram))] if unigram else None, unigram_sets=sets)
    (root / 'meta.json').write_text(json.dumps(meta))
    return root, meta


@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp('data') / 'tiny')


def test_load_data_reads_the_label_set_of_its_size(tiny_data, tmp_path):
    root, meta = tiny_data
    m, splits, labels = dataset.load_data(root, 'unigram')
    assert m == meta and {s: len(v) for s, v in splits.items()} == meta['sizes']
    assert np.array_equal(labels['valid'], np.fromfile(root / 'valid.unigram-16.bin', np.uint8))
    _, _, labels = dataset.load_data(root, 'unigram', unigram=8)
    assert np.array_equal(labels['test'], np.fromfile(root / 'test.unigram-8.bin', np.uint8))
    with pytest.raises(UserError, match=r'needs Unigram labels in .* \(it has sizes \[8, 16\]; '
                                        r'make them with: .* --unigram 32\)'):
        dataset.load_data(root, 'unigram', unigram=32)
    other, meta2 = make_dataset(tmp_path / 'other', unigram=(8,))
    (other / 'meta.json').write_text(json.dumps(dict(meta2, unigram=None, unigram_sets=None)))
    with pytest.raises(UserError,
                       match=r'needs Unigram labels in \S+ \(it has sizes \[\]; make them with: '
                             r'.*--unigram 10000\)'):
        dataset.load_data(other, 'unigram')


DAMAGE = [
    ('unigram', 300, '"unigram" is'),
    ('unigram', {'vocab_size': '16'}, '"unigram" is'),
    ('unigram', dict(vocab_size=32), '"unigram" is'),
    ('unigram_sets', [], '"unigram_sets" is'),
    ('unigram_sets', {'16': dict(vocab_size=8)}, '"unigram_sets" is'),
    ('alphabet', [' ', 'a', 'a', 'c', '\n'], '"alphabet" is'),
    ('alphabet', [' ', 'ab', 'b', 'c', '\n'], '"alphabet" is'),
    ('alphabet', 'abcde', '"alphabet" is'),
    ('space_id', 1, '"space_id" is'),
    ('space_id', True, '"space_id" is'),
    ('vocab_size', 6, '"alphabet" is'),
    ('vocab_size', 5.0, '"vocab_size" is'),
    ('vocab_size', 300, '"vocab_size" is'),
    ('dtype', 'int64', '"dtype" is'),
    ('dtype', ['uint8'], '"dtype" is'),
    ('sizes', {'train': '300'}, '"sizes" is'),
    ('sizes', {'train': 3.5e2}, '"sizes" is'),
    ('defaults', {'prior': 1.5}, '"defaults" is'),
    ('defaults', {'unigram': 'many'}, '"defaults" is'),
]


@pytest.mark.parametrize('field, value, words', DAMAGE,
                         ids=[f'{f}={v!r:.20}' for f, v, _ in DAMAGE])
def test_hand_edited_meta_json_ends_in_one_line(tiny_data, tmp_path, field, value, words):
    root, meta = tiny_data
    d = tmp_path / 'd'
    d.mkdir()
    (d / 'meta.json').write_text(json.dumps(dict(meta, **{field: value})))
    with pytest.raises(UserError) as e:
        dataset.load_data(d, 'unigram')
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith(f'{d / "meta.json"}: ') and words in msg, msg
    assert 'remake it with: python prepare_data.py' in msg


@pytest.mark.parametrize('text, words',
                         [('{"alphabet": [', 'unreadable'),
                          ('[1, 2]', 'holds [1, 2], not an object'),
                                         ('{}', '"dtype" is missing'), ('\udcff', 'unreadable'),
                                         ('[' * 100000, 'unreadable')])
def test_meta_json_that_is_no_json_object_ends_in_one_line(tmp_path, text, words):
    (tmp_path / 'meta.json').write_bytes(text.encode('utf-8', 'surrogateescape'))
    with pytest.raises(UserError) as e:
        dataset.read_meta(tmp_path)
    assert '\n' not in str(e.value) and words in str(e.value), str(e.value)


def json_paths(obj, prefix=()):
    """Every (path of keys, value) in a JSON tree."""
    yield prefix, obj
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list)
             else ())
    for k, v in items:
        yield from json_paths(v, prefix + (k,))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 70000) | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=5)


@settings(**HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_damaged_meta_json_is_one_line_never_another_exception(tiny_data, tmp_path, data):
    """Random deletions and type changes anywhere in meta.json: load_data either works (and the
    meta it returns passes every check) or ends in one UserError line."""
    root, meta = tiny_data
    damaged = copy.deepcopy(meta)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p, _ in json_paths(damaged) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = damaged
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON_VALUES)
    (root / 'meta.json').write_text(json.dumps(damaged))
    try:
        for boundary in ('unigram', 'whitespace'):
            try:
                got = dataset.load_data(root, boundary)[0]
            except UserError as e:
                assert '\n' not in str(e), str(e)
            else:
                assert dataset.meta_problem(got) is None
    finally:
        (root / 'meta.json').write_text(json.dumps(meta))


@pytest.mark.parametrize('n_bytes', [0, 1])
def test_a_split_of_under_two_tokens_is_refused(tmp_path, n_bytes):
    """An empty valid split, or one of a single token (nothing to evaluate): one line naming it."""
    root, meta = make_dataset(tmp_path / 'd')
    (root / 'valid.bin').write_bytes(b'\x01' * n_bytes)
    sizes = dict(meta['sizes'], valid=n_bytes)
    (root / 'meta.json').write_text(json.dumps(dict(meta, sizes=sizes)))
    with pytest.raises(UserError, match=r'valid\.bin is empty or holds one item; remake'):
        dataset.load_data(root, 'fixed')


# ----------------------------------------------------------------------- what train.py says
def train_main(argv, capsys):
    """train.py's main in-process → (exit code, its one stderr line)."""
    import train
    code = train.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), err
    return code, err[0]


def test_missing_data_names_the_download_and_the_offline_way(tmp_path, capsys, monkeypatch):
    """`python train.py --boundary entropy` with no data: the message names both the
    download and the way without network (--input FILE)."""
    monkeypatch.chdir(tmp_path)
    code, line = train_main(['--boundary', 'entropy', '--device', 'cpu'], capsys)
    assert code == 1 and line.endswith(
        'no dataset at data/text8 (make it with: python prepare_data.py --dataset text8; '
        'without network: python prepare_data.py --input FILE --dataset text8)'), line


def test_train_refuses_splits_by_the_shared_rule(tmp_path, capsys):
    """A train split shorter than one batch: train.py refuses it in the words of
    dataset.split_problem, the rule prepare_data.py also refuses by."""
    root, meta = make_dataset(tmp_path / 'd', unigram=())
    argv = ['--data', root, '--boundary', 'fixed', '--device', 'cpu', '--out', tmp_path / 'o',
            '--batch-size', '4', '--seq-len', '75', '--d-model', '32', '--n-head', '2',
            '--d-head', '16', '--d-inner', '64', '--layers', '1,1,1']
    code, line = train_main(argv, capsys)
    # 300 tokens: 4 x 75 would fit, but each sequence needs one more token (the last target)
    assert code == 1 and line == f'error: {root}: {dataset.split_problem(meta["sizes"], 4, 75)}'
    assert 'train 300 tokens: too few for a run of batch 4 x 76' in line
    assert dataset.split_problem(meta['sizes'], 2, 80) is None
    assert 'valid 1 tokens' in dataset.split_problem(dict(meta['sizes'], valid=1))
