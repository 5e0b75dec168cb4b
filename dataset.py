"""A dataset written by prepare_data.py, checked once where it is read (meta.json,
memmapped splits, Unigram labels); what cannot be used is one UserError line naming the
file and how to remake it.
    meta, splits, labels = load_data('data/text8', 'unigram')  # {split: uint8/16 [N]}"""
import hashlib
import itertools
import json
import math
import shlex
from pathlib import Path

import numpy as np

from cleaning import LANGS
from common import UserError

SPLITS = ('train', 'valid', 'test')


# the sources prepare_data.py downloads, and its encodings
DATASETS = ('text8', 'enwik8', 'wiki40b', 'cc100')
ENCODINGS = ('paper', 'chars', 'bytes')
# the caps of a download not told otherwise: the splits the paper's studies read
CAPS = dict(max_train_chars=400_000_000, max_eval_chars=2_000_000)
# the sources that are one file (English), and its size whole: text8's characters, enwik8's bytes
WHOLE_FILES = ('text8', 'enwik8')
WHOLE = 100_000_000


def default_name(dataset, lang, encoding):
    """The folder prepare_data.py makes without --name: the source (input: text of one's own),
    -<lang> but for text8 and enwik8, -bytes or -chars but for enwik8 (always bytes)."""
    name = dataset
    if lang and dataset not in WHOLE_FILES:
        name += f'-{lang}'
    if encoding != 'paper' and dataset != 'enwik8':
        name += f'-{encoding}'
    return name


def recorded_settings(d):
    """The settings dataset directory d was made with (meta.json's "settings", else those of
    its splits in .splits.json), or None where neither is readable and whole."""
    for file, key in (('meta.json', 'settings'), ('.splits.json', 'key')):
        path = Path(d) / file
        try:
            if not path.is_file():   # (a FIFO would hang the read)
                continue
            s = json.loads(path.read_bytes())[key]
            ok = s['dataset'] in (*DATASETS, 'input') and s['lang'] in (None, *LANGS)
            ok = ok and s['encoding'] in ENCODINGS
            ok = ok and all(type(s[k]) is int for k in CAPS) and type(s.get('unigram', 0)) is int
            if ok and all(isinstance(p, str) for p in s['input'] or []):
                return s
        except (OSError, ValueError, RecursionError, TypeError, KeyError):
            pass
    return None


def _named(name):
    """The settings whose default name is `name` (default_name run backwards), else those of
    one's own text (--input FILE --lang LANG)."""
    for dataset, lang, encoding in itertools.product((*DATASETS, 'input'), (None, *LANGS),
                                                     ENCODINGS):
        # a language is needed but by text8, enwik8 and one's own text in bytes or as it is
        known = lang or dataset in WHOLE_FILES or (dataset == 'input' and encoding != 'paper')
        if default_name(dataset, lang, encoding) == name and known:
            return dict(dataset=dataset, lang=lang, encoding=encoding, **CAPS,
                        input=['FILE'] if dataset == 'input' else None)
    return dict(dataset='input', lang='LANG', encoding='paper', input=['FILE'])


def prepare_command(*words, data=None, settings=None):
    """`python prepare_data.py` and words, quoted for a POSIX shell: every
    prepare_data.py command the project suggests is built here. data: a dataset
    directory, made with `settings` (default: those recorded, recorded_settings; else
    those its name says, _named) first."""
    flags = []
    if data is not None:
        data = Path(data)
        s = settings or recorded_settings(data) or _named(data.name)
        if '--unigram' in words:
            s = dict(s, unigram=None)
        if s['input']:
            flags += ['--input', *s['input']]
        if s['dataset'] != 'input':
            flags += ['--dataset', s['dataset']]
        if s['lang'] and s['dataset'] not in WHOLE_FILES:
            flags += ['--lang', s['lang']]
        if s['encoding'] != 'paper' and s['dataset'] != 'enwik8':
            flags.append(f'--{s["encoding"]}')
        for cap, default in CAPS.items():
            if s.get(cap, default) != default:
                flags += [f'--{cap.replace("_", "-")}', s[cap]]
        V = s.get('unigram')
        if V is not None and V != LANGS.get(s['lang'], {}).get('unigram', 0):
            flags += ['--unigram', V]
        if data.name != default_name(s['dataset'], s['lang'], s['encoding']):
            flags += ['--name', data.name]
        if data.parent != Path('data'):
            flags += ['--out-dir', data.parent]
    return shlex.join(['python', 'prepare_data.py', *map(str, flags + list(words))])


def unit(meta):
    """What a token is: 'byte' for raw UTF-8 bytes, else 'char' (meta.json, or a
    checkpoint's vocab dict: the same keys)."""
    if meta.get('encoding') == 'bytes':
        return 'byte'
    return 'char'


# The bits per token each unit names: bits per character where the data is characters,
# bits per byte where it is bytes (the key of train.py's records and lines, report.py's
# columns; never both in one run)
BITS = {'char': 'bpc', 'byte': 'bpb'}


def is_number(v):
    """A finite int or float >= 0 (a bool is not a number here)."""
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _label_set(u):
    """A Unigram label set: a dict with an integer vocab_size."""
    return isinstance(u, dict) and type(u.get('vocab_size')) is int


def _rules(m):
    """meta.json's fields in the order they are checked, each (name, whether m holds it
    as it must, what it must be); a rule reads only fields checked before it."""
    yield 'encoding', m.get('encoding', 'paper') in ENCODINGS, \
        '"paper" (the default), "chars" or "bytes"'
    dtype = m.get('dtype')
    yield 'dtype', dtype in ('uint8', 'uint16'), '"uint8" or "uint16"'
    n = m.get('vocab_size')
    # ids from 0 to 255 in a byte, to 65,535 in two
    ok = type(n) is int and 1 <= n <= 256 ** np.dtype(dtype).itemsize
    yield 'vocab_size', ok, 'a count of characters that fits dtype'
    chars = m.get('alphabet')
    ok = isinstance(chars, list) and len(chars) == n
    ok = ok and all(isinstance(c, str) and len(c) == 1 for c in chars) and len(set(chars)) == n
    yield 'alphabet', ok, 'vocab_size distinct single characters'
    space = m.get('space_id')
    ok = space is None or (type(space) is int and 0 <= space < n and chars[space] == ' ')
    yield 'space_id', ok, "null or the space's id in the alphabet"
    sizes = m.get('sizes', {})
    ok = isinstance(sizes, dict) and all(type(v) is int and v >= 0 for v in sizes.values())
    yield 'sizes', ok, '{split: chars}'
    defaults = m.get('defaults', {})
    ok = isinstance(defaults, dict) and all(is_number(v) for v in defaults.values())
    ok = ok and 0 < defaults.get('prior', 0.5) < 1 and type(defaults.get('unigram', 0)) is int
    yield 'defaults', ok, 'numbers per flag (an integer "unigram", a "prior" in (0, 1))'
    sets = m.get('unigram_sets')
    ok = sets is None
    if isinstance(sets, dict):
        ok = all(_label_set(u) and str(u['vocab_size']) == k for k, u in sets.items())
    yield 'unigram_sets', ok, '{"<V>": label set of vocab_size V} or null'
    u = m.get('unigram')
    ok = u is None or (_label_set(u) and (sets is None or str(u['vocab_size']) in sets))
    yield 'unigram', ok, 'null or a label set (of "unigram_sets", where there are several)'


def meta_problem(meta):
    """What is wrong with a meta.json dict, in words, or None."""
    if not isinstance(meta, dict):
        return f'holds {meta!r:.60}, not an object'
    for name, ok, rule in _rules(meta):
        if name not in meta and name in ('dtype', 'vocab_size', 'alphabet'):
            return f'"{name}" is missing'
        if not ok:
            return f'"{name}" is {meta.get(name)!r:.60}, expected {rule}'
    return None


def read_meta(d):
    """meta.json of dataset directory d, every field checked: one UserError line
    otherwise."""
    path = Path(d) / 'meta.json'
    remake = f'remake it with: {prepare_command("--force", data=d)}'
    if not path.is_file():  # (a probe: a FIFO named meta.json would hang the read)
        make = prepare_command(data=d)
        s = recorded_settings(d) or _named(Path(d).name)
        offline = prepare_command(data=d, settings=dict(s, input=['FILE']))
        if offline != make:
            make += f'; without network: {offline}'
        raise UserError(f'no dataset at {d} (make it with: {make})')
    try:
        meta = json.loads(path.read_bytes().decode('utf-8'))
    except (ValueError, RecursionError) as e:
        raise UserError(f'{path} is unreadable ({str(e)[:60]}); {remake}') from None
    if why := meta_problem(meta):
        raise UserError(f'{path}: {why}; {remake}')
    return meta


def open_ids(path, dtype, n, limit, what, remake):
    """A split's ids (or labels) memmapped, checked: n items (None: any), every value <
    limit."""
    size = path.stat().st_size   # (missing: common.main says so)
    item = np.dtype(dtype).itemsize
    if size < 2 * item:   # (a split of one token: nothing to predict or evaluate)
        raise UserError(f'{path} is empty or holds one item; {remake}')
    if size % item or (n is not None and size != n * item):
        raise UserError(f'{path} holds {size} bytes, not {n or "whole"} {what} as {dtype} (a '
                        f'cut-off copy, or {what} from another dataset?); {remake}')
    ids = np.memmap(path, dtype=dtype, mode='r')
    if (top := int(ids.max())) >= limit:
        raise UserError(f'{path} holds the value {top}, outside [0, {limit}) for {what} (a file '
                        f'from another dataset?); {remake}')
    return ids


def load_data(data_dir, boundary, unigram=None):
    """(meta, {split: ids}, {split: Unigram labels} or None); unigram: the set's
    vocab_size."""
    d = Path(data_dir)
    meta = read_meta(d)
    remake = f'remake the dataset with: {prepare_command(data=d)}'
    splits = {s: open_ids(d / f'{s}.bin', meta['dtype'], meta.get('sizes', {}).get(s),
                          meta['vocab_size'], 'token ids', remake) for s in SPLITS}
    if boundary == 'whitespace' and meta.get('space_id') is None:
        raise UserError(f'--boundary whitespace needs a space character, and {d} has none')
    if boundary != 'unigram':
        return meta, splits, None
    # labels: 1 where a SentencePiece Unigram piece ends, aligned with the split's
    # characters; the set of size `unigram`, else meta.json's default "unigram"
    u = meta.get('unigram')
    sets = meta.get('unigram_sets') or {}
    if unigram and not (u and u['vocab_size'] == unigram):
        u = sets.get(str(unigram))
    if u is None:
        have = sorted(map(int, sets))
        V = unigram or (have or [10000])[-1]
        raise UserError(f'--boundary unigram needs Unigram labels in {d} (it has sizes {have}; '
                        f"make them with: {prepare_command('--unigram', V, data=d)})")
    labels = {s: open_ids(d / f'{s}.unigram-{u["vocab_size"]}.bin', 'uint8', len(splits[s]), 2,
                          'Unigram labels', remake) for s in SPLITS}
    return meta, splits, labels


def split_problem(sizes, batch_size=1, seq_len=1):
    """Why splits of these sizes ({split: tokens}) are too small for a run of batch_size
    sequences of seq_len (the smallest run: 1 x 1): train needs one batch of seq_len + 1
    tokens, valid and test a token to predict after one; or None."""
    need = dict(train=batch_size * (seq_len + 1), valid=2, test=2)
    short = [f'{s} {sizes[s]:,}' for s in SPLITS if sizes[s] < need[s]]
    if not short:
        return None
    return (f'{", ".join(short)} tokens: too few for a run of batch {batch_size} x '
            f'{seq_len + 1} (train), 2 tokens each to evaluate (valid, test)')


def paper_data_problem(path):
    """None where path/meta.json records a whole dataset of the paper (text8 or enwik8 whole,
    wiki40b-<lang> or cc100-<lang> downloaded at the default caps); else why not, in one line
    naming the command that makes the whole one."""
    d = Path(path)
    try:
        meta = read_meta(d)
    except (UserError, OSError) as e:
        return str(e)
    extent = meta.get('extent')
    if not isinstance(extent, dict):
        extent = {'what': 'of unknown extent (made by an older prepare_data.py)'}
    if extent.get('whole') is True:
        return None
    s = recorded_settings(d) or {}
    what = f"{d} is {extent.get('what')}"
    if s.get('dataset') in DATASETS:
        paper = dict(s, input=None, unigram=None, **CAPS)
        return f"{what}; the paper's {s['dataset']} is: {prepare_command(data=d, settings=paper)}"
    return f"{what}, not a dataset of the paper (made by {prepare_command()}, or " \
           f"{prepare_command('--lang', 'LANG')})"


def dataset_defaults(data_dir, names):
    """meta.json's "defaults" of the flags in names (the Gumbel prior 0.37 for Finnish),
    or {}."""
    try:
        return {k: v for k, v in read_meta(data_dir).get('defaults', {}).items() if k in names}
    except (UserError, OSError):
        return {}


def fingerprint(splits):
    """The data's identity for --resume, cheap: SHA-256 of split sizes, train's
    first/last MiB."""
    sizes = json.dumps({s: len(v) for s, v in splits.items()}, sort_keys=True)
    h = hashlib.sha256(sizes.encode())
    train = splits['train']
    n = (1 << 20) // train.itemsize   # a MiB of ids
    h.update(train[:n].tobytes())
    h.update(train[-n:].tobytes())
    return h.hexdigest()[:16]
