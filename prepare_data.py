"""
Download, clean, split and encode character-level LM data for dynpool (docs/data.md tells all).

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --name he-small --unigram 1000               # more labels, same splits

data/<name>/: {train,valid,test}.bin (token ids), meta.json (last), per Unigram size V
unigram-V.model and {split}.unigram-V.bin (labels), and .splits.json, the options and input
(size, mtime, SHA-256) the splits were made from: the same again skip them, others remake them.
"""
import argparse
import codecs
import hashlib
import http.client
import io
import itertools
import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

import common
import dataset
from cleaning import LANGS, MARKERS, TEXT8_ALPHABET, clean  # noqa: F401 (clean is public here)
from common import UserError

SPLITS = ('train', 'valid', 'test')
TEXT8_CHARS = 100_000_000
CHUNK = 1 << 22          # characters of raw text cleaned at a time
WIKI40B = 'google/wiki40b'
DEFAULTS = dict(max_train_chars=400_000_000, max_eval_chars=2_000_000, fold_accents=False)


def _progress(**kw):
    """tqdm (it comes with huggingface_hub) on stderr, shown on a terminal only."""
    from tqdm import tqdm
    return tqdm(file=sys.stderr, disable=None, unit_scale=True, mininterval=1, **kw)


# ----------------------------------------------------------------------------- downloads
class DownloadError(UserError):
    """A UserError of a download that cannot succeed; run() adds the command that works without
    network."""


def _retry_or_raise(what, e, attempt, retries, backoff):
    """After failed try number `attempt` (from 0): waits backoff * 2^attempt where a network
    error is worth another try and tries are left; raises DownloadError (or e: not about the
    network, e.g. a full disk) otherwise. An unknown host, a refused connection and HTTP 4xx
    (but 408 and 429) fail at once: waiting will not help."""
    reason, status = getattr(e, 'reason', e), getattr(e, 'code', None) or getattr(
        getattr(e, 'response', None), 'status_code', None)
    said, retry = common.first_line(e), True
    if isinstance(reason, socket.gaierror):
        said, retry = f'cannot resolve the host ({reason.strerror or reason})', False
    elif isinstance(reason, ConnectionRefusedError):
        said, retry = 'connection refused', False
    elif isinstance(status, int) and status >= 400:
        said = f"HTTP {status} {getattr(e, 'reason', '')}".strip()
        retry = status >= 500 or status in (408, 429)
    elif type(e).__name__ in ('LocalEntryNotFoundError', 'OfflineModeIsEnabled'):
        retry = False
    elif not isinstance(e, (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                            TimeoutError)) and type(e).__module__.split('.')[0] not in (
                                'huggingface_hub', 'httpx', 'requests'):
        raise e
    if not retry or attempt >= retries:
        raise DownloadError(f'{what}: {said}') from None
    print(f'{what}: {said}; retry {attempt + 1}/{retries} in {backoff * 2 ** attempt:.1f}s',
          file=sys.stderr)
    time.sleep(backoff * 2 ** attempt)


def _retrying(what, fn, retries, backoff):
    for attempt in itertools.count():
        try:
            return fn()
        except Exception as e:
            _retry_or_raise(what, e, attempt, retries, backoff)


def http_blocks(url, retries, backoff, pos=0, seen=None, restart=True):
    """(offset, block) pairs of url's bytes from byte `pos`. A cut connection is reopened from the
    byte reached by a Range request, guarded by If-Range with the file's version in `seen`
    ({'validator': strong ETag or Last-Modified, 'total': size}, set by a whole response). A
    server that ignores Range sends the file whole: the offsets start from 0 again; so do they for
    a file that changed (another version or size), or with restart=False it is an error."""
    seen, attempt = {} if seen is None else seen, 0
    while True:
        headers = {'User-Agent': 'dynpool-prepare-data'}
        if pos:
            headers['Range'] = f'bytes={pos}-'
            headers.update({'If-Range': seen['validator']} if seen.get('validator') else {})
        try:
            try:
                resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                              timeout=60)
            except urllib.error.HTTPError as e:  # 416: nothing after pos; done if sizes agree
                if e.code == 416 and e.headers.get('Content-Range', '').endswith(f'/{pos}'):
                    return
                raise
            with resp:
                h, etag = resp.headers, resp.headers.get('ETag') or ''
                size = h.get('Content-Range', '*/*').rsplit('/', 1)[1]
                length = size if resp.status == 206 else h['Content-Length'] or ''
                now = dict(seen) if resp.status == 206 else {
                    'validator': h['Last-Modified'] if etag[:2] in ('', 'W/') else etag}
                now['total'] = int(length) if length.isdigit() else None
                if pos and now != {k: seen.get(k) for k in now}:
                    if not restart:
                        raise DownloadError(f'{url} changed on the server while it was read')
                    print(f'{url} changed on the server since the download began: starting over',
                          file=sys.stderr)
                    pos = 0
                    if resp.status == 206:
                        continue
                elif pos and resp.status != 206:
                    print(f'{url}: the server ignores Range: from zero again', file=sys.stderr)
                pos = pos if resp.status == 206 else 0
                seen.update(now)
                while block := resp.read(1 << 20):
                    yield pos, block
                    pos, attempt = pos + len(block), 0
            if seen['total'] and pos < seen['total']:
                raise http.client.IncompleteRead(b'', seen['total'] - pos)  # a cut: resumed
            return
        except Exception as e:
            _retry_or_raise(url, e, attempt, retries, backoff)
            attempt += 1


def download(url, dest, retries=5, backoff=2.0):
    """url → dest through dest.part (its version in dest.part.json), resumed after a cut in this
    run or an earlier one; dest appears only complete."""
    dest = Path(dest)
    part, info = dest.with_name(dest.name + '.part'), dest.with_name(dest.name + '.part.json')
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f'download {url} -> {dest}')
    try:
        seen = json.loads(info.read_text()) if part.exists() else {}
        have = part.stat().st_size if isinstance(seen, dict) and 'total' in seen else 0
    except (OSError, ValueError):
        seen, have = {}, 0
    f = None   # opened at the first byte: a host that is not there leaves no .part
    try:
        with _progress(desc=url, total=seen.get('total'), initial=have, unit='B') as bar:
            for offset, block in http_blocks(url, retries, backoff, have, seen):
                f = f or open(part, 'ab')
                if offset != f.tell():   # the whole file again
                    f.truncate(0)
                    bar.reset(seen['total'])
                if offset == 0:
                    common.write_atomic(info, json.dumps({'url': url, **seen}))
                f.write(block)
                bar.update(len(block))
    finally:
        if f:
            f.close()
    part.touch()   # (an empty file)
    os.replace(part, dest)
    info.unlink(missing_ok=True)
    return dest


def cc100_blocks(url, retries, backoff):
    """cc-100's <lang>.txt.xz decompressed as it streams in, never stored: a cut is resumed from
    the byte reached (the head a server that ignores Range sends again is skipped)."""
    import lzma
    d, reached = lzma.LZMADecompressor(), 0
    try:
        for offset, block in http_blocks(url, retries, backoff, restart=False):
            block, reached = block[max(0, reached - offset):], max(reached, offset + len(block))
            while block:   # a multi-stream .xz: a decompressor per stream
                d = lzma.LZMADecompressor() if d.eof else d
                yield d.decompress(block)
                block = d.unused_data if d.eof else b''
    except lzma.LZMAError as e:
        raise UserError(f'{url}: corrupt xz stream ({e})') from None
    if not d.eof:
        raise UserError(f'{url}: corrupt xz stream (it ends before its end marker)')


# ----------------------------------------------------------------------------- reading raw text
def text_pieces(blocks, label):
    """UTF-8 byte blocks → (text, separator) pieces of about CHUNK characters, cut at line ends so
    that lines are cleaned whole (a giant line at a space). Invalid bytes are dropped and counted
    (a text mostly invalid is refused); a NUL byte means binary."""
    dec = codecs.getincrementaldecoder('utf-8')('surrogateescape')   # a bad byte: U+DC80-DCFF
    buf, total, bad = '', 0, 0
    for raw in itertools.chain(blocks, [None]):
        if raw and raw.find(0) >= 0:
            raise UserError(f'{label} looks binary (NUL byte at offset {total + raw.find(0)}); '
                            'expected UTF-8 text (UTF-16 files must be converted first)')
        text, total = dec.decode(raw or b'', final=raw is None), total + len(raw or b'')
        if not text.isascii() and (n := len(re.findall('[\udc80-\udcff]', text))):
            bad, text = bad + n, re.sub('[\udc80-\udcff]', '', text)
        if (bad > 4096 or raw is None) and bad > total // 100:
            raise UserError(f'{label} is not UTF-8 text: {bad} of its first {total} bytes invalid')
        buf += text
        cut = buf.rfind('\n')
        if cut >= 0:
            yield buf[:cut], '\n'
            buf = buf[cut + 1:]
        elif len(buf) > CHUNK:  # a giant line: cut at a space, or anywhere as a last resort
            cut = buf.rfind(' ')
            yield (buf[:cut], ' ') if cut >= 0 else (buf, '')
            buf = buf[cut + 1:] if cut >= 0 else ''
    if bad:
        print(f'warning: {label}: dropped {bad} invalid UTF-8 bytes', file=sys.stderr)
    if buf:
        yield buf, ''


def file_pieces(path, downloaded=False):
    """(text, separator) pieces of a raw .txt / .zip / .xz / .gz / .bz2 / .parquet file. A
    corrupt downloaded file is removed (its blob in the hub cache too), so a re-run fetches it."""
    import bz2
    import gzip
    import lzma
    import zipfile
    path, suffix = Path(path), Path(path).suffix.lower()
    try:
        if suffix == '.parquet':
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            if 'text' not in pf.schema_arrow.names:
                raise UserError(f"{path}: no 'text' column ({', '.join(pf.schema_arrow.names)})")
            for batch in pf.iter_batches(columns=['text'], batch_size=256):
                yield from ((t, '\n') for t in batch.column(0).to_pylist() if t)
        elif suffix == '.zip':
            with zipfile.ZipFile(path) as z:
                for m in sorted(n for n in z.namelist() if not n.endswith('/')):
                    with z.open(m) as fb:
                        yield from text_pieces(iter(lambda: fb.read(CHUNK), b''), f'{path}:{m}')
        else:
            opener = {'.xz': lzma.open, '.gz': gzip.open, '.bz2': bz2.open}.get(suffix, open)
            with opener(path, 'rb') as fb:
                yield from text_pieces(iter(lambda: fb.read(CHUNK), b''), str(path))
    except Exception as e:   # bad data; the OS's own errors (errno set) and UserErrors pass on
        if not (isinstance(e, (zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError))
                or type(e).__module__.startswith('pyarrow')) or getattr(e, 'errno', None):
            raise
        why = common.first_line(e)
        if downloaded:
            Path(os.path.realpath(path)).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            raise UserError(f'downloaded {path} is corrupt ({why}); it was removed: re-run to '
                            'fetch it again') from None
        raise UserError(f'{path}: corrupt or unreadable ({why})') from None


# ----------------------------------------------------------------------------- splits
def encode(path, pieces, stats, alphabet, dtype, lang, cap, fold):
    """Cleans (text, separator) pieces (text8's are kept as they are) and writes their token ids
    to path, up to `cap` characters; every cleaned line, the last one too, ends with a newline.
    Adds to stats what tells a wrong --lang: letters that did not come from digit names against
    the raw signs (non-space, non-digit, non-marker characters). Returns the count."""
    lut = np.full(0x110000, -1, dtype=np.int32)
    lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
    cost = [(str(d), len(w)) for d, w in enumerate(LANGS[lang]['digits'].split())] if lang else []
    n, pending = 0, ''
    with open(path, 'wb') as f, _progress(desc=Path(path).name, unit='char') as bar:
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
            if lang:
                t0, digits = time.perf_counter(), [text.count(d) for d, _ in cost]
                stats['raw_chars'] += len(text)
                stats['signs'] += len(text) - text.count(' ') - text.count('\n') - sum(digits) \
                    - sum(map(len, MARKERS.findall(text)))
                text = clean(text, lang, fold)
                stats['letters'] += len(text) - text.count(' ') - text.count('\n') - sum(
                    k * c for k, (_, c) in zip(digits, cost))
                stats['clean_s'] += time.perf_counter() - t0
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


def _ids(path, dtype):
    """The token ids of a .bin, memory-mapped (numpy cannot map an empty file)."""
    return np.memmap(path, dtype=dtype, mode='r') if os.path.getsize(path) else np.zeros(0, dtype)


def list_wiki40b(lang, args):
    """Shard paths per split, listed by huggingface_hub; offline (HF_HUB_OFFLINE=1) the shards
    already in its cache."""
    import huggingface_hub as hub
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        try:
            root = Path(hub.snapshot_download(WIKI40B, repo_type='dataset', cache_dir=args.hf_cache,
                                              allow_patterns=[f'{lang}/*.parquet'],
                                              local_files_only=True))
        except Exception:
            raise UserError(
                f'HF_HUB_OFFLINE is set and the hub cache {args.hf_cache or constants.HF_HUB_CACHE}'
                f' holds no {WIKI40B} shards for {lang!r}; run once with network (unset '
                'HF_HUB_OFFLINE), pass the cache with --hf-cache, or pass the shards with '
                f'--dataset wiki40b --lang {lang} --input FILES') from None
        paths = [str(p.relative_to(root)) for p in sorted((root / lang).glob('*.parquet'))]
    else:
        api = hub.HfApi(endpoint=args.hf_base)
        paths = _retrying(f"{args.hf_base or 'the hub'}: {WIKI40B}/{lang}", lambda: [
            f.path for f in api.list_repo_tree(WIKI40B, path_in_repo=lang, repo_type='dataset')
            if f.path.endswith('.parquet')], args.retries, args.backoff)
    shards = [sorted(p for p in paths if Path(p).name.startswith(s + '-'))
              for s in ('train', 'validation', 'test')]
    if not shards[0]:
        raise DownloadError(f'{WIKI40B}: no parquet shards for language {lang!r}')
    return shards


def build_splits(args, out, alphabet, dtype, lang):
    """Writes train/valid/test.bin; returns (sources, split rule, cleaning stats)."""
    E, T = args.max_eval_chars, args.max_train_chars
    stats = dict.fromkeys(('clean_s', 'raw_chars', 'letters', 'signs'), 0)
    kw = (stats, alphabet, dtype, lang)

    def by_split(groups):  # one list of (text, separator) iterators per split
        for split, cap, group in zip(SPLITS, (T, E, E), groups):
            common.write_atomic(out / f'{split}.bin', lambda tmp: encode(
                tmp, (p for it in group for p in it), *kw, cap, args.fold_accents))

    def one_stream(pieces, cap, head):
        fd, tmp = tempfile.mkstemp(dir=out, prefix='.all.', suffix='.bin')
        os.close(fd)
        try:
            N = encode(tmp, pieces, *kw, cap, args.fold_accents)
            if head:  # cc-100: valid and test first, so a capped stream fills them before train
                e = E if N >= T + 2 * E or N >= 20 * E else N // 20
                cuts = {'valid': (0, e), 'test': (e, e), 'train': (2 * e, N - 2 * e)}
            else:  # text8 / --input: 90% train, 5% valid, 5% test, in that order
                e = N // 20
                cuts = {'train': (0, N - 2 * e), 'valid': (N - 2 * e, e), 'test': (N - e, e)}
            data = _ids(tmp, dtype)
            for split, (a, n) in cuts.items():
                common.write_atomic(out / f'{split}.bin', data[a:a + n].tofile)
            del data
        finally:
            os.remove(tmp)

    if args.input:
        names = [p.name.lower().replace('dev', 'valid') for p in args.input]
        groups = [[p for p, n in zip(args.input, names) if s in n] for s in SPLITS]
        if len(args.input) > 1 and all(groups) and sum(map(len, groups)) == len(args.input):
            by_split([map(file_pieces, g) for g in groups])
            rule = 'official (input files named train/valid/test)'
        else:
            cap = None if args.dataset == 'text8' else int(T / 0.9)
            one_stream((p for f in args.input for p in file_pieces(f)), cap, head=False)
            rule = '90% train / 5% valid / 5% test, in order'
        return [str(p) for p in args.input], rule, stats
    if args.dataset == 'text8':
        zpath = download(args.text8_url, out / 'download' / 'text8.zip', args.retries, args.backoff)
        one_stream(file_pieces(zpath, downloaded=True), None, head=False)
        return [args.text8_url], 'first 90M train / next 5M valid / last 5M test', stats
    if args.dataset == 'wiki40b':
        import huggingface_hub as hub
        used = []

        def shard(p):  # through huggingface_hub's cache: resumed, token from HF_TOKEN or login
            used.append(f'hf://datasets/{WIKI40B}/{p}')
            return file_pieces(_retrying(p, lambda: hub.hf_hub_download(
                WIKI40B, p, repo_type='dataset', cache_dir=args.hf_cache, endpoint=args.hf_base),
                args.retries, args.backoff), downloaded=True)
        by_split([(shard(p) for p in g) for g in list_wiki40b(lang, args)])
        return used, 'official wiki40b splits, capped', stats
    url = f'{args.cc100_base}/{lang}.txt.xz'
    one_stream(text_pieces(cc100_blocks(url, args.retries, args.backoff), url), T + 2 * E, True)
    return [url], f'first {E} chars valid, next {E} test, then train (cleaned chars)', stats


def _check_splits(sizes, stats, sources, lang):
    """Why the splits are no dataset (no text, a wrong --lang, an empty split), or None."""
    src = ', '.join(map(str, sources))
    letters, signs = (stats['letters'], stats['signs']) if lang else (sum(sizes.values()),) * 2
    if stats['raw_chars'] == 0 and lang or sum(sizes.values()) == 0 and not lang:
        return f'no text in {src} (empty input?)'
    if letters <= 0 or letters < 0.5 * signs:
        return (f'only {max(letters, 0)} of the {signs} non-space, non-digit characters of {src} '
                f"are {lang} letters after cleaning ({''.join(LANGS[lang]['letters'][:3])}...); "
                'wrong --lang?')
    if min(sizes.values()) == 0:
        return (f'{src} is too small: it cleans to {sum(sizes.values())} characters, leaving an '
                f"empty split ({', '.join(f'{s} {n}' for s, n in sizes.items())}); give more text")
    return None


def splits(args, out, alphabet, dtype, lang, key, inputs):
    """Builds train/valid/test.bin unless a run with the same options and input (size, mtime,
    SHA-256) made them: its record, .splits.json, which this returns."""
    path, item = out / '.splits.json', np.dtype(dtype).itemsize
    try:
        stamp = json.loads(path.read_text())
        done = (stamp['key'], stamp['inputs']) == (key, inputs) and all(
            _size(out / f'{s}.bin') == stamp['sizes'][s] * item for s in SPLITS)
    except (OSError, ValueError, TypeError, KeyError):
        stamp = done = None   # none, or unreadable: made again
    if done and not args.force:
        print(f'splits done in {out}, skipping (--force redoes)')
        return stamp
    if stamp and not args.force:
        print(f'{out} was prepared with other options or input, or is incomplete: rebuilding it',
              file=sys.stderr)
    for f in [out / 'meta.json', path, *out.glob('*unigram-*')]:
        f.unlink(missing_ok=True)  # outputs of an earlier run go before the new ones are made
    sources, rule, stats = build_splits(args, out, alphabet, dtype, lang)
    sizes = {s: os.path.getsize(out / f'{s}.bin') // item for s in SPLITS}
    why = _check_splits(sizes, stats, sources, lang)
    if why:
        for s in SPLITS:
            (out / f'{s}.bin').unlink(missing_ok=True)
        raise UserError(why)
    stamp = {'key': key, 'inputs': inputs, 'sizes': sizes, 'source': sources, 'rule': rule,
             'rate': stats['raw_chars'] / stats['clean_s'] if stats['clean_s'] else None}
    common.write_atomic(path, json.dumps(stamp, ensure_ascii=False))
    return stamp


def _size(path):
    return path.stat().st_size if path.exists() else None


# ----------------------------------------------------------------------------- Unigram boundaries
# The paper's released tokenizer settings; fitted on the word counts of the whole train split.
UNIGRAM_SETTINGS = dict(model_type='unigram', add_dummy_prefix=True, max_sentencepiece_length=16,
                        split_digits=True, split_by_whitespace=True, split_by_unicode_script=True,
                        remove_extra_whitespaces=True, normalization_rule_name='identity',
                        character_coverage=1.0)


def split_words(path, alphabet, dtype, block=1 << 21):
    """The words of one split (cut at spaces and newlines, '' between two of them), a block at a
    time: (words, closed), closed False for the split's last word where no separator follows."""
    data, chars, carry = _ids(path, dtype), np.array([ord(c) for c in alphabet], '<u4'), ''
    for i in range(0, len(data), block):
        words = (carry + chars[data[i:i + block]].tobytes().decode('utf-32-le')).replace(
            '\n', ' ').split(' ')
        carry = words.pop()  # maybe cut by the block's end: it goes on in the next block
        yield words, True
    if carry:
        yield [carry], False


def word_counts(path, alphabet, dtype):
    return Counter(w for words, _ in split_words(path, alphabet, dtype) for w in words if w)


def fit_unigram(rows, letters, V):
    """SentencePiece Unigram-V model proto fitted on 'word<TAB>count' rows → (True, proto) or
    (False, SentencePiece's message). In a child process: SentencePiece's C++ loop holds off
    Python's Ctrl-C handler until training ends (minutes on a large split), so the child runs in
    a session of its own, which the terminal's Ctrl-C does not reach, and is killed at once."""
    code = (f'import sys; sys.path.insert(0, {os.path.dirname(os.path.realpath(__file__))!r}); '
            'import prepare_data; prepare_data._fit()')
    child = subprocess.Popen([sys.executable, '-c', code, letters, str(V)], start_new_session=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proto, err = child.communicate('\n'.join(rows).encode())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    said = err.decode(errors='replace').strip().splitlines() or [f'exit {child.returncode}']
    return (True, proto) if child.returncode == 0 else (False, said[-1])


def _fit():
    """The child of fit_unigram: rows on stdin, the model proto on stdout."""
    import sentencepiece as spm
    letters, V, model = sys.argv[1], int(sys.argv[2]), io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sys.stdin.buffer.read().decode().split('\n')),
            input_format='tsv', model_writer=model, vocab_size=V, required_chars=letters,
            bos_id=-1, eos_id=-1, max_sentence_length=1 << 16,
            num_threads=min(4, os.cpu_count() or 1), minloglevel=2, **UNIGRAM_SETTINGS)
    except RuntimeError as e:
        sys.exit((str(e).splitlines() or ['RuntimeError'])[0])
    sys.stdout.buffer.write(model.getvalue())


def word_labels(sp, words):
    """{word: in-word labels}, one byte per character: 1 at the last character of every piece
    but the word's last one (the space after the word closes that one). SentencePiece sees each
    word as "▁word" (dummy prefix): the ▁ is dropped, and a piece that is only ▁ with it."""
    words, out = list(words), {}
    for w, pieces in zip(words, sp.encode(words, out_type=str) if words else []):
        pieces = [p for p in [pieces[0].removeprefix('\u2581')] + pieces[1:] if p] if w else []
        if ''.join(pieces) != w:  # cannot happen with identity normalisation and full coverage
            pieces = list(w)
        lab = bytearray(len(w))
        for end in itertools.accumulate(len(p) for p in pieces[:-1]):
            lab[end - 1] = 1
        out[w] = bytes(lab)
    return out


def unigram_labels(sp, split_path, out_path, alphabet, dtype):
    """b_t = 1 where a piece ends; spaces/newlines close the word before them. Returns sum(b)."""
    cache, ones = {}, [0]

    def write(tmp):
        with open(tmp, 'wb') as f:
            for words, closed in split_words(split_path, alphabet, dtype):
                if len(cache) > 500_000:  # bound memory on 400M chars; hot words come back
                    cache.clear()
                for w, lab in word_labels(sp, {w for w in words if w not in cache}).items():
                    cache[w] = lab + b'\x01'   # with the separator after it
                chunk = b''.join(map(cache.get, words)) if closed else \
                    cache[words[0]][:-2] + b'\x01'   # no separator after the last word
                ones[0] += chunk.count(1)
                f.write(chunk)
    common.write_atomic(out_path, write)
    return ones[0]


def left_context_ceiling(train_words, valid_words, labels):
    """The best a causal boundary predictor can do on these labels from the current word alone:
    at an in-word position t it has seen the word's prefix up to t, and the Bayes decision is
    b_t = 1 iff P(b_t = 1 | prefix) > 0.5, counted on train_words ({word: count}; a prefix train
    never shows gets 0). Applied to valid_words → {"ends": in-word label ends, "predicted": in-word
    decisions of 1, "hits": both, "in_word_recall"}. labels: {word: in-word 0/1 per character}."""
    wanted = {w[:k + 1] for w in valid_words for k in range(len(w))}
    total, ones = dict.fromkeys(wanted, 0), dict.fromkeys(wanted, 0)
    for w, n in train_words.items():
        for k in range(len(w)):
            if w[:k + 1] not in total:  # its longer prefixes are not wanted either
                break
            total[w[:k + 1]] += n
            ones[w[:k + 1]] += n * labels[w][k]
    ends = predicted = hits = 0
    for w, n in valid_words.items():
        for k in range(len(w)):
            decide = 2 * ones[w[:k + 1]] > total[w[:k + 1]]
            ends += n * labels[w][k]
            predicted += n * decide
            hits += n * (decide and labels[w][k])
    return {'ends': ends, 'predicted': predicted, 'hits': hits,
            'in_word_recall': hits / ends if ends else None}


def make_unigram(args, out, meta, V, settings):
    """Fits Unigram-V on the train split's word counts and writes its labels, the model last;
    returns its set entry: the labels' shortening factors and their left-context ceiling."""
    import sentencepiece as spm
    alphabet, dtype, sizes, t0 = meta['alphabet'], meta['dtype'], meta['sizes'], time.time()
    train_words = word_counts(out / 'train.bin', alphabet, dtype)
    if not train_words:
        raise UserError('the train split has no words: nothing to fit Unigram on '
                        '(pass --unigram 0)')
    used = min(len(train_words), args.unigram_max_words or len(train_words))
    print(f'unigram-{V}: training SentencePiece on the counts of {used:,} distinct train words',
          file=sys.stderr, flush=True)
    letters = ''.join(c for c in alphabet if c not in ' \n')
    # each letter once more as a word of its own, so letters the text lacks still get a piece
    rows = [f'{w}\t{n}' for w, n in train_words.most_common(args.unigram_max_words or None)]
    ok, proto = fit_unigram(rows + [f'{c}\t1' for c in letters], letters, V)
    fit = not ok and re.search(r'(?:set it to a value <= |required_chars\. \d+ vs )(\d+)', proto)
    if not ok and fit:   # too large for the text, or too small for the alphabet
        raise UserError(f'--unigram {V}: {proto} (SentencePiece); run: '
                        f'{_rerun(args, "--unigram", fit[1])}; or --unigram 0 to skip Unigram '
                        'boundaries')
    if not ok:
        raise UserError(f'SentencePiece failed: {proto}')
    sp = spm.SentencePieceProcessor(model_proto=proto)
    ones = {s: unigram_labels(sp, out / f'{s}.bin', out / f'{s}.unigram-{V}.bin', alphabet, dtype)
            for s in SPLITS}
    valid_words = word_counts(out / 'valid.bin', alphabet, dtype)
    c = left_context_ceiling(train_words, valid_words,
                             word_labels(sp, set(train_words) | set(valid_words)))
    ceiling_ones, recall = ones['valid'] - c['ends'] + c['predicted'], c['in_word_recall']
    common.write_atomic(out / f'unigram-{V}.model', proto)  # last: labels without it are removed
    print(f'unigram-{V}: trained and labelled in {time.time() - t0:.1f}s')
    return {'vocab_size': V, 'model': f'unigram-{V}.model',
            'labels': {s: f'{s}.unigram-{V}.bin' for s in SPLITS}, 'settings': settings,
            'fit_words': {'distinct_used': used, 'distinct_in_train': len(train_words)},
            'shortening_factor': {s: round(sizes[s] / ones[s], 4) if ones[s] else None
                                  for s in SPLITS},
            'left_context_ceiling': {
                'split': 'valid', 'estimated_on': 'train',
                'rule': 'b_t = 1 iff P(b_t = 1 | word prefix up to t) > 0.5',
                'shortening_factor': round(sizes['valid'] / ceiling_ones, 4) if ceiling_ones
                else None, 'in_word_recall': round(recall, 4) if recall is not None else None,
                'in_word_ends': c['ends'], 'in_word_predicted': c['predicted'],
                'in_word_hits': c['hits']}}


def unigram(args, out, meta):
    """meta.json's {"unigram": default set, "unigram_sets": {"<V>": set}}: the sets of the
    meta.json already there (an older one's single "unigram" entry read as one set) whose files
    are all there at full length, and Unigram-V made unless a set with the same settings is one
    of them. Label files no set describes are removed: meta.json and the files agree."""
    path, sets, default = out / 'meta.json', {}, None
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
    for V in sorted(sets):
        if not (out / f'unigram-{V}.model').exists() or any(
                _size(out / f'{s}.unigram-{V}.bin') != meta['sizes'][s] for s in SPLITS):
            print(f'unigram-{V}: label files missing or cut short; dropped', file=sys.stderr)
            del sets[V]
    keep = {n for V in sets for n in [f'unigram-{V}.model', *(f'{s}.unigram-{V}.bin'
                                                                for s in SPLITS)]}
    for f in sorted(out.glob('*unigram-*')):
        if f.name not in keep:
            print(f'removed {f.name}: no label set in meta.json describes it', file=sys.stderr)
            f.unlink()
    V = args.unigram if args.unigram is not None else LANGS[args.lang]['unigram']
    settings = {**UNIGRAM_SETTINGS, 'fit_on': 'train word counts',
                'max_words': args.unigram_max_words or None,
                'label_rule': 'piece ends; the space closes its word'}
    if V and V in sets and sets[V].get('settings') == settings:
        print(f'unigram-{V} done, skipping (--force redoes the whole dataset)')
    elif V:
        if sets.pop(V, None):   # it leaves meta.json before its files are replaced
            print(f'unigram-{V}: made with other settings; replacing it', file=sys.stderr)
            _write_meta(out, {**meta, **_label_meta(sets, default)})
        sets[V] = make_unigram(args, out, meta, V, settings)
    elif sets:
        print(f"--unigram 0: keeping the labels already in {out} (unigram-"
              f"{', unigram-'.join(map(str, sorted(sets)))}); --force rebuilds the dataset "
              'without them')
    return _label_meta(sets, V if V in sets else default)


def _label_meta(sets, default):
    default = default if default in sets else max(sets, default=None)
    return {'unigram': sets[default] if default else None,
            'unigram_sets': {str(V): sets[V] for V in sorted(sets)}}


def _write_meta(out, meta):
    common.write_atomic(out / 'meta.json', json.dumps(meta, ensure_ascii=False, indent=1))


# ----------------------------------------------------------------------------- the dataset
def fingerprint(path):
    """Size, mtime and SHA-256 of an input file: a file edited in place is noticed on re-run."""
    st = os.stat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a FIFO would block the read
        raise UserError(f'input file {path}: not a regular file (a pipe or device?)')
    with open(path, 'rb') as f:
        sha = hashlib.file_digest(f, 'sha256').hexdigest()
    return {'path': str(path), 'size': st.st_size, 'mtime_ns': st.st_mtime_ns, 'sha256': sha}


def cleaning_options(args, lang):
    """Everything that decides the cleaned text; meta.json records it, re-runs compare it."""
    if lang is None:
        return {'lang': None, 'pipeline': 'text8 as is (a-z and space)', 'fold_accents': False}
    import importlib.metadata as md
    homo = None if lang == 'he' else (
        f"Unicode confusables via confusable-homoglyphs {md.version('confusable-homoglyphs')}")
    return {'lang': lang,
            'pipeline': 'paper (wiki40b markers, homoglyphs, lower case, digits, alphabet)',
            'homoglyphs': homo, 'fold_accents': args.fold_accents,
            'fixes': ['NFC first', 'İ -> i'] + (['digit words without niqqud'] * (lang == 'he')),
            'alphabet': LANGS[lang]['letters']}


def prepare(args, out, name, lang, inputs):
    """The dataset in out: splits (kept when done), Unigram labels, meta.json last."""
    alphabet = TEXT8_ALPHABET if lang is None else ['\n', ' '] + list(LANGS[lang]['letters'])
    dtype = 'uint8' if len(alphabet) <= 256 else 'uint16'
    key = {'dataset': args.dataset, **cleaning_options(args, lang),
           'max_train_chars': args.max_train_chars, 'max_eval_chars': args.max_eval_chars,
           'input': [f['path'] for f in inputs] if inputs else None}
    stamp = splits(args, out, alphabet, dtype, lang, key, inputs)
    sizes, sources, n = stamp['sizes'], stamp['source'], sum(stamp['sizes'].values())
    ids, space = _ids(out / 'train.bin', dtype), alphabet.index(' ')
    n_space = sum(int(np.count_nonzero(ids[i:i + (1 << 24)] == space))
                  for i in range(0, len(ids), 1 << 24))
    mwl = sizes['train'] / n_space if n_space else None
    part = ({'of': 'text8', 'chars': n, 'full_chars': TEXT8_CHARS}
            if args.dataset == 'text8' and n < TEXT8_CHARS else None)
    meta = {'name': name, 'dataset': args.dataset, 'lang': args.lang, 'alphabet': alphabet,
            'vocab_size': len(alphabet), 'space_id': space,
            'newline_id': alphabet.index('\n') if '\n' in alphabet else None, 'dtype': dtype,
            'sizes': sizes, 'source': sources, 'slice': part,
            'cleaning': {**key, 'split': stamp['rule']}, 'inputs': inputs,
            'mean_word_length': round(mwl, 4) if mwl else None,
            'defaults': {k: LANGS[args.lang][k] for k in ('unigram', 'prior')}}
    meta.update(unigram(args, out, meta))
    _write_meta(out, meta)
    print(f'\n== {out} ==\ndataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} '
          f"({dtype}), split: {stamp['rule']}")
    if part:
        print(f"note: a {n:,}-character slice of text8 ({', '.join(sources)}), not the full "
              f'{TEXT8_CHARS:,}')
    print('chars: ' + ', '.join(f'{s} {sizes[s]:,}' for s in SPLITS))
    print(f'mean word length (whitespace shortening factor, train): {mwl:.3f}' if mwl
          else 'no spaces in train')
    for u in meta['unigram_sets'].values():
        c = u.get('left_context_ceiling') or {}
        print(f"unigram-{u['vocab_size']} shortening factor: " + ', '.join(
            f'{s} {v}' for s, v in u['shortening_factor'].items()) + (
            f"; left-context ceiling on valid: SF {c['shortening_factor']}, in-word recall "
            f"{100 * c['in_word_recall']:.1f}%" if c.get('in_word_recall') is not None else '')
            + (' [default for train.py]' if meta['unigram'] is u else ''))
    if stamp.get('rate'):
        print(f"cleaning rate: {stamp['rate'] / 1e6:.2f} M chars/s")
    return meta


# ----------------------------------------------------------------------------- command line
def _url(value):
    """Argument type: an http(s) URL with a host."""
    from urllib.parse import urlsplit
    if urlsplit(value).scheme not in ('http', 'https') or not urlsplit(value).netloc:
        raise argparse.ArgumentTypeError(f'{value!r} is not an http(s) URL')
    return value.rstrip('/')


def _unigram_size(value):
    """Argument type: a Unigram vocabulary size, 2 to 1,000,000, or 0 for none."""
    try:
        v = common.int_range(0, 1_000_000)(value)
    except argparse.ArgumentTypeError:
        v = 1
    if v == 1:
        raise argparse.ArgumentTypeError(f'must be 0 (no labels) or an integer in [2, 1000000], '
                                         f'got {value!r}')
    return v


def _folder_name(value):
    """Argument type: one folder name (the dataset's, under --out-dir)."""
    if value in ('', '.', '..') or '/' in value or '\0' in value:
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder name (no '/', not . or ..)")
    return value


def parser():
    p = common.Parser(prog='prepare_data.py', description=(
        "Download, clean, split and encode data for dynpool. A default 'as recorded' is the value "
        'the dataset already in --out-dir/--name recorded (so adding labels needs only --name '
        'and --unigram).'))
    a, env = p.add_argument, os.environ.get
    a('--dataset', choices=['text8', 'wiki40b', 'cc100', 'input'], help='source (default: as '
      'recorded, else text8 without --lang, wiki40b with it, input with --input and --lang)')
    a('--lang', choices=sorted(LANGS), help='language: alphabet and digit names in cleaning.LANGS '
      '(default: as recorded, else en for text8; needed for the others)')
    a('--input', nargs='+', type=Path, metavar='FILE', help='local .txt/.zip/.xz/.gz/.bz2/.parquet '
      'file(s) instead of a download; one is cut 90/5/5, several named *train*/*valid*/*test* '
      'keep their splits (default: as recorded, else download)')
    a('--name', type=_folder_name, help='output folder under --out-dir (default text8, '
      'wiki40b-<lang>, cc100-<lang>, input-<lang>)')
    a('--out-dir', type=Path, default=Path('data'), help='parent of --name (default data)')
    a('--fold-accents', action='store_true', default=None, help='fold letters outside the '
      "alphabet (é -> e, ß -> ss) instead of the paper's space (default: as recorded, else off)")
    a('--max-train-chars', type=common.int_range(1, 10 ** 12),
      help='cap on cleaned train characters (default: as recorded, else 400M)')
    a('--max-eval-chars', type=common.int_range(1, 10 ** 12),
      help='cap on cleaned valid and test characters each (default: as recorded, else 2M)')
    a('--unigram', type=_unigram_size, help='SentencePiece Unigram size V of the boundary labels '
      '(default: ' + ', '.join(f"{k} {v['unigram']}" for k, v in sorted(LANGS.items())) +
      ', text8 10000); other sizes already made are kept, the same V made with other settings '
      'is replaced; 0: none made, those present kept')
    a('--unigram-max-words', type=common.int_range(0, 10 ** 9), default=0, help='fit Unigram on '
      'the counts of the N most frequent train words (default 0: all, i.e. the whole split)')
    a('--force', action='store_true', help='redo finished steps, not downloads (default off)')
    a('--hf-base', type=_url, help='Hugging Face hub endpoint (default: HF_ENDPOINT, else '
      'huggingface.co)')
    a('--hf-cache', type=Path, help='huggingface_hub cache for the wiki40b shards (default: '
      'HF_HUB_CACHE, else ~/.cache/huggingface/hub)')
    a('--text8-url', type=_url, default=env('DYNPOOL_TEXT8_URL', 'http://mattmahoney.net/dc/'
      'text8.zip'), help='(default: env DYNPOOL_TEXT8_URL, else http://mattmahoney.net/dc/text8.zip)')
    a('--cc100-base', type=_url, default=env('DYNPOOL_CC100_BASE', 'https://data.statmt.org/'
      'cc-100'), help='URL holding <lang>.txt.xz (default: env DYNPOOL_CC100_BASE, else '
      'https://data.statmt.org/cc-100)')
    a('--retries', type=common.int_range(0, 100), default=5, help='retries per download request '
      '(default 5; none for a host that is unknown or refuses)')
    a('--backoff', type=common.float_range(0, 3600), default=2.0,
      help='first retry delay in seconds, doubled each retry (default 2)')
    return p


def _rerun(args, *change):
    """This run's command line, quoted for a POSIX shell, with `change` appended (a flag given
    again overrides its earlier value)."""
    return shlex.join(['python', 'prepare_data.py', *args.argv, *map(str, change)])


def _offline_howto(args):
    """What to do without network: a command that runs once the file is fetched by hand."""
    if args.dataset == 'wiki40b':
        return (f'Without network, set HF_HUB_OFFLINE=1 to use the shards already cached, or '
                f'fetch the {args.lang}/*.parquet shards of {WIKI40B} (a dataset on the Hugging '
                'Face hub) by hand into the current folder and run: '
                f'{_rerun(args, "--dataset", "wiki40b", "--lang", args.lang, "--input")} '
                'train-*.parquet validation-*.parquet test-*.parquet')
    url = f'{args.cc100_base}/{args.lang}.txt.xz' if args.dataset == 'cc100' else args.text8_url
    name, lang = Path(url).name or 'text8.zip', ['--lang', args.lang] * (args.dataset == 'cc100')
    return (f'Without network, fetch {url} by hand into the current folder and run: '
            f'{_rerun(args, "--dataset", args.dataset, *lang, "--input", name)}')


def resolve(args):
    """Fills in --dataset, --lang, --input and the cleaning flags (from the dataset already there
    when not given) and checks them together; returns (out, name)."""
    dataset = args.dataset or ('input' if args.input and args.lang else
                               'wiki40b' if args.lang and not args.input else 'text8')
    name = args.name or {'text8': 'text8'}.get(dataset, f'{dataset}-{args.lang or "en"}')
    out = args.out_dir / name
    try:
        old = json.loads((out / '.splits.json').read_text(encoding='utf-8'))['key']
        old_lang = old['lang'] or ('en' if old['dataset'] == 'text8' else None)
    except (OSError, ValueError, TypeError, KeyError):
        old = {}
    if old and args.dataset in (None, old['dataset']) and args.lang in (None, old_lang):
        dataset, args.lang = old['dataset'], old_lang
        if args.input is None and args.dataset is None and old.get('input'):
            args.input = [Path(p) for p in old['input']]   # its input, not a download
        for k in DEFAULTS:
            if getattr(args, k) is None and k in old:
                setattr(args, k, old[k])
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dataset = dataset
    if dataset == 'text8' and args.lang not in (None, 'en'):
        raise UserError(f'text8 is English; got --lang {args.lang}', 2)
    args.lang = 'en' if dataset == 'text8' else args.lang
    if args.lang is None:
        raise UserError(f"--dataset {dataset} needs --lang ({', '.join(sorted(LANGS))})", 2)
    if dataset == 'input' and not args.input:
        raise UserError('--dataset input needs --input FILE...', 2)
    return out, name


def run(argv=None):
    """prepare_data.py's work → the meta.json dict it wrote."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    args = parser().parse_args(argv)
    args.argv = argv
    out, name = resolve(args)
    lang = None if args.dataset == 'text8' else args.lang  # text8 is already clean: kept as is
    inputs = [fingerprint(p.resolve()) for p in args.input] if args.input else None
    made = not out.exists()
    try:
        with common.locked(out, 'the run preparing it'):
            return prepare(args, out, name, lang, inputs)
    except DownloadError as e:
        raise UserError(f'download failed: {e}. {_offline_howto(args)}') from None
    finally:
        if made:  # a run that failed before writing anything leaves no empty folders
            for d in (out / 'download', out):
                if d.is_dir() and {p.name for p in d.iterdir()} <= {'.lock'}:
                    (d / '.lock').unlink(missing_ok=True)
                    d.rmdir()


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
