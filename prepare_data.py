"""Download, clean, split and encode character- or byte-level LM data for dynpool
(docs/data.md tells all).

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --dataset enwik8         # enwik8 bytes -> data/enwik8 (90M/5M/5M)
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --input he.txt --bytes --name he-bytes       # its raw UTF-8 bytes
    python prepare_data.py --name he-small --unigram 1000               # more labels, same splits

data/<name>/: {train,valid,test}.bin, meta.json, Unigram labels, .splits.json (what made
the splits: the same options and input again skip them, others remake them); docs/data.md
has the layout."""
import argparse
import codecs
import hashlib
import http.client
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unicodedata
from urllib.error import URLError
from urllib.parse import urlsplit
from urllib.request import Request, getproxies, proxy_bypass, urlopen
from collections import Counter
from pathlib import Path

import numpy as np

from cleaning import LANGS, TEXT8_ALPHABET, clean, foreign_letters
import common
from common import UserError, first_line, int_range, write_atomic
from dataset import (CAPS, DATASETS, SPLITS, WHOLE, WHOLE_FILES, default_name, prepare_command,
                     read_meta, recorded_settings, split_problem, unit)

CHUNK = 1 << 22          # characters of raw text cleaned at a time
WIKI40B = 'google/wiki40b'
PROGRESS = 1 << 24       # characters of raw text read between two progress lines
AGENT = {'User-Agent': 'dynpool-prepare-data'}
# retries per download request, the first waiting BACKOFF s, each next one twice as long
RETRIES = 5
BACKOFF = 2.0
# how each encoding reads a file: bytes as Latin-1, a character per byte
_DECODING = {'paper': 'utf-8', 'chars': 'utf-8', 'bytes': 'latin-1'}
# the end of a giant line's last character that cleaning makes a space in every language
# (whitespace, ASCII punctuation): a cut there neither splits nor joins words
_LAST_BREAK = re.compile(r'.*[\s!-/:-@\[-`{-~]', re.DOTALL)
# what ends a word for Unigram labels: ASCII whitespace, the only whitespace bytes of UTF-8
_SEPARATOR = re.compile('[\t\n\v\f\r ]')
# the temporary files a killed run can leave in a dataset folder (remove_leftovers)
LEFTOVER = re.compile(r'\.all\.bin|\.(\.splits|meta|(train|valid|test)(\.unigram-\d+)?'
                      r'|unigram-\d+|\w+\.zip\.part)\.[a-z0-9_]{8}\.(bin|json|model)')


def _note(line):
    """A line on stderr, beside the results on stdout: progress, retries, what is redone."""
    print(line, file=sys.stderr)


class DownloadError(UserError):   # run() adds the commands that work without network
    pass


def _reach(url):
    """One TCP connection to url's host, or to the proxy urllib would use for it (10 s at
    most): a host that cannot be reached (unknown, refusing, no route) ends the run at
    once, before any download library starts retrying it."""
    parts = urlsplit(url)
    proxy = getproxies().get(parts.scheme)
    if proxy and not proxy_bypass(parts.hostname):
        parts = urlsplit(proxy)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=10).close()
    except OSError as e:
        raise DownloadError(f'{url}: {e.strerror or first_line(e)}') from None


def _retrying(url, fn, what=None):
    """fn() once url's host answers (_reach), tried again after a network error while
    tries are left (RETRIES, BACKOFF); not after an HTTP error that waiting cannot mend
    (4xx)."""
    _reach(url)
    network = (URLError, http.client.HTTPException, ConnectionError, TimeoutError)
    for attempt in itertools.count():
        try:
            return fn()
        except Exception as e:
            from_hub = type(e).__module__.startswith(('huggingface_hub', 'httpx'))
            if not (isinstance(e, network) or from_hub):
                raise
            response = getattr(e, 'response', None)
            code = getattr(e, 'code', getattr(response, 'status_code', None))
            final = isinstance(code, int) and code < 500 and code not in (408, 429)
            if attempt >= RETRIES or final or type(e).__name__ == 'OfflineModeIsEnabled':
                raise DownloadError(f'{what or url}: {first_line(e)}') from None
            _note(f'{what or url}: {first_line(e)}; retry {attempt + 1}/{RETRIES}')
            time.sleep(BACKOFF * 2 ** attempt)


def download(url, dest):
    """url → dest through dest.part, resumed after a cut (in this run or an earlier one)
    by a Range request with If-Range: the file's version (strong ETag or Last-Modified)
    in dest.part.json. A file that changed or has no version, or a server that ignores
    Range, starts from zero."""
    part = Path(f'{dest}.part')
    info = Path(f'{dest}.part.json')

    def fetch():
        try:
            seen = json.loads(info.read_text())
            have = part.stat().st_size if seen['validator'] and seen['total'] else 0
        except (OSError, ValueError, TypeError, KeyError):
            have = 0
        if have and have == seen['total']:   # complete, but not renamed yet
            return
        headers = dict(AGENT)
        if have:
            headers |= {'Range': f'bytes={have}-', 'If-Range': seen['validator']}
        with urlopen(Request(url, headers=headers), timeout=60) as resp, open(part, 'ab') as f:
            if resp.status != 206:   # the whole file: it (and its version) from the start
                if have:
                    _note(f'{url}: the file changed on the server, or the server ignores Range: '
                          'downloading it from the start')
                f.seek(0)
                f.truncate()
                etag = resp.headers.get('ETag', '')
                seen = {'validator': etag, 'total': resp.length}
                if etag[:2] in ('', 'W/'):   # a weak ETag cannot guard a Range
                    seen['validator'] = resp.headers['Last-Modified']
                write_atomic(info, json.dumps(seen))
            shutil.copyfileobj(resp, f, 1 << 20)
            if seen['total'] and f.tell() < seen['total']:   # a cut: the retry resumes it
                raise http.client.IncompleteRead(b'', seen['total'] - f.tell())

    if not dest.exists():
        common.make_folder(dest.parent)
        print(f'download {url} -> {dest}')
        _retrying(url, fetch)
        os.replace(part, dest)
        info.unlink(missing_ok=True)
    return dest


def _sha256(path):
    """A file's SHA-256, in hex."""
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


def archive_problem(path, size=None, sha256=None):
    """Why a downloaded file cannot be read, or None: its size or SHA-256 not the ones the
    server lists (where it lists them), a zip member that fails its CRC, a parquet file
    without its footer (cut short)."""
    import zipfile
    import zlib
    if size is not None and path.stat().st_size != size:
        return f'{path.stat().st_size:,} bytes, not the {size:,} listed'
    if sha256 and _sha256(path) != sha256:
        return 'its SHA-256 is not the one listed'
    try:
        if path.suffix == '.zip':
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad:
                return f'{bad} in it fails its CRC check'
        elif path.suffix == '.parquet':
            import pyarrow.parquet as pq
            pq.ParquetFile(path).close()
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as e:
        if getattr(e, 'errno', None):   # the OS's own error: common.main says it
            raise
        return first_line(e)
    return None


def fetched(fetch, check=archive_problem):
    """A download checked before it is read: fetch(again) → its path; a file that fails
    `check` (→ why, or None) is removed and fetched again, once; failing twice, one
    UserError line naming it."""
    path = Path(fetch(False))
    for again in (True, False):
        why = check(path)
        if why is None:
            return path
        path.resolve().unlink(missing_ok=True)   # (a cache's link: its file, then the link)
        path.unlink(missing_ok=True)
        _note(f'{path}: damaged ({why}); removed')
        if again:
            path = Path(fetch(True))
    raise UserError(f'{path}: damaged again when fetched again ({why}); removed. The file on '
                    'the server may be damaged: fetch it by hand and use --input')


def text_pieces(f, label, encoding):
    """A binary file of UTF-8 → (text, separator) pieces of about CHUNK characters, cut at
    line ends; a giant line at its last space or ASCII punctuation (what cleaning makes a
    space), inside a word only where it has none; text and separators are the file's own.
    Bytes are read as Latin-1, a character per byte. A NUL byte means binary: refused
    (file_pieces refuses non-UTF-8)."""
    def blocks():   # the file's bytes, checked before they are decoded
        while raw := f.read(CHUNK):
            if 0 in raw:
                raise UserError(f'{label} looks binary (a NUL byte); expected UTF-8 text '
                                '(UTF-16 files must be converted first)')
            yield raw

    buf = ''
    for text in codecs.iterdecode(blocks(), _DECODING[encoding]):
        buf += text
        # cut after the last line end, the separator; a giant line after its last break, the
        # break itself the separator; without one, a giant word: the whole buffer, joined to
        # the next piece with nothing between
        end = buf.rfind('\n') + 1
        if not end and len(buf) > CHUNK:
            end = len(buf) + 1
            if last_break := _LAST_BREAK.match(buf):
                end = last_break.end()
        if end:
            yield buf[:end - 1], buf[end - 1:end]
            buf = buf[end:]
    if buf:
        yield buf, ''


def file_pieces(path, encoding, stream=None):
    """(text, separator) pieces of a .txt/.zip/.xz/.parquet file, or of `stream` named
    `path` (cc-100's response), read for encoding (text_pieces). Downloads are checked
    before (fetched): what fails here is the text's own fault, or a cut stream's."""
    import lzma
    import zipfile
    label = str(path)
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == '.parquet':
            import pyarrow.parquet as pq
            for batch in pq.ParquetFile(path).iter_batches(columns=['text'], batch_size=256):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield text.encode().decode(_DECODING[encoding]), '\n'
        elif suffix == '.zip':
            with zipfile.ZipFile(path) as z:
                for member in sorted(n for n in z.namelist() if not n.endswith('/')):
                    with z.open(member) as fb:
                        yield from text_pieces(fb, f'{label}:{member}', encoding)
        else:
            opener = lzma.open if suffix == '.xz' else open
            with opener(stream or path, 'rb') as fb:
                yield from text_pieces(fb, label, encoding)
    except Exception as e:   # bad data or a cut stream; the OS's own errors, UserErrors pass on
        said_by_os = getattr(e, 'errno', None) and stream is None   # (common.main says it)
        damaged = isinstance(e, (zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError,
                                 http.client.HTTPException, UnicodeDecodeError))
        if said_by_os or not (damaged or type(e).__module__.startswith('pyarrow')):
            raise
        fix = ''
        if stream:
            fix = '; re-run to fetch it again'
        raise UserError(f'{label}: corrupt, cut short or not UTF-8 text '
                        f'({first_line(e)}){fix}') from None


def encode(path, pieces, cap, alphabet, dtype, lang, encoding, what='the splits'):
    """Writes the token ids of (text, separator) pieces to path, up to `cap` of them →
    their count, a progress line for `what` every PROGRESS characters read. lang:
    cleaned for it, every cleaned line, the last one too, ending with a newline; text
    whose letters mostly fall outside lang's alphabet is refused
    (cleaning.foreign_letters, on its first MiB of characters). Otherwise the text as it
    is (NFC for "chars", whose ids are code points until index_chars)."""
    lut = np.arange(0x110000, dtype=np.int32)
    if alphabet:
        lut = np.full(0x110000, -1, dtype=np.int32)
        lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
    n = 0
    pending = ''
    sample = '' if lang else None   # raw text until its letters are checked
    with open(path, 'wb') as f:
        def put(text):   # → False once the cap is reached
            nonlocal n
            if cap is not None:
                text = text[:cap - n]
            ids = lut[np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)]
            if (ids < 0).any():  # only reachable without cleaning (text8)
                raise UserError(f'text8 input holds {text[int(np.argmax(ids < 0))]!r}, not in '
                                'a-z/space; use --lang en for other English text')
            try:
                f.write(ids.astype(dtype).tobytes())
            except OSError as e:   # named by its file (a full disk, a file-size limit)
                raise OSError(e.errno, e.strerror, str(path)) from None
            n += len(ids)
            return cap is None or n < cap
        for text, sep in _reporting(pieces, what):
            if sample is not None and len(sample) < 1 << 20:
                sample += text
            elif sample:
                _refuse_foreign(sample, lang)
                sample = None
            if lang:
                text = clean(text, lang)
            if lang and sep not in ('', '\n'):   # what cleaning makes of the break
                sep = ' '
            if encoding == 'chars':
                text = unicodedata.normalize('NFC', text)
            if text:
                if n or not lang:
                    text = pending + text
                pending = sep
                if not put(text):
                    break
            elif not lang:
                pending += sep
            elif sep == '\n' or (sep == ' ' and not pending):
                pending = sep  # the strongest separator since the last text
        else:
            if lang and n:
                put('\n')
            elif encoding != 'paper':   # the input's last separator, as it is
                put(pending)
    if sample:
        _refuse_foreign(sample, lang)
    return n


def _reporting(pieces, what):
    """(text, separator) pieces passed on, with a progress line for `what` every PROGRESS
    characters read."""
    read = 0
    for text, sep in pieces:
        if (read + len(text)) // PROGRESS > read // PROGRESS:
            _note(f'{what}: {read + len(text):,} characters read')
        read += len(text)
        yield text, sep


def _refuse_foreign(text, lang):
    """One UserError line where the first MiB of characters of raw text is likely not lang."""
    why = foreign_letters(text[:1 << 20], lang)
    if why:
        raise UserError(f'the input text: {why}')


def _ids(path, dtype):   # a .bin's token ids, memory-mapped (numpy cannot map an empty file)
    if os.path.getsize(path):
        return np.memmap(path, dtype=dtype, mode='r')
    return np.zeros(0, dtype)


def input_roles(paths):
    """Several --input files → [train files, valid files, test files], each file in the
    split its name says (train, valid, dev or validation, test), all three present; else
    refused in one line. One file (or none) → None: it is cut 90/5/5."""
    if len(paths) < 2:
        return None
    groups = {s: [] for s in SPLITS}
    how = ('several --input files keep the splits their names say: name each *train*, *valid* '
           '(or *dev*) or *test*, all three present, or give one file to be cut 90/5/5')
    for path in paths:
        roles = [s for s in SPLITS if s in path.name.lower().replace('dev', 'valid')]
        if len(roles) != 1:
            said = ' and '.join(roles) or 'no split'
            raise UserError(f'--input {path}: its name says {said}; {how}', 2)
        groups[roles[0]].append(path)
    for split, files in groups.items():
        if not files:
            raise UserError(f'--input: no file named *{split}*; {how}', 2)
    return list(groups.values())


def _by_split(out, groups, caps, codec):
    """Each split's .bin from its group of (text, separator) iterators, up to its cap."""
    for split, cap, group in zip(SPLITS, caps, groups):
        pieces = itertools.chain.from_iterable(group)
        write_atomic(out / f'{split}.bin', lambda tmp: encode(tmp, pieces, cap, **codec,
                                                              what=split))


def _one_stream(out, pieces, cap, codec, eval_cap=None):
    """One stream cut into the splits: 90% train, 5% valid, 5% test in that order (text8,
    --input); with eval_cap (cc-100): valid and test first, so that a capped stream fills
    them."""
    tmp = out / '.all.bin'   # (a fixed name: the run holds the folder's lock)
    try:
        total = encode(tmp, pieces, cap, **codec)
        each = total // 20
        order = SPLITS
        if eval_cap:   # valid and test whole where the stream was capped or is long enough
            order = ('valid', 'test', 'train')
            if total >= min(cap, 20 * eval_cap):
                each = eval_cap
        data = _ids(tmp, codec['dtype'])
        at = 0
        for split in order:
            n = total - 2 * each if split == 'train' else each
            write_atomic(out / f'{split}.bin', data[at:at + n].tofile)
            at += n
        del data
    finally:
        tmp.unlink(missing_ok=True)


def _wiki40b(args, out, caps, codec):
    """The official splits of wiki40b's <lang> parquet shards, through huggingface_hub
    (its settings HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN; its cache, resumed
    downloads); a shard is fetched only while its split's cap is not reached, and checked
    against the listed size and SHA-256 → (the shards read, the split rule)."""
    from huggingface_hub import HfApi
    api = HfApi()
    sources = []

    def listing():
        tree = api.list_repo_tree(WIKI40B, path_in_repo=args.lang, repo_type='dataset')
        return {Path(f.path): f for f in tree if f.path.endswith('.parquet')}

    def shard(path):
        name = path.as_posix()
        listed = files[path]
        sha256 = listed.lfs and listed.lfs.sha256

        def fetch(again):
            return _retrying(api.endpoint, lambda: api.hf_hub_download(
                WIKI40B, name, repo_type='dataset', force_download=again), what=name)
        sources.append(f'hf://datasets/{WIKI40B}/{name}')
        return file_pieces(fetched(fetch, lambda p: archive_problem(p, listed.size, sha256)),
                           args.encoding)

    files = _retrying(api.endpoint, listing, what=f'{api.endpoint}: {WIKI40B}/{args.lang}')
    # train-*, validation-*, test-*: split by name as --input files are
    groups = [map(shard, names) for names in input_roles(sorted(files))]
    _by_split(out, groups, caps, codec)
    return sources, 'official wiki40b splits, capped'


def _make_splits(args, out, codec):
    """train/valid/test.bin from the source → (what was read, the split rule)."""
    train_cap = args.max_train_chars
    eval_cap = args.max_eval_chars
    caps = (train_cap, eval_cap, eval_cap)
    encoding = args.encoding
    if args.roles:
        groups = [[file_pieces(f, encoding) for f in files] for files in args.roles]
        _by_split(out, groups, caps, codec)
        return args.input, 'official (input files named train/valid/test)'
    # text8 and enwik8 are taken whole: 90M / 5M / 5M of the full files
    whole = args.dataset in WHOLE_FILES
    if args.input or whole:
        cap = None
        if not whole:
            cap = int(train_cap / 0.9)
        sources = args.input or [_url(args)]
        path = sources[0]
        if not args.input:   # the download, checked
            dest = out / 'download' / f'{args.dataset}.zip'
            path = fetched(lambda again: download(sources[0], dest))
        _one_stream(out, file_pieces(path, encoding), cap, codec)
        return sources, '90% train / 5% valid / 5% test, in order'
    if args.dataset == 'wiki40b':
        return _wiki40b(args, out, caps, codec)
    # cc-100: streamed; a cut stream ends the run, and the next one starts again
    url = _url(args)
    with _retrying(url, lambda: urlopen(Request(url, headers=AGENT), timeout=60)) as resp:
        _one_stream(out, file_pieces(url, encoding, stream=resp), train_cap + 2 * eval_cap, codec,
                    eval_cap)
    return [url], f'first {eval_cap} valid, next {eval_cap} test, then train'


def _url(args):
    """The download of text8, enwik8 or cc-100 (for --lang)."""
    if args.dataset == 'cc100':
        return f'{args.cc100_base}/{args.lang}.txt.xz'
    return getattr(args, f'{args.dataset}_url')


def index_chars(out):
    """"chars": the splits' code points → ids of the alphabet ['\ufffd'] + the train split's
    sorted characters; characters train lacks → 0 → (alphabet, dtype)."""
    chars = np.unique(_ids(out / 'train.bin', 'uint32'))
    chars = chars[chars != 0xFFFD]   # the unknown character's own id is 0
    dtype = 'uint8'
    if len(chars) >= 256:
        dtype = 'uint16'
    if len(chars) >= 1 << 16:
        raise UserError(f'{len(chars)} distinct characters in the train split: too many for '
                        'uint16 ids; use --bytes')
    # code point → id: 1, 2, ... for the train split's characters in order, 0 for others
    ids = np.zeros(0x110000, dtype)
    ids[chars] = np.arange(1, len(chars) + 1)
    for split in SPLITS:
        points = np.fromfile(out / f'{split}.bin', dtype='uint32')
        write_atomic(out / f'{split}.bin', ids[points].tofile)
    return ['\ufffd'] + [chr(c) for c in chars], dtype


def splits(args, out, codec, key, inputs):
    """train/valid/test.bin, unless a run with these options and input made them →
    .splits.json. The three are a set: a run that fails or is stopped while making them
    keeps none."""
    path = out / '.splits.json'
    stamp = None
    done = False
    try:
        stamp = json.loads(path.read_text(encoding='utf-8'))
        done = stamp['key'] == key and stamp['inputs'] == inputs and all(
            len(_ids(out / f'{s}.bin', stamp['dtype'])) == stamp['sizes'][s] for s in SPLITS)
    except (OSError, ValueError, TypeError, KeyError):
        pass   # none, unreadable or incomplete: made again
    if done and not args.force:
        print(f'splits done in {out}, skipping (--force redoes)')
        return stamp
    if stamp and not args.force:
        _note(f'{out}: other options or input, or incomplete: rebuilding it')
    for f in [out / 'meta.json', path, *out.glob('*unigram-*')]:
        f.unlink(missing_ok=True)  # outputs of an earlier run go before the new ones are made
    try:
        sources, rule = _make_splits(args, out, codec)
        sources = list(map(str, sources))
        sizes = {s: len(_ids(out / f'{s}.bin', codec['dtype'])) for s in SPLITS}
        if why := split_problem(sizes):   # what no run could train on is not kept
            raise UserError(f'{", ".join(sources)}: too little text: {why}')
        alphabet = codec['alphabet']
        dtype = codec['dtype']
        if alphabet is None:
            alphabet, dtype = index_chars(out)
    except BaseException:
        for s in SPLITS:
            (out / f'{s}.bin').unlink(missing_ok=True)
        raise
    stamp = dict(key=key, inputs=inputs, sizes=sizes, source=sources, rule=rule,
                 alphabet=alphabet, dtype=dtype)
    # ASCII JSON with escapes: a file name that is not UTF-8 (a surrogate escape) is kept whole
    write_atomic(path, json.dumps(stamp, indent=1))
    return stamp


# The paper's released tokenizer settings; fitted on the word counts of the whole train
# split.
UNIGRAM_SETTINGS = dict(model_type='unigram', add_dummy_prefix=True, max_sentencepiece_length=16,
                        split_digits=True, split_by_whitespace=True, split_by_unicode_script=True,
                        remove_extra_whitespaces=True, normalization_rule_name='identity',
                        input_format='tsv', bos_id=-1, eos_id=-1, max_sentence_length=1 << 16,
                        minloglevel=2, num_threads=4)
# SentencePiece's C++ loop holds off Ctrl-C until training ends (minutes on a large
# split): it trains in a child in a session of its own, which this process kills at once
# on Ctrl-C. On Linux the child also dies with this process however that ends (SIGTERM,
# SIGKILL): prctl(PR_SET_PDEATHSIG, SIGKILL), and its parent checked once that is set.
_FIT = """
import ctypes, io, json, os, sys
import sentencepiece as spm
try:
    ctypes.CDLL(None).prctl(1, 9)
except AttributeError:
    pass
if os.getppid() != int(sys.argv[2]):
    sys.exit(1)
model = io.BytesIO()
rows = sys.stdin.buffer.read().decode().split("\\n")
spm.SentencePieceTrainer.train(sentence_iterator=iter(rows), model_writer=model,
                               **json.loads(sys.argv[1]))
sys.stdout.buffer.write(model.getvalue())
"""


def split_words(path, meta, what, block=1 << 21):
    """A split's words ('' between two separators: ASCII whitespace, the only
    whitespace bytes that UTF-8 has) by blocks, a progress line for `what` every PROGRESS
    characters: (words, closed); not closed: the split's last word, where no separator
    follows."""
    data = _ids(path, meta['dtype'])
    chars = np.array([ord(c) for c in meta['alphabet']], '<u4')
    blocks = ((chars[data[i:i + block]].tobytes().decode('utf-32-le'), '')
              for i in range(0, len(data), block))
    carry = ''
    for text, _ in _reporting(blocks, what):
        words = _SEPARATOR.split(carry + text)
        carry = words.pop()  # maybe cut by the block's end: it goes on in the next block
        yield words, True
    if carry:
        yield [carry], False


def as_text(word, encoding):
    """A word as SentencePiece sees it, and where each of its characters ends in the
    word's units (bytes of "bytes": the last byte of the character; a byte that is not
    UTF-8 is a character of its own)."""
    ends = range(1, len(word) + 1)
    if encoding == 'bytes':
        word = word.encode('latin-1').decode('utf-8', 'surrogateescape')
        sizes = [len(c.encode('utf-8', 'surrogateescape')) for c in word]
        ends = list(itertools.accumulate(sizes))
    # SentencePiece's whitespace mark ▁ and a byte that is not UTF-8: U+FFFD, one for one
    return re.sub('[\u2581\udc80-\udcff]', '\ufffd', word), ends


def word_labels(sp, words, encoding='paper'):
    """{word: in-word labels}, a byte per unit: 1 at the last unit of every piece but the
    last (the space after the word closes it). Pieces of "▁word" (dummy prefix), the ▁
    dropped. words: a list or set (read twice)."""
    out = {}
    shown = [as_text(w, encoding) for w in words]
    encoded = sp.encode([text for text, _ in shown], out_type=str)
    for w, (text, ends), pieces in zip(words, shown, encoded):
        if pieces:   # the dummy prefix's ▁ dropped
            pieces[0] = pieces[0].removeprefix('\u2581')
        pieces = [p for p in pieces if p]
        lab = bytearray(len(w))
        for end in itertools.accumulate(len(p) for p in pieces[:-1]):
            lab[ends[end - 1] - 1] = 1
        out[w] = bytes(lab)
    return out


def _write_labels(out, V, model, meta):
    """{split}.unigram-V.bin: per character, 1 where a piece of `model` ends (the separator
    after a word closes it), each word's labels found once → the count of ones per split."""
    ones = dict.fromkeys(SPLITS, 0)
    labels = {}
    for split in SPLITS:
        def write(tmp):
            with open(tmp, 'wb') as f:
                for ws, closed in split_words(out / f'{split}.bin', meta,
                                              f'unigram-{V} labels of {split}'):
                    labels.update(word_labels(model, set(ws) - labels.keys(), meta['encoding']))
                    chunk = b''.join(labels[w] + b'\x01' for w in ws)
                    if not closed:   # the split's end closes its last word
                        chunk = chunk[:-2] + b'\x01'
                    ones[split] += chunk.count(1)
                    f.write(chunk)
        write_atomic(out / f'{split}.unigram-{V}.bin', write)
    return ones


def _fit(V, rows, letters, coverage):
    """SentencePiece's Unigram-V fitted on rows (word<TAB>count) in a child process → its
    model; a size it refuses is one UserError line in its words."""
    kw = dict(UNIGRAM_SETTINGS, vocab_size=V, required_chars=letters, character_coverage=coverage)
    command = [sys.executable, '-c', _FIT, json.dumps(kw), str(os.getpid())]
    # each letter once more as a word of its own: letters the text lacks get a piece
    text = '\n'.join(rows + [f'{c}\t1' for c in letters])
    # (subprocess.run kills the child on any exception, Ctrl-C's too, and waits for it)
    child = subprocess.run(command, input=text.encode(), capture_output=True,
                           start_new_session=True)
    if child.returncode:   # a size too large for the text, or too small for the alphabet
        said = (child.stderr.decode(errors='replace').strip().splitlines() or ['?'])[-1]
        raise UserError(f'--unigram {V}: {said.removeprefix("RuntimeError: ")} (SentencePiece)')
    return child.stdout


def make_unigram(out, meta, V):
    """Fits Unigram-V on the train word counts, writes its labels (b_t = 1 where a piece
    ends; whitespace closes the word before it), the model last → its set's meta.json
    entry."""
    import sentencepiece as spm
    encoding = meta['encoding']
    words = Counter()
    for ws, _ in split_words(out / 'train.bin', meta, f'unigram-{V} word counts'):
        words.update(ws)
    del words['']   # (between two separators)
    counts = Counter()
    for w, n in words.items():
        counts[as_text(w, encoding)[0]] += n
    rows = [f'{w}\t{n}' for w, n in counts.most_common()]
    _note(f'unigram-{V}: training SentencePiece on {len(rows):,} train words')
    # the paper's alphabet is small and every letter of it gets a piece, seen in train or
    # not; the characters of text as it is can outnumber V (SentencePiece's default
    # coverage leaves the rarest out)
    letters = ''
    coverage = 0.9995
    if encoding == 'paper':
        letters = ''.join(c for c in meta['alphabet'] if c not in ' \n')
        coverage = 1.0
    proto = _fit(V, rows, letters, coverage)
    ones = _write_labels(out, V, spm.SentencePieceProcessor(model_proto=proto), meta)
    write_atomic(out / f'unigram-{V}.model', proto)  # last: it completes the set
    # (a split's end closes its last word: every split has a 1)
    sf = {s: round(meta['sizes'][s] / ones[s], 4) for s in SPLITS}
    return {'vocab_size': V, 'shortening_factor': sf}


def unigram(args, out, meta):
    """The label sets of the meta.json there (a damaged one refused), and Unigram-V unless
    made; the last made is the default → meta.json's "unigram" and "unigram_sets"."""
    old = {}
    if (out / 'meta.json').exists():
        old = read_meta(out)
    sets = {u['vocab_size']: u for u in (old.get('unigram_sets') or {}).values()}
    default = old.get('unigram') and old['unigram']['vocab_size']
    V = args.unigram
    if V in sets:
        print(f'unigram-{V} done, skipping (--force redoes the whole dataset)')
    elif V:
        sets[V] = make_unigram(out, meta, V)
        default = V
    if default not in sets:   # (none was made, or a hand-edited default)
        default = max(sets, default=None)
    return {'unigram': sets.get(default), 'unigram_sets': {str(V): sets[V] for V in sorted(sets)}}


def prepare(args, out, lang, inputs):
    """The dataset in out: splits (kept when done), Unigram labels, meta.json last."""
    alphabet = TEXT8_ALPHABET
    dtype = 'uint8'
    if args.encoding == 'bytes':
        alphabet = [chr(i) for i in range(256)]
    elif args.encoding == 'chars':
        alphabet = None   # index_chars makes it from the train split
        dtype = 'uint32'
    elif lang:
        alphabet = ['\n', ' '] + list(LANGS[lang]['letters'])
    codec = dict(alphabet=alphabet, dtype=dtype, lang=lang, encoding=args.encoding)
    # everything that decides the text of the splits: recorded in .splits.json, compared by
    # re-runs ("lang" the --lang given; the one cleaned for goes into meta.json's "cleaning")
    key = settings(args, inputs)
    stamp = splits(args, out, codec, key, inputs)
    alphabet = stamp['alphabet']
    ids = {c: i for i, c in enumerate(alphabet)}
    defaults = {}
    if args.lang:
        defaults = {k: LANGS[args.lang][k] for k in ('unigram', 'prior')}
    meta = {'name': out.name, 'dataset': args.dataset, 'lang': args.lang,
            'encoding': args.encoding, 'alphabet': alphabet, 'vocab_size': len(alphabet),
            'space_id': ids.get(' '), 'newline_id': ids.get('\n'), 'dtype': stamp['dtype'],
            'sizes': stamp['sizes'], 'source': stamp['source'],
            'cleaning': {**key, 'lang': lang, 'split': stamp['rule']}, 'inputs': inputs,
            'defaults': defaults}
    meta.update(unigram(args, out, meta))
    meta['settings'] = dict(key, unigram=(meta['unigram'] or {}).get('vocab_size', 0))
    meta['extent'] = extent(args, meta)
    meta['whitespace_shortening_factor'] = whitespace_sf(out, meta)
    write_atomic(out / 'meta.json', json.dumps(meta, indent=1))
    _report(out, meta)
    return meta


def settings(args, inputs=None):
    """What decides the text of the splits, as dataset.recorded_settings reads it: recorded
    in .splits.json (compared by re-runs) and meta.json."""
    # (inputs: None, or describe_inputs' list of one file or more)
    return dict(dataset=args.dataset, lang=args.lang, encoding=args.encoding,
                input=inputs and [f['path'] for f in inputs],
                **{cap: getattr(args, cap) for cap in CAPS})


def extent(args, meta):
    """What the dataset is of its source → {"whole": whether it is a whole dataset of the
    paper, "what": it in words}: text8 and enwik8 whole at 100,000,000 characters (bytes);
    wiki40b and cc-100 downloaded at the default caps; else a slice, or other text."""
    total = sum(meta['sizes'].values())
    noun = 'character'
    if args.encoding == 'bytes':
        noun = 'byte'
    source = ', '.join(meta['source'])
    whole = not args.input and all(getattr(args, cap) >= CAPS[cap] for cap in CAPS)
    what = f'{total:,} {noun}s of {args.dataset}-{args.lang} (capped)'
    if args.dataset in WHOLE_FILES:
        whole = total == WHOLE
        what = f'a {total:,}-{noun} slice of {args.dataset} made from {source}'
    elif args.input:
        what = f'{total:,} {noun}s of text made from {source}'
    if whole:
        what = f'the whole {args.dataset}'
    return dict(whole=whole, what=what)


def whitespace_sf(out, meta):
    """Each split's whitespace shortening factor, its tokens per space (null without
    spaces): what --boundary whitespace shortens it by."""
    sf = dict.fromkeys(SPLITS)
    for split in SPLITS:
        ids = _ids(out / f'{split}.bin', meta['dtype'])
        # (a Python int: numpy's would make the factor print as np.float64(...) in _report)
        spaces = sum(int(np.count_nonzero(ids[i:i + CHUNK] == meta['space_id']))
                     for i in range(0, len(ids), CHUNK))
        if spaces:
            sf[split] = round(len(ids) / spaces, 4)
    return sf


def _report(out, meta):
    """The dataset in a few lines: what it is, its sizes, its shortening factors."""
    print(f"\n== {out} ==\ndataset {meta['dataset']}, lang {meta['lang']}, {meta['encoding']}, "
          f"vocab {meta['vocab_size']} ({meta['dtype']}), split: {meta['cleaning']['split']}")
    print(f"{unit(meta)}s: {meta['sizes']}; {meta['extent']['what']}")
    print(f"whitespace shortening factor: {meta['whitespace_shortening_factor']}")
    for V, u in meta['unigram_sets'].items():
        print(f"unigram-{V} shortening factor: {u['shortening_factor']}")


def _matching(pattern, what):
    """Argument type: a string that `pattern` matches whole, or an error saying it is not
    `what`."""
    def parse(s):
        if re.fullmatch(pattern, s):
            return s.rstrip('/')
        raise argparse.ArgumentTypeError(f'{s!r} is not {what}')
    return parse


def parser():
    p = common.Parser(prog='prepare_data.py', allow_abbrev=False, description=(
        'Download, clean, split and encode data for dynpool. Without --dataset, --lang, --input, '
        'the dataset in --out-dir/--name is made as it was (labels need only --name, --unigram).'))
    url = _matching(r'https?://[^/\s]+.*', 'an http(s) URL')
    unigram_defaults = ', '.join(f"{k} {v['unigram']}" for k, v in sorted(LANGS.items()))
    p.add_argument('--dataset', choices=DATASETS,
                   help='source to download (default text8; wiki40b with --lang; none with '
                   '--input and --lang, --bytes or --chars)')
    p.add_argument('--lang', choices=sorted(LANGS), help='its alphabet and digit names '
                   '(cleaning.LANGS); default en for text8, needed for the others')
    p.add_argument('--input', nargs='+', type=Path, metavar='FILE',
                   help='.txt/.zip/.xz/.parquet file(s), not a download (default): one is cut '
                   '90/5/5; several keep the split each name says (*train*, *valid* or *dev*, '
                   '*test*; all three), else are refused')
    encoding = p.add_mutually_exclusive_group()
    encoding.add_argument('--bytes', action='store_true',
                          help='raw UTF-8 bytes, vocab 256, no cleaning (default off; enwik8 '
                          'always)')
    encoding.add_argument('--chars', action='store_true',
                          help="the text as it is (NFC): its train split's characters, no "
                          'cleaning (default off)')
    p.add_argument('--name', type=_matching(r'(?!\.\.?$)[^/\0]+', "a folder name (no '/', "
                                            'not . or ..)'),
                   help='folder under --out-dir (default text8, wiki40b-<lang>, cc100-<lang>, '
                   'input-<lang>)')
    p.add_argument('--out-dir', type=Path, default=Path('data'),
                   help='parent of --name (default data)')
    p.add_argument('--max-train-chars', type=int_range(1, 10 ** 12),
                   help='cap on cleaned train characters (default 400M)')
    p.add_argument('--max-eval-chars', type=int_range(1, 10 ** 12),
                   help='cap on cleaned valid and test characters each (default 2M)')
    p.add_argument('--unigram', type=int_range(0, 10 ** 6),
                   help='SentencePiece Unigram size V of the boundary labels; sizes already made '
                   'are kept, the same V with other settings replaced (default '
                   f'{unigram_defaults}; 0: none made, those present kept)')
    p.add_argument('--force', action='store_true',
                   help='redo finished steps, not downloads (default off)')
    p.add_argument('--text8-url', type=url,
                   default='http://mattmahoney.net/dc/text8.zip',
                   help='(default http://mattmahoney.net/dc/text8.zip)')
    p.add_argument('--enwik8-url', type=url,
                   default='http://mattmahoney.net/dc/enwik8.zip',
                   help='(default http://mattmahoney.net/dc/enwik8.zip)')
    p.add_argument('--cc100-base', type=url,
                   default='https://data.statmt.org/cc-100',
                   help='holds <lang>.txt.xz (default https://data.statmt.org/cc-100)')
    return p


def resolve(args):
    """Fills in what the flags leave open, in one place (an existing dataset's recorded
    source, language, encoding, input and options where none of --dataset, --lang,
    --input, --bytes, --chars is given; else the defaults) and checks them together →
    (dataset folder, language cleaned with: None for text8 and text as it is)."""
    if args.dataset == 'enwik8' and args.chars:
        raise UserError('--dataset enwik8 is bytes; --chars does not apply', 2)
    encoding = 'paper'
    if args.bytes or args.dataset == 'enwik8':
        encoding = 'bytes'
    elif args.chars:
        encoding = 'chars'
    # the source: --dataset, else one's own text, else wiki40b for --lang, else text8
    dataset = 'text8'
    if args.lang:
        dataset = 'wiki40b'
    if args.input and (args.lang or encoding != 'paper'):
        dataset = 'input'
    dataset = args.dataset or dataset
    out = args.out_dir / (args.name or default_name(dataset, args.lang, encoding))
    old = recorded_settings(out) or {}
    # none of --dataset, --lang, --input, --bytes, --chars given (--bytes or --chars: an
    # encoding other than the paper's)
    if old and not (args.dataset or args.lang or args.input or encoding != 'paper'):
        dataset = old['dataset']
        encoding = old['encoding']
        args.lang = old['lang']
        args.input = old['input'] and list(map(Path, old['input']))
    for flag, default in CAPS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, old.get(flag, default))
    if dataset in WHOLE_FILES:
        if args.lang not in (None, 'en'):
            raise UserError(f'{dataset} is English; got --lang {args.lang}', 2)
        args.lang = 'en'
    if args.lang is None and (dataset != 'input' or encoding == 'paper'):
        raise UserError(f'--dataset {dataset} needs --lang', 2)
    args.dataset = dataset
    args.encoding = encoding
    if args.unigram is None:
        args.unigram = LANGS.get(args.lang, {}).get('unigram', 0)
    args.roles = input_roles(args.input or [])
    if dataset == 'text8' or encoding != 'paper':
        return out, None
    return out, args.lang


def describe_inputs(paths):
    """Each --input file's path, size and SHA-256 (an edit in place is noticed), or
    None."""
    inputs = []
    for given in paths or []:
        # checked as given: a pipe's /dev/stdin resolves to a name that is no file
        if given.exists() and not (given.is_file() or given.is_dir()):  # reading would block
            raise UserError(f'input file {given}: not a regular file (a pipe or device?): '
                            'save the text to a file and name that')
        path = given.resolve()
        inputs.append(dict(path=str(path), size=path.stat().st_size, sha256=_sha256(path)))
    return inputs or None


def remove_leftovers(out):
    """A killed run's temporary files in the dataset folder, removed under the lock before
    anything is made, so that none outlives the next run: .all.bin, and
    write_atomic's .<stem>.<8 random characters><suffix> of the files this script
    writes there (only those: the folder may hold other hidden files)."""
    for f in [*out.glob('.*'), *out.glob('download/.*')]:
        if LEFTOVER.fullmatch(f.name) and f.is_file():
            f.unlink()


def offline_howto(args, out, error):
    """The one line for a failed download: what failed, and the two commands that need no
    network: this dataset's own (its settings, dataset.prepare_command) from the files
    fetched by hand, or from any text of one's own."""
    if args.dataset == 'wiki40b':
        what = f'the {args.lang}/*.parquet shards of {WIKI40B} (a dataset on the Hugging Face hub)'
        files = 'train-*.parquet validation-*.parquet test-*.parquet'
    else:
        what = _url(args)
        files = Path(what).name
    command = prepare_command(data=out, settings=dict(settings(args), unigram=args.unigram))
    # (the file names last and unquoted: shell-safe names, the shards a pattern for the shell)
    return (f'download failed: {error}. Without network, fetch {what} by hand into the current '
            f'folder and run: {command} --input {files}; or prepare text of your own: '
            f'{command} --input FILE')


def run(argv=None):
    """prepare_data.py's work → the meta.json dict it wrote."""
    if argv is not None:
        argv = [str(a) for a in argv]
    args = parser().parse_args(argv)
    out, lang = resolve(args)
    inputs = describe_inputs(args.input)
    made = [f for f in [out, *out.parents] if not f.exists()]   # deepest first
    try:
        with common.locked(out, 'the run preparing it'):
            try:
                remove_leftovers(out)
                return prepare(args, out, lang, inputs)
            except BaseException:
                unmake(out, made)
                raise
    except DownloadError as e:
        raise UserError(offline_howto(args, out, e)) from None


def unmake(out, made):
    """After a failure, under the lock: the folders this run made (`made`, out and its
    parents) removed where nothing is in them but the lock and empty folders, so that no
    empty dataset folder outlives it (a cut download's .part stays, to be resumed)."""
    if not made or [f for f in out.rglob('*') if not f.is_dir()] != [out / '.lock']:
        return
    (out / '.lock').unlink()
    for folder in [*sorted(out.rglob('*'), reverse=True), *made]:
        try:
            folder.rmdir()
        except OSError:   # not empty: another run's, or a user's
            return


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.stdout.reconfigure(errors='surrogateescape')   # a path that is not UTF-8: its own bytes
    sys.exit(main())
