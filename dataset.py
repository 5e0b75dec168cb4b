"""A dataset written by prepare_data.py, checked once where it is read (meta.json, memmapped splits,
Unigram labels); what cannot be used is one UserError line naming the file and how to remake it.
    meta, splits, labels = load_data('data/text8', 'unigram')  # {split: uint8/16 [N]}"""
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from common import UserError

SPLITS = ('train', 'valid', 'test')


def prepare_command(d):
    """The prepare_data.py command that writes dataset directory d."""
    name, _, lang = d.name.partition('-')
    how = ('' if d.name == 'text8' else f' --dataset {name} --lang {lang}' if lang and name in (
        'wiki40b', 'cc100') else f' --input FILE --lang LANG --name {d.name}')
    return f'python prepare_data.py{how}' + ('' if d.parent == Path('data') else
                                              f' --out-dir {d.parent}')


def is_number(v, lo=0.0):
    """A finite int or float >= lo (a bool is not a number here)."""
    return type(v) in (int, float) and math.isfinite(v) and v >= lo


def _label_set(u):
    """A Unigram label set: vocab_size, label files (plain names: no way out of the folder), SFs."""
    labels = u.get('labels', {}) if isinstance(u, dict) else None
    sfs = u.get('shortening_factor', {}) if isinstance(u, dict) else None
    return (isinstance(labels, dict) and isinstance(sfs, dict) and type(u.get('vocab_size')) is int
            and u['vocab_size'] >= 1 and all(v is None or is_number(v) for v in sfs.values())
            and all(isinstance(f, str) and f not in ('', '.', '..') and not set('/\\\0') & set(f)
                    for f in labels.values()))


# meta.json's (field, rule(value, meta), what it must be), in order: a rule may read earlier fields
META_RULES = (
    ('dtype', lambda v, m: v in ('uint8', 'uint16'), '"uint8" or "uint16"'),
    ('vocab_size', lambda v, m: type(v) is int and 1 <= v <= 256 ** np.dtype(
        m.get('dtype', 'uint16')).itemsize, 'a count of characters that fits dtype'),
    ('alphabet', lambda v, m: isinstance(v, (list, tuple)) and len(v) == m['vocab_size']
     and all(isinstance(c, str) and len(c) == 1 for c in v) and len(set(v)) == len(v),
     'vocab_size distinct single characters'),
    ('space_id', lambda v, m: v is None or type(v) is int and 0 <= v < len(m['alphabet'])
     and m['alphabet'][v] == ' ', "null or the space's id in the alphabet"),
    ('sizes', lambda v, m: isinstance(v, dict) and all(type(n) is int and n >= 0
                                                       for n in v.values()), '{split: chars}'),
    ('defaults', lambda v, m: isinstance(v, dict) and all(is_number(x) for x in v.values())
     and 0 < v.get('prior', 0.5) < 1 and type(v.get('unigram', 0)) is int,
     'numbers per flag (an integer "unigram", a "prior" in (0, 1))'),
    ('unigram_sets', lambda v, m: v is None or isinstance(v, dict) and all(
        _label_set(u) and str(u['vocab_size']) == k for k, u in v.items()),
     '{"<V>": label set of vocab_size V} or null'),
    ('unigram', lambda v, m: v is None or _label_set(v) and (
        m.get('unigram_sets') is None or str(v['vocab_size']) in m['unigram_sets']),
     'null or a label set (of "unigram_sets", where there are several)'),
)
OPTIONAL = dict(space_id=None, sizes={}, defaults={}, unigram=None, unigram_sets=None)


def meta_problem(meta, fields=None):
    """What is wrong with a meta.json dict (only `fields`, where given), in words, or None."""
    if not isinstance(meta, dict):
        return f'holds {meta!r:.60}, not an object'
    for name, ok, rule in META_RULES:
        if fields is not None and name not in fields:
            continue
        if name not in meta and name not in OPTIONAL:
            return f'"{name}" is missing'
        if not ok(meta.get(name, OPTIONAL.get(name)), meta):
            return f'"{name}" is {meta.get(name)!r:.60}, expected {rule}'
    return None


def read_meta(d):
    """meta.json of dataset directory d, every field checked: one UserError line otherwise."""
    path, remake = Path(d) / 'meta.json', f'remake it with: {prepare_command(Path(d))}'
    if not path.is_file():  # (a probe: a FIFO named meta.json would hang the read)
        raise UserError(f'no dataset at {d} (make it with: {prepare_command(Path(d))})')
    try:
        meta = json.loads(path.read_bytes().decode('utf-8'))
    except (ValueError, RecursionError) as e:
        raise UserError(f'{path} is unreadable ({str(e)[:60]}); {remake}') from None
    if why := meta_problem(meta):
        raise UserError(f'{path}: {why}; {remake}')
    return meta


def open_ids(path, dtype, n, limit, what, remake):
    """A split's ids (or labels) memmapped, checked: n items (None: any), every value < limit."""
    size, item = path.stat().st_size, np.dtype(dtype).itemsize  # (missing: common.main says so)
    if size == 0:
        raise UserError(f'{path} is empty; {remake}')
    if size % item or n is not None and size != n * item:
        raise UserError(f'{path} holds {size} bytes, not {n or "whole"} {what} as {dtype} (a '
                        f'cut-off copy, or {what} from another dataset?); {remake}')
    ids = np.memmap(path, dtype=dtype, mode='r')
    if (top := int(ids.max())) >= limit:
        raise UserError(f'{path} holds the value {top}, outside [0, {limit}) for {what} (a file '
                        f'from another dataset?); {remake}')
    return ids


def label_set(meta, vocab_size=None):
    """The Unigram label set of vocab_size (None: meta.json's default "unigram"), or None."""
    default = meta.get('unigram')
    if vocab_size is None or default and default['vocab_size'] == vocab_size:
        return default  # (a dataset from before "unigram_sets" has only this one)
    return (meta.get('unigram_sets') or {}).get(str(vocab_size))


def load_data(data_dir, boundary, unigram=None):
    """(meta, {split: ids}, {split: Unigram labels} or None); unigram: the set's vocab_size."""
    d = Path(data_dir)
    meta = read_meta(d)
    remake = f'remake the dataset with: {prepare_command(d)}'
    splits = {s: open_ids(d / f'{s}.bin', meta['dtype'], meta.get('sizes', {}).get(s),
                          meta['vocab_size'], 'token ids', remake) for s in SPLITS}
    if short := [s for s in ('valid', 'test') if len(splits[s]) < 2]:
        raise UserError(f'{d / short[0]}.bin holds 1 character: nothing to evaluate; {remake}')
    if boundary == 'whitespace' and meta.get('space_id') is None:
        raise UserError(f'--boundary whitespace needs a space character, and {d} has none')
    if boundary != 'unigram':
        return meta, splits, None
    # labels: 1 where a SentencePiece Unigram piece ends, aligned with the split's characters
    if (u := label_set(meta, unigram)) is None:
        have = sorted(int(v) for v in meta.get('unigram_sets') or {})
        V = unigram or (have or [10000])[-1]
        raise UserError(f'--boundary unigram needs Unigram labels in {d} (it has sizes {have}; '
                        f'make them with: {prepare_command(d)} --unigram {V})')
    names = u.get('labels') or {}
    labels = {s: open_ids(d / names.get(s, f'{s}.unigram-{u["vocab_size"]}.bin'), 'uint8',
                          len(splits[s]), 2, 'Unigram labels', remake) for s in SPLITS}
    return meta, splits, labels


def dataset_defaults(data_dir, names):
    """meta.json's "defaults" of the flags in names (the Gumbel prior 0.37 for Finnish), or {}."""
    try:
        return {k: v for k, v in read_meta(data_dir).get('defaults', {}).items() if k in names}
    except (UserError, OSError):
        return {}


def fingerprint(splits):
    """The data's identity for --resume, cheap: SHA-256 of split sizes, train's first/last MiB."""
    t, h = splits['train'], hashlib.sha256(json.dumps({s: len(v) for s, v in splits.items()},
                                                       sort_keys=True).encode())
    for part in (t[:(1 << 20) // t.itemsize], t[-((1 << 20) // t.itemsize):]):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()[:16]
