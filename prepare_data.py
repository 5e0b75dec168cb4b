"""Download, clean, split and encode character-level LM data for dynpool (docs/data.md tells all).

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --name he-small --unigram 1000               # more labels, same splits

data/<name>/: {train,valid,test}.bin, meta.json, Unigram labels, .splits.json (what made the splits:
the same options and input again skip them, others remake them); docs/data.md has the layout."""
import argparse
import codecs
import hashlib
import http.client
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm   # (comes with huggingface_hub): progress where stderr is a terminal

import common
import dataset
from cleaning import LANGS, TEXT8_ALPHABET, clean
from common import UserError

SPLITS = ('train', 'valid', 'test')
CHUNK = 1 << 22          # characters of raw text cleaned at a time
WIKI40B = 'google/wiki40b'
DEFAULTS = dict(max_train_chars=400_000_000, max_eval_chars=2_000_000, fold_accents=False)
AGENT = {'User-Agent': 'dynpool-prepare-data'}


class DownloadError(UserError):   # run() adds the command that works without network
    pass


def _retrying(what, fn, retries, backoff):
    """fn(), tried again after a network error while tries are left (waiting backoff * 2^try s);
    not where waiting cannot help: an unknown host, a refused connection, offline, HTTP 4xx."""
    for attempt in itertools.count():
        try:
            return fn()
        except Exception as e:
            if not isinstance(e, (urllib.error.URLError, http.client.HTTPException,
                                  ConnectionError, TimeoutError)) and not type(
                    e).__module__.startswith(('huggingface_hub', 'httpx')):
                raise
            reason, code = getattr(e, 'reason', None), getattr(e, 'code', None) or getattr(
                getattr(e, 'response', None), 'status_code', None)
            said = getattr(reason, 'strerror', None) or common.first_line(e)   # HTTP Error 404...
            if attempt >= retries or isinstance(reason, (socket.gaierror, ConnectionRefusedError))\
                    or type(e).__name__ == 'OfflineModeIsEnabled' or isinstance(code, int) and (
                    code < 500 and code not in (408, 429)):
                raise DownloadError(f'{what}: {said}') from None
            print(f'{what}: {said}; retry {attempt + 1}/{retries}', file=sys.stderr)
            time.sleep(backoff * 2 ** attempt)


def download(url, dest, retries=5, backoff=2.0):
    """url → dest through dest.part, resumed after a cut (in this run or an earlier one) by a Range
    request with If-Range: the file's version (strong ETag or Last-Modified) in dest.part.json. A
    file that changed or has no version, or a server that ignores Range, starts from zero."""
    dest = Path(dest)
    part, info = (dest.with_name(dest.name + x) for x in ('.part', '.part.json'))

    def fetch():
        try:
            seen = json.loads(info.read_text())
            have = part.stat().st_size if seen['validator'] and seen['total'] else 0
        except (OSError, ValueError, TypeError, KeyError):
            have = 0
        if have and have == seen['total']:   # complete, but not renamed yet
            return
        request = urllib.request.Request(url, headers={**AGENT, **(
            {'Range': f'bytes={have}-', 'If-Range': seen['validator']} if have else {})})
        with urllib.request.urlopen(request, timeout=60) as resp, open(
                part, 'ab' if have else 'wb') as f:
            if resp.status != 206:   # the whole file: it (and its version) from the start
                if have:
                    print(f'{url}: the file changed on the server, or the server ignores Range: '
                          'downloading it from the start', file=sys.stderr)
                    f.seek(0)
                    f.truncate()
                etag, n = resp.headers.get('ETag') or '', resp.headers['Content-Length'] or ''
                seen = {'validator': resp.headers['Last-Modified'] if etag[:2] in ('', 'W/')
                        else etag, 'total': int(n) if n.isdigit() else None}
                common.write_atomic(info, json.dumps(seen))
            with tqdm.wrapattr(resp, 'read', total=seen['total'], initial=f.tell(), disable=None,
                               leave=False, desc=dest.name) as r:
                shutil.copyfileobj(r, f, 1 << 20)
            if seen['total'] and f.tell() < seen['total']:   # a cut: the retry resumes it
                raise http.client.IncompleteRead(b'', seen['total'] - f.tell())

    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        print(f'download {url} -> {dest}')
        _retrying(url, fetch, retries, backoff)
        os.replace(part, dest)
        info.unlink(missing_ok=True)
    return dest


def text_pieces(blocks, label):
    """UTF-8 byte blocks → (text, separator) pieces of about CHUNK characters, cut at line ends
    (a giant line at a space). A NUL byte means binary: refused (file_pieces refuses non-UTF-8)."""
    dec, buf, total = codecs.getincrementaldecoder('utf-8')(), '', 0
    for raw in itertools.chain(blocks, [None]):
        if raw and raw.find(0) >= 0:
            raise UserError(f'{label} looks binary (NUL byte at offset {total + raw.find(0)}); '
                            'expected UTF-8 text (UTF-16 files must be converted first)')
        buf, total = buf + dec.decode(raw or b'', final=raw is None), total + len(raw or b'')
        cut = buf.rfind('\n')
        if cut >= 0:
            yield buf[:cut], '\n'
            buf = buf[cut + 1:]
        elif len(buf) > CHUNK:  # a giant line: cut at a space, or anywhere as a last resort
            cut = buf.rfind(' ')
            yield (buf[:cut], ' ') if cut >= 0 else (buf, '')
            buf = buf[cut + 1:] if cut >= 0 else ''
    if buf:
        yield buf, ''


def file_pieces(path, downloaded=False, stream=None):
    """(text, separator) pieces of a .txt/.zip/.xz/.parquet file, or of `stream` named
    `path` (cc-100's response). A corrupt download is removed, so that a re-run fetches it."""
    import lzma
    import zipfile
    label, path, suffix = str(path), Path(path), Path(path).suffix.lower()
    try:
        if suffix == '.parquet':
            import pyarrow.parquet as pq
            for batch in pq.ParquetFile(path).iter_batches(columns=['text'], batch_size=256):
                yield from ((t, '\n') for t in batch.column(0).to_pylist() if t)
        elif suffix == '.zip':
            with zipfile.ZipFile(path) as z:
                for m in sorted(n for n in z.namelist() if not n.endswith('/')):
                    with z.open(m) as fb:
                        yield from text_pieces(iter(lambda: fb.read(CHUNK), b''), f'{label}:{m}')
        else:
            with (lzma.open if suffix == '.xz' else open)(stream or path, 'rb') as fb:
                yield from text_pieces(iter(lambda: fb.read(CHUNK), b''), label)
    except Exception as e:   # bad data or a cut stream; the OS's own errors, UserErrors pass on
        if getattr(e, 'errno', None) and not stream or not isinstance(e, (
                zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError, http.client.HTTPException,
                UnicodeDecodeError)) and not type(e).__module__.startswith('pyarrow'):
            raise
        if downloaded:
            Path(os.path.realpath(path)).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        raise UserError(f'{label}: corrupt, cut short or not UTF-8 text ({common.first_line(e)})'
                        + ('; re-run to fetch it again' * bool(downloaded or stream))) from None


def encode(path, pieces, alphabet, dtype, lang, cap, fold):
    """Cleans (text, separator) pieces (not text8's) and writes their token ids to path, up to `cap`
    characters; every cleaned line, the last one too, ends with a newline. Returns the count."""
    lut = np.full(0x110000, -1, dtype=np.int32)
    lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
    n, pending = 0, ''
    with open(path, 'wb') as f, tqdm(total=cap, unit='char', unit_scale=True, disable=None,
                                     leave=False, desc='cleaning' if lang else 'encoding') as bar:
        def put(text):   # → False once the cap is reached
            nonlocal n
            ids = lut[np.frombuffer(text[:None if cap is None else cap - n].encode('utf-32-le'),
                                    dtype=np.uint32)]
            if (ids < 0).any():  # only reachable without cleaning (text8)
                raise UserError(f'text8 input holds {text[int(np.argmax(ids < 0))]!r}, not in '
                                'a-z/space; use --lang en for other English text')
            f.write(ids.astype(dtype).tobytes())
            n += len(ids)
            bar.update(len(ids))
            return cap is None or n < cap
        for text, sep in pieces:
            text = clean(text, lang, fold) if lang else text
            if text:
                text, pending = pending + text if n or not lang else text, sep
                if not put(text):
                    return n
            elif not lang:
                pending += sep
            elif sep == '\n' or sep == ' ' and not pending:
                pending = sep  # the strongest separator since the last text
        if lang and n:
            put('\n')
    return n


def _ids(path, dtype):   # a .bin's token ids, memory-mapped (numpy cannot map an empty file)
    return np.memmap(path, dtype=dtype, mode='r') if os.path.getsize(path) else np.zeros(0, dtype)


def splits(args, out, alphabet, dtype, lang, key, inputs):
    """train/valid/test.bin, unless a run with these options and input made them → .splits.json."""
    path, item, stamp, done = out / '.splits.json', np.dtype(dtype).itemsize, None, False
    E, T, fold = args.max_eval_chars, args.max_train_chars, args.fold_accents
    try:
        stamp = json.loads(path.read_text())
        done = (stamp['key'], stamp['inputs']) == (key, inputs) and all(
            os.path.getsize(out / f'{s}.bin') == stamp['sizes'][s] * item for s in SPLITS)
    except (OSError, ValueError, TypeError, KeyError):
        pass   # none, unreadable or incomplete: made again
    if done and not args.force:
        print(f'splits done in {out}, skipping (--force redoes)')
        return stamp
    if stamp and not args.force:
        print(f'{out}: other options or input, or incomplete: rebuilding it', file=sys.stderr)
    for f in [out / 'meta.json', path, *out.glob('*unigram-*')]:
        f.unlink(missing_ok=True)  # outputs of an earlier run go before the new ones are made

    def by_split(groups):  # one list of (text, separator) iterators per split
        for split, cap, group in zip(SPLITS, (T, E, E), groups):
            common.write_atomic(out / f'{split}.bin', lambda tmp: encode(
                tmp, (p for it in group for p in it), alphabet, dtype, lang, cap, fold))

    def one_stream(pieces, cap, head=False):
        tmp = out / '.all.bin'   # (a fixed name: the run holds the folder's lock)
        try:
            N = encode(tmp, pieces, alphabet, dtype, lang, cap, fold)
            # text8, --input: 90% train, 5% valid, 5% test in that order; cc-100: valid and test
            # first, so that a capped stream fills them before train
            e = E if head and (N >= T + 2 * E or N >= 20 * E) else N // 20
            data, at = _ids(tmp, dtype), 0
            for split in ('valid', 'test', 'train') if head else SPLITS:
                n = N - 2 * e if split == 'train' else e
                common.write_atomic(out / f'{split}.bin', data[at:at + n].tofile)
                at += n
            del data
        finally:
            tmp.unlink(missing_ok=True)

    names = [p.name.lower().replace('dev', 'valid') for p in args.input or []]
    groups = [[p for p, n in zip(args.input or [], names) if s in n] for s in SPLITS]
    if len(names) > 1 and all(groups) and sum(map(len, groups)) == len(names):
        by_split([map(file_pieces, g) for g in groups])
        sources, rule = args.input, 'official (input files named train/valid/test)'
    elif args.input:
        one_stream((p for f in args.input for p in file_pieces(f)),
                   None if args.dataset == 'text8' else int(T / 0.9))
        sources, rule = args.input, '90% train / 5% valid / 5% test, in order'
    elif args.dataset == 'text8':
        zpath = download(args.text8_url, out / 'download' / 'text8.zip', args.retries, args.backoff)
        one_stream(file_pieces(zpath, downloaded=True), None)
        sources, rule = [args.text8_url], 'first 90M train / next 5M valid / last 5M test'
    elif args.dataset == 'wiki40b':  # through huggingface_hub: its cache, resume, HF_TOKEN, login
        import huggingface_hub as hub
        sources, rule = [], 'official wiki40b splits, capped'
        paths = _retrying(f"{args.hf_base or 'the hub'}: {WIKI40B}/{lang}", lambda: sorted(
            f.path for f in hub.HfApi(endpoint=args.hf_base).list_repo_tree(
                WIKI40B, path_in_repo=lang, repo_type='dataset') if f.path.endswith('.parquet')),
            args.retries, args.backoff)

        def shard(p):  # fetched only while the split's cap is not reached
            sources.append(f'hf://datasets/{WIKI40B}/{p}')
            return file_pieces(_retrying(p, lambda: hub.hf_hub_download(
                WIKI40B, p, repo_type='dataset', cache_dir=args.hf_cache, endpoint=args.hf_base),
                args.retries, args.backoff), downloaded=True)
        by_split([map(shard, [p for p in paths if Path(p).name.startswith(s + '-')])
                  for s in ('train', 'validation', 'test')])
    else:   # cc-100: a cut stream ends the run, and the next one starts again
        url = f'{args.cc100_base}/{lang}.txt.xz'
        with _retrying(url, lambda: urllib.request.urlopen(urllib.request.Request(
                url, headers=AGENT), timeout=60), args.retries, args.backoff) as resp:
            one_stream(file_pieces(url, stream=resp), T + 2 * E, head=True)
        sources, rule = [url], f'first {E} chars valid, next {E} test, then train (cleaned chars)'
    sizes = {s: os.path.getsize(out / f'{s}.bin') // item for s in SPLITS}
    if min(sizes.values()) == 0:
        for s in SPLITS:
            (out / f'{s}.bin').unlink()
        raise UserError(f"{', '.join(map(str, sources)) or WIKI40B}: too little text for three "
                        f'non-empty splits ({sum(sizes.values())} characters cleaned)')
    stamp = dict(key=key, inputs=inputs, sizes=sizes, source=list(map(str, sources)), rule=rule)
    common.write_atomic(path, json.dumps(stamp, ensure_ascii=False))
    return stamp


# The paper's released tokenizer settings; fitted on the word counts of the whole train split.
UNIGRAM_SETTINGS = dict(model_type='unigram', add_dummy_prefix=True, max_sentencepiece_length=16,
                        split_digits=True, split_by_whitespace=True, split_by_unicode_script=True,
                        remove_extra_whitespaces=True, normalization_rule_name='identity',
                        character_coverage=1.0)
# SentencePiece's C++ loop holds off Ctrl-C until training ends (minutes on a large split): it
# trains in a child in a session of its own, which this process kills at once on Ctrl-C.
_FIT = ('import io, json, sys, sentencepiece as spm; m = io.BytesIO(); '
        'spm.SentencePieceTrainer.train(sentence_iterator=iter(sys.stdin.buffer.read().decode()'
        '.split("\\n")), model_writer=m, **json.loads(sys.argv[1])); '
        'sys.stdout.buffer.write(m.getvalue())')


def split_words(path, alphabet, dtype, block=1 << 21):
    """A split's words ('' between two separators) by blocks: (words, closed); not closed: the
    split's last word, where no separator follows."""
    data, chars, carry = _ids(path, dtype), np.array([ord(c) for c in alphabet], '<u4'), ''
    for i in range(0, len(data), block):
        words = (carry + chars[data[i:i + block]].tobytes().decode('utf-32-le')).replace(
            '\n', ' ').split(' ')
        carry = words.pop()  # maybe cut by the block's end: it goes on in the next block
        yield words, True
    if carry:
        yield [carry], False


def word_labels(sp, words):
    """{word: in-word labels}, a byte per character: 1 at the end of every piece but the last (the
    space after the word closes it). Pieces of "▁word" (dummy prefix), the ▁ dropped."""
    words, out = list(words), {}
    for w, pieces in zip(words, sp.encode(words, out_type=str) if words else []):
        pieces = [p for p in [pieces[0].removeprefix('\u2581')] + pieces[1:] if p] if w else []
        lab = bytearray(len(w))
        for end in itertools.accumulate(len(p) for p in pieces[:-1]):
            lab[end - 1] = 1
        out[w] = bytes(lab)
    return out


def left_context_ceiling(train_words, valid_words, labels):
    """The best a causal boundary predictor can do from the word's prefix up to t: the Bayes
    decision b_t = 1 iff P(b_t = 1 | prefix) > 0.5, counted on train_words ({word: count}; 0 for a
    prefix train lacks), on valid_words: in-word label ends, decisions of 1, both, and recall."""
    total, ones, c = Counter(), Counter(), Counter()
    for w, n in train_words.items():
        for k, b in enumerate(labels[w]):
            total[w[:k + 1]] += n
            ones[w[:k + 1]] += n * b
    for w, n in valid_words.items():
        for k, b in enumerate(labels[w]):
            d = 2 * ones[w[:k + 1]] > total[w[:k + 1]]
            c.update(in_word_ends=n * b, in_word_predicted=n * d, in_word_hits=n * (d and b))
    e = c['in_word_ends']
    return {**c, 'in_word_recall': round(c['in_word_hits'] / e, 4) if e else None}


def make_unigram(args, out, meta, V, settings):
    """Fits Unigram-V on the train word counts, writes its labels (b_t = 1 where a piece ends; a
    space or newline closes the word before it), the model last → its set's meta.json entry."""
    import sentencepiece as spm
    alphabet, dtype, sizes, t0 = meta['alphabet'], meta['dtype'], meta['sizes'], time.time()
    words = {s: Counter(w for ws, _ in split_words(out / f'{s}.bin', alphabet, dtype) for w in ws
                        if w) for s in SPLITS}
    rows = [f'{w}\t{n}' for w, n in words['train'].most_common(args.unigram_max_words or None)]
    print(f'unigram-{V}: training SentencePiece on {len(rows):,} train words', file=sys.stderr)
    letters = ''.join(c for c in alphabet if c not in ' \n')
    kw = dict(UNIGRAM_SETTINGS, input_format='tsv', vocab_size=V, required_chars=letters, bos_id=-1,
              eos_id=-1, max_sentence_length=1 << 16, minloglevel=2, num_threads=4)
    child = subprocess.Popen([sys.executable, '-c', _FIT, json.dumps(kw)], start_new_session=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:   # each letter once more as a word of its own: letters the text lacks get a piece
        proto, err = child.communicate('\n'.join(rows + [f'{c}\t1' for c in letters]).encode())
    finally:
        child.kill()   # (on Ctrl-C; a child that has ended is not there to be killed)
        child.wait()
    if child.returncode:   # a size too large for the text, or too small for the alphabet: the fix
        said = (err.decode(errors='replace').strip().splitlines() or ['?'])[-1]
        fit = re.search(r'(?:set it to a value <= |required_chars\. \d+ vs )(\d+)', said)
        raise UserError(f"--unigram {V}: {said.removeprefix('RuntimeError: ')} (SentencePiece)" + (
            f"; run: {_rerun(args, '--unigram', fit[1])}; or --unigram 0 to skip Unigram "
            'boundaries' if fit else ''))
    labels = word_labels(spm.SentencePieceProcessor(model_proto=proto),
                         set().union(*words.values(), ['']))
    ones = dict.fromkeys(SPLITS, 0)
    for split in SPLITS:
        def write(tmp, s=split):
            with open(tmp, 'wb') as f:
                for ws, closed in split_words(out / f'{s}.bin', alphabet, dtype):
                    chunk = b''.join(labels[w] + b'\x01' for w in ws)   # the separator after it
                    chunk = chunk if closed else chunk[:-2] + b'\x01'   # the split's end closes it
                    ones[s] += chunk.count(1)
                    f.write(chunk)
        common.write_atomic(out / f'{split}.unigram-{V}.bin', write)
    c = left_context_ceiling(words['train'], words['valid'], labels)
    ceiling = ones['valid'] - c['in_word_ends'] + c['in_word_predicted']
    common.write_atomic(out / f'unigram-{V}.model', proto)  # last: it completes the set
    print(f'unigram-{V}: trained and labelled in {time.time() - t0:.1f}s')
    return {'vocab_size': V, 'model': f'unigram-{V}.model',
            'labels': {s: f'{s}.unigram-{V}.bin' for s in SPLITS}, 'settings': settings,
            'shortening_factor': {s: round(sizes[s] / ones[s], 4) if ones[s] else None
                                  for s in SPLITS},
            'left_context_ceiling': {
                'split': 'valid', 'estimated_on': 'train', **c,
                'rule': 'b_t = 1 iff P(b_t = 1 | word prefix up to t) > 0.5',
                'shortening_factor': round(sizes['valid'] / ceiling, 4) if ceiling else None}}


def unigram(args, out, meta):
    """meta.json's {"unigram": default set, "unigram_sets": {"<V>": set}}: those of the meta.json
    there (or its older single "unigram" entry), and Unigram-V unless made with these settings."""
    path, sets, default = out / 'meta.json', {}, None

    def label_meta(default):   # the last made, or the one made earlier, is the default
        default = default if default in sets else max(sets, default=None)
        return {'unigram': sets[default] if default else None,
                'unigram_sets': {str(V): sets[V] for V in sorted(sets)}}
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding='utf-8'))
            why = dataset.meta_problem(old, ('unigram_sets', 'unigram'))
        except ValueError as e:
            why = f'unreadable ({e})'
        if why:
            raise UserError(f'{path}: {why}; fix it, or remove it and run again (the splits are '
                            'kept, the labels made again)')
        u = old.get('unigram')
        sets = old.get('unigram_sets') or ({str(u['vocab_size']): {'settings': None, **u}}
                                           if u else {})
        sets, default = {u['vocab_size']: u for u in sets.values()}, u and u['vocab_size']
    V = args.unigram if args.unigram is not None else LANGS[args.lang]['unigram']
    settings = {**UNIGRAM_SETTINGS, 'fit_on': 'train word counts',
                'max_words': args.unigram_max_words or None,
                'label_rule': 'piece ends; the space closes its word'}
    if V and V in sets and sets[V].get('settings') == settings:
        print(f'unigram-{V} done, skipping (--force redoes the whole dataset)')
    elif V:
        if sets.pop(V, None):   # it leaves meta.json before its files are replaced
            print(f'unigram-{V}: made with other settings; replacing it', file=sys.stderr)
            common.write_atomic(out / 'meta.json', json.dumps(
                {**meta, **label_meta(default)}, ensure_ascii=False, indent=1))
        sets[V] = make_unigram(args, out, meta, V, settings)
    return label_meta(V if V in sets else default)


def prepare(args, out, lang, inputs):
    """The dataset in out: splits (kept when done), Unigram labels, meta.json last."""
    import importlib.metadata as md
    alphabet = TEXT8_ALPHABET if lang is None else ['\n', ' '] + list(LANGS[lang]['letters'])
    dtype = 'uint8' if len(alphabet) <= 256 else 'uint16'
    # everything that decides the cleaned text: recorded, and compared by re-runs
    key = {'dataset': args.dataset, 'lang': lang, 'pipeline': 'text8 as is (a-z and space)',
           'fold_accents': False, 'max_train_chars': args.max_train_chars,
           'max_eval_chars': args.max_eval_chars,
           'input': [f['path'] for f in inputs] if inputs else None}
    if lang:
        key.update(pipeline='paper (wiki40b markers, homoglyphs, lower case, digits, alphabet)',
                   homoglyphs=None if lang == 'he' else 'Unicode confusables via '
                   f"confusable-homoglyphs {md.version('confusable-homoglyphs')}",
                   fold_accents=args.fold_accents, alphabet=LANGS[lang]['letters'],
                   fixes=['NFC first', 'İ -> i'] + ['digit words without niqqud'] * (lang == 'he'))
    stamp = splits(args, out, alphabet, dtype, lang, key, inputs)
    sizes, sources, n = stamp['sizes'], stamp['source'], sum(stamp['sizes'].values())
    ids, space = _ids(out / 'train.bin', dtype), alphabet.index(' ')
    n_space = sum(int((ids[i:i + (1 << 24)] == space).sum()) for i in range(0, len(ids), 1 << 24))
    mwl = sizes['train'] / n_space if n_space else None
    part = ({'of': 'text8', 'chars': n, 'full_chars': 100_000_000}
            if args.dataset == 'text8' and n < 100_000_000 else None)
    meta = {'name': out.name, 'dataset': args.dataset, 'lang': args.lang, 'alphabet': alphabet,
            'vocab_size': len(alphabet), 'space_id': space,
            'newline_id': alphabet.index('\n') if '\n' in alphabet else None, 'dtype': dtype,
            'sizes': sizes, 'source': sources, 'slice': part,
            'cleaning': {**key, 'split': stamp['rule']}, 'inputs': inputs,
            'mean_word_length': round(mwl, 4) if mwl else None,
            'defaults': {k: LANGS[args.lang][k] for k in ('unigram', 'prior')}}
    meta.update(unigram(args, out, meta))
    common.write_atomic(out / 'meta.json', json.dumps(meta, ensure_ascii=False, indent=1))
    print(f'\n== {out} ==\ndataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} '
          f"({dtype}), split: {stamp['rule']}" + (f"\nnote: a {n:,}-character slice of text8 "
                                                  f"({', '.join(sources)}), not the full "
                                                  '100,000,000' if part else ''))
    print('chars: ' + ', '.join(f'{s} {sizes[s]:,}' for s in SPLITS))
    print(f'mean word length (whitespace shortening factor, train): {mwl or 0:.3f}')
    for u in meta['unigram_sets'].values():
        c = u.get('left_context_ceiling') or {}
        print(f"unigram-{u['vocab_size']} shortening factor: " + ', '.join(
            f'{s} {v}' for s, v in u['shortening_factor'].items()) + (
            f"; left-context ceiling on valid: SF {c['shortening_factor']}" if c else '')
            + (' [default for train.py]' if meta['unigram'] is u else ''))
    return meta


def _matching(pattern, what):
    """Argument type: a string that `pattern` matches whole, or an error saying it is not `what`."""
    def parse(s):
        if re.fullmatch(pattern, s):
            return s.rstrip('/')
        raise argparse.ArgumentTypeError(f'{s!r} is not {what}')
    return parse


def parser():
    p = common.Parser(prog='prepare_data.py', description=(
        'Download, clean, split and encode data for dynpool. Without --dataset, --lang, --input, '
        'the dataset in --out-dir/--name is made as it was (labels need only --name, --unigram).'))
    a, env, url = p.add_argument, os.environ.get, _matching(r'https?://[^/\s]+.*', 'an http(s) URL')
    a('--dataset', choices=['text8', 'wiki40b', 'cc100', 'input'],
      help='source (default text8; wiki40b with --lang; input with --input and --lang)')
    a('--lang', choices=sorted(LANGS), help='its alphabet and digit names (cleaning.LANGS); '
      'default en for text8, needed for the others')
    a('--input', nargs='+', type=Path, metavar='FILE', help='.txt/.zip/.xz/.parquet '
      'file(s), not a download (default): one is cut 90/5/5, several named *train*/*valid*/*test* '
      'keep their splits')
    a('--name', type=_matching(r'(?!\.\.?$)[^/\0]+', "a folder name (no '/', not . or ..)"),
      help='folder under --out-dir (default text8, wiki40b-<lang>, cc100-<lang>, input-<lang>)')
    a('--out-dir', type=Path, default=Path('data'), help='parent of --name (default data)')
    a('--fold-accents', action='store_true', default=None, help='fold letters outside the '
      "alphabet (é -> e, ß -> ss), not the paper's space (default off)")
    a('--max-train-chars', type=common.int_range(1, 10 ** 12),
      help='cap on cleaned train characters (default 400M)')
    a('--max-eval-chars', type=common.int_range(1, 10 ** 12),
      help='cap on cleaned valid and test characters each (default 2M)')
    a('--unigram', type=common.int_range(0, 10 ** 6), help='SentencePiece Unigram size V of the '
      'boundary labels; sizes already made are kept, the same V with other settings replaced '
      '(default ' + ', '.join(f"{k} {v['unigram']}" for k, v in sorted(LANGS.items())) +
      '; 0: none made, those present kept)')
    a('--unigram-max-words', type=common.int_range(0, 10 ** 9), default=0,
      help='fit Unigram on the N most frequent train words (default 0: all)')
    a('--force', action='store_true', help='redo finished steps, not downloads (default off)')
    a('--hf-base', type=url, help='Hugging Face hub (default HF_ENDPOINT, else huggingface.co)')
    a('--hf-cache', type=Path, help='huggingface_hub cache (default HF_HUB_CACHE, else '
      '~/.cache/huggingface/hub)')
    a('--text8-url', type=url, default=env('DYNPOOL_TEXT8_URL', 'http://mattmahoney.net/dc/'
      'text8.zip'), help='(default DYNPOOL_TEXT8_URL, else http://mattmahoney.net/dc/text8.zip)')
    a('--cc100-base', type=url, default=env('DYNPOOL_CC100_BASE', 'https://data.statmt.org/'
      'cc-100'), help='holds <lang>.txt.xz (default DYNPOOL_CC100_BASE, else data.statmt.org)')
    a('--retries', type=common.int_range(0, 100), default=5,
      help='retries per download request (default 5; none for an unknown or refusing host)')
    a('--backoff', type=common.float_range(0, 3600), default=2.0,
      help='first retry delay in seconds, doubled each retry (default 2)')
    return p


def _rerun(args, *change):
    """This run's command line for a POSIX shell, `change` appended (a flag again overrides)."""
    return shlex.join(['python', 'prepare_data.py', *args.argv, *map(str, change)])


def run(argv=None):
    """prepare_data.py's work → the meta.json dict it wrote. Fills in --dataset, --lang, --input
    and the cleaning flags (an existing dataset's, as parser() says) and checks them together."""
    args = parser().parse_args(argv := [str(a) for a in (sys.argv[1:] if argv is None else argv)])
    dataset = args.dataset or ('input' if args.input and args.lang else
                               'wiki40b' if args.lang and not args.input else 'text8')
    out = args.out_dir / (args.name or {'text8': 'text8'}.get(dataset, f'{dataset}-{args.lang}'))
    try:
        old = json.loads((out / '.splits.json').read_text(encoding='utf-8'))['key']
        if not (args.dataset or args.lang or args.input):
            dataset, args.lang = old['dataset'], old['lang'] or 'en'
            args.input = old['input'] and [Path(p) for p in old['input']]
    except (OSError, ValueError, TypeError, KeyError):
        old = {}
    for k, v in DEFAULTS.items():
        setattr(args, k, old.get(k, v) if getattr(args, k) is None else getattr(args, k))
    if dataset == 'text8' and args.lang not in (None, 'en'):
        raise UserError(f'text8 is English; got --lang {args.lang}', 2)
    args.argv, args.dataset, args.lang = argv, dataset, 'en' if dataset == 'text8' else args.lang
    if args.lang is None or dataset == 'input' and not args.input:
        raise UserError(f'--dataset {dataset} needs --lang' + ' and --input' * (not args.input), 2)
    lang = None if dataset == 'text8' else args.lang  # text8 is already clean: kept as is
    inputs = None if not args.input else []   # size, mtime and SHA-256: an edit is noticed
    for path in map(Path.resolve, args.input or []):
        if path.exists() and not (path.is_file() or path.is_dir()):  # a FIFO would block reading
            raise UserError(f'input file {path}: not a regular file (a pipe or device?)')
        with open(path, 'rb') as f:
            st, sha = os.fstat(f.fileno()), hashlib.file_digest(f, 'sha256').hexdigest()
        inputs.append(dict(path=str(path), size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=sha))
    try:
        with common.locked(out, 'the run preparing it'):
            return prepare(args, out, lang, inputs)
    except DownloadError as e:   # one line: what failed, and the command that needs no network
        url = {'cc100': f'{args.cc100_base}/{lang}.txt.xz', 'text8': args.text8_url}.get(dataset)
        what, files = (url, Path(url).name or 'text8.zip') if url else (
            f'the {lang}/*.parquet shards of {WIKI40B} (a dataset on the Hugging Face hub)',
            'train-*.parquet validation-*.parquet test-*.parquet')
        flags = ['--dataset', dataset] + ['--lang', args.lang] * (dataset != 'text8')
        raise UserError(f'download failed: {e}. Without network, fetch {what} by hand into the '
                        f"current folder and run: {_rerun(args, *flags, '--input')} {files}"
                        ) from None


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
