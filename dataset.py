"""A dataset written by prepare_data.py, checked once where it is read (meta.json, memmapped splits,
Unigram labels): what cannot be used is one UserError line naming the file and the command that
remakes it.   meta, splits, labels = load_data('data/text8', 'unigram')  # {split: uint8/16 [N]}
"""
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


def _file_name(v):
    """A plain file name inside the dataset directory (no folder, no way out of it)."""
    return isinstance(v, str) and v not in ('', '.', '..') and not set('/\\\0') & set(v)


def _id_of(char):
    """Rule: null or the id of `char` in the alphabet."""
    return lambda v, m: v is None or type(v) is int and 0 <= v < len(m['alphabet']) \
        and m['alphabet'][v] == char


def _label_set(u):
    """One Unigram label set of meta.json: its vocab_size, label files, model, SFs, settings."""
    return (isinstance(u, dict) and type(u.get('vocab_size')) is int and u['vocab_size'] >= 1
            and isinstance(u.get('labels', {}), dict)
            and all(isinstance(s, str) and _file_name(f) for s, f in u.get('labels', {}).items())
            and (u.get('model') is None or _file_name(u['model']))
            and isinstance(u.get('shortening_factor', {}), dict)
            and all(v is None or is_number(v) for v in u.get('shortening_factor', {}).values())
            and isinstance(u.get('settings'), (dict, type(None))))


_MISSING = object()
# meta.json's fields, checked in this order (a rule may rely on the fields before it): (field,
# rule(value, meta), what it must be). Fields a dataset may lack take the default in OPTIONAL.
META_RULES = (
    ('dtype', lambda v, m: v in ('uint8', 'uint16'), '"uint8" or "uint16"'),
    ('vocab_size', lambda v, m: type(v) is int and 1 <= v <= 256 ** np.dtype(
        m.get('dtype', 'uint16')).itemsize, 'a count of characters that fits dtype'),
    ('alphabet', lambda v, m: isinstance(v, (list, tuple)) and len(v) == m['vocab_size']
     and all(isinstance(c, str) and len(c) == 1 for c in v) and len(set(v)) == len(v),
     'vocab_size distinct single characters'),
    ('space_id', _id_of(' '), "null or the space's id in the alphabet"),
    ('newline_id', _id_of('\n'), "null or the newline's id in the alphabet"),
    ('sizes', lambda v, m: isinstance(v, dict) and all(type(n) is int and n >= 0
                                                       for n in v.values()), '{split: chars}'),
    ('mean_word_length', lambda v, m: v is None or is_number(v) and v > 0,
     'a positive number or null'),
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
OPTIONAL = dict(space_id=None, newline_id=None, sizes={}, mean_word_length=None, defaults={},
                unigram=None, unigram_sets=None)


def meta_problem(meta, fields=None):
    """What is wrong with a meta.json dict (only `fields`, where given), in words; None if
    nothing. The checkpoint reader checks its vocabulary with the same rules."""
    if not isinstance(meta, dict):
        return f'holds {_clip(meta)}, not an object'
    for name, ok, rule in META_RULES:
        v = meta.get(name, OPTIONAL.get(name, _MISSING))
        if (fields is None or name in fields) and (v is _MISSING or not ok(v, meta)):
            return f'"{name}" is missing' if v is _MISSING else \
                f'"{name}" is {_clip(v)}, expected {rule}'
    return None


def _clip(v, n=60):
    """A JSON value in a message, cut to n characters."""
    text = json.dumps(v, ensure_ascii=False, default=repr)
    return text if len(text) <= n else text[:n - 3] + '...'


def read_meta(d):
    """meta.json of dataset directory d, every field checked: one UserError line otherwise."""
    path, remake = Path(d) / 'meta.json', f'remake it with: {prepare_command(Path(d))}'
    if not path.is_file():  # (a probe: a FIFO named meta.json would hang the read)
        raise UserError(f'no dataset at {d} (make it with: {prepare_command(Path(d))})')
    try:
        meta = json.loads(path.read_bytes().decode('utf-8'))
    except (ValueError, RecursionError) as e:
        raise UserError(f'{path} is unreadable ({_clip(str(e))}); {remake}') from None
    why = meta_problem(meta)
    if why:
        raise UserError(f'{path}: {why}; {remake}')
    return meta


def open_ids(path, dtype, n, limit, what, remake):
    """A split's token ids (or labels), memmapped and checked once: the size meta.json gives (n
    items, or any where None), every value below `limit` (one pass over the file)."""
    size, item = path.stat().st_size, np.dtype(dtype).itemsize  # (missing: common.main says so)
    if size == 0:
        raise UserError(f'{path} is empty; {remake}')
    if size % item or n is not None and size != n * item:
        raise UserError(f'{path} holds {size} bytes, not {n or "whole"} {what} as {dtype} (a '
                        f'cut-off copy, or {what} from another dataset?); {remake}')
    ids = np.memmap(path, dtype=dtype, mode='r')
    top = int(ids.max())
    if top >= limit:
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
    """(meta, {split: token ids}, {split: Unigram labels} or None), all checked once at load;
    unigram: the vocab_size of the label set to train on (None: meta.json's default set)."""
    d = Path(data_dir)
    meta = read_meta(d)
    remake = f'remake the dataset with: {prepare_command(d)}'
    splits = {s: open_ids(d / f'{s}.bin', meta['dtype'], meta.get('sizes', {}).get(s),
                          meta['vocab_size'], 'token ids', remake) for s in SPLITS}
    for s in ('valid', 'test'):
        if len(splits[s]) < 2:
            raise UserError(f'{d / f"{s}.bin"} holds 1 character: nothing to evaluate; {remake}')
    if boundary == 'whitespace' and meta.get('space_id') is None:
        raise UserError(f'--boundary whitespace needs a space character, and {d} has none')
    if boundary != 'unigram':
        return meta, splits, None
    # labels: 1 where a SentencePiece Unigram piece ends, aligned with the split's characters
    u = label_set(meta, unigram)
    if u is None:
        have = sorted(int(v) for v in meta.get('unigram_sets') or {})
        has = f'; it has unigram-{", unigram-".join(map(str, have))}' if have else ''
        raise UserError(f'--boundary unigram needs Unigram labels in {d}{has} (make them with: '
                        f'{prepare_command(d)} --unigram {unigram or (have or [10000])[-1]})')
    names = u.get('labels') or {}
    labels = {s: open_ids(d / names.get(s, f'{s}.unigram-{u["vocab_size"]}.bin'), 'uint8',
                          len(splits[s]), 2, 'Unigram labels', remake) for s in SPLITS}
    return meta, splits, labels


def dataset_defaults(data_dir, names):
    """meta.json's per-language defaults ("defaults", e.g. the Gumbel prior 0.37 for Finnish) of
    the flags in names; {} where there are none (a broken dataset is reported at load)."""
    try:
        return {k: v for k, v in read_meta(data_dir).get('defaults', {}).items() if k in names}
    except (UserError, OSError):
        return {}


def fingerprint(splits):
    """What a checkpoint records of its data, cheap to recompute at --resume: the splits' sizes
    and the SHA-256 of the train split's first and last MiB, in hex (16 digits)."""
    t, h = splits['train'], hashlib.sha256(json.dumps({s: len(v) for s, v in splits.items()},
                                                       sort_keys=True).encode())
    n = (1 << 20) // t.itemsize
    h.update(np.ascontiguousarray(t[:n]).tobytes())
    h.update(np.ascontiguousarray(t[-n:]).tobytes())
    return h.hexdigest()[:16]
