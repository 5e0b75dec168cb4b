"""Tests of prepare_data.py and cleaning.py: cleaning rules, encoding and Unigram labels on real
text, downloads against a local HTTP server, bad input.

Run:   python -m pytest -q test_data.py   (real text from ../shared/data; else those tests skip)
"""

import hashlib
import http.server
import io
import json
import lzma
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import event, given, settings
from hypothesis import strategies as st

import cleaning
import common
import dataset
import prepare_data
from conftest import HYPOTHESIS_FIXTURES, assert_cli_contract, no_hang, run_main, shared_data
from cleaning import LANGS, clean


# ==================================================================================================
# DATA: cleaning rules, encoding and Unigram labels on real text, downloads, bad input
# (formerly test_prepare_data.py)
# ==================================================================================================

_DATA_SETTINGS = settings(
    deadline=None, max_examples=60, derandomize=bool(os.environ.get('CI')), database=None
)
_DATA_NIQQUD = [chr(c) for c in range(0x591, 0x5C8) if unicodedata.category(chr(c)) == 'Mn']
_DATA_MARKERS = ['_START_ARTICLE_', '_START_SECTION_', '_START_PARAGRAPH_', '_NEWLINE_']


def _data_text(lang):
    """Arbitrary Unicode mixed with the language's letters (both cases), digits, marks, markers."""
    letters = LANGS[lang]['letters']
    own = st.sampled_from(
        list(letters + letters.upper() + "0123456789 \n\t.,'-\u05be") + _DATA_NIQQUD
    )
    return st.lists(
        st.one_of(
            st.text(st.one_of(st.characters(), own), max_size=30), st.sampled_from(_DATA_MARKERS)
        )
    ).map(''.join)


def _data_decode(d, split, meta):
    ids = np.fromfile(d / f'{split}.bin', dtype=meta['dtype'])
    return ''.join(meta['alphabet'][i] for i in ids)


def _data_segments(text, labels):
    segs, start = [], 0
    for i in np.flatnonzero(labels):
        segs.append(text[start : i + 1])
        start = i + 1
    return segs, text[start:]


def _data_fail(argv, capsys, out=None):
    """Runs main expecting a clean failure: exit code != 0, one `error:` line, last, no traceback,
    and nothing under out that looks finished."""
    code = prepare_data.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err and err[-1].startswith('error: ')
    assert sum(line.startswith('error:') for line in err) == 1 and 'Traceback' not in '\n'.join(err)
    if out is not None and Path(out).exists():
        names = [p.name for p in Path(out).rglob('*')]
        assert not [n for n in names if n == 'meta.json' or n.endswith('.bin')], names
        assert not _data_temps(out)
    return err[-1]


def _data_temps(d):
    """Temporary files left under d: write_atomic's hidden names (.train.x1y2.bin), .part."""
    return [
        p
        for p in Path(d).rglob('*')
        if p.name.endswith(('.tmp', '.part'))
        or p.name.startswith('.')
        and p.name not in ('.lock', '.splits.json', '.bin')
    ]


def _data_slice(name, dst, nbytes=200_000):
    """The whole lines in the first `nbytes` of ../shared/data/`name`, written to dst."""
    raw = shared_data(name).read_bytes()[:nbytes]
    dst.write_bytes(raw[: raw.rfind(b'\n') + 1])
    return dst


# --- cleaning ---------------------------------------------------------------------------------


@pytest.mark.parametrize('lang', sorted(LANGS))
def test_data_clean_properties(lang):
    allowed = set(LANGS[lang]['letters']) | {' ', '\n'}

    @_DATA_SETTINGS
    @given(_data_text(lang))
    def check(text):
        out = clean(text, lang)
        assert set(out) <= allowed
        assert clean(out, lang) == out
        assert '  ' not in out and '\n\n' not in out
        assert all(line and line == line.strip(' ') for line in out.split('\n')) or out == ''
        assert not any(ch.isdigit() for ch in out)

    check()


def test_data_alphabets_are_the_papers():
    """The alphabets of the paper's cleaner: Vietnamese without f j w z and with 12 x 5
    precomposed tone-marked vowels; Hebrew with maqaf, geresh and gershayim."""
    for lang, L in LANGS.items():
        letters = L['letters']
        assert len(set(letters)) == len(letters) and ' ' not in letters and '\n' not in letters
        assert all(unicodedata.is_normalized('NFC', c) and len(c) == 1 for c in letters)
    assert LANGS['en']['letters'] == 'abcdefghijklmnopqrstuvwxyz'
    assert LANGS['fi']['letters'] == LANGS['en']['letters'] + 'åäö'
    vi = set(LANGS['vi']['letters'])
    assert not vi & set('fjwz') and set('ăâđêôơư') <= vi and len(vi) == 22 + 7 + 60
    toned = ('àáảãạ ằắẳẵặ ầấẩẫậ èéẻẽẹ ềếểễệ ìíỉĩị òóỏõọ ồốổỗộ ờớởỡợ ùúủũụ ừứửữự ỳýỷỹỵ').replace(
        ' ', ''
    )
    assert vi == set('abcdeghiklmnopqrstuvxy' + 'ăâđêôơư' + toned)
    he = LANGS['he']['letters']
    assert len(he) == 30 and {'\u05be', '\u05f3', '\u05f4'} <= set(he)
    assert all(unicodedata.name(c).startswith('HEBREW LETTER') for c in he[:27])


@_DATA_SETTINGS
@given(st.sampled_from(sorted(LANGS)), st.data())
def test_data_alphabet_letters_kept_others_split(lang, data):
    """Every letter of the alphabet (and its capital) survives; a character that is not a
    letter, digit or homoglyph of the alphabet splits the word, as in the paper (müller ->
    m ller), whatever the script."""
    letters = LANGS[lang]['letters']
    c = data.draw(st.sampled_from(letters))
    assert clean(f'a{c}{c.upper()}', lang).endswith(c + c)
    homo = cleaning.homoglyphs() if lang != 'he' else {}
    other = data.draw(
        st.characters(blacklist_categories=('Cs',)).filter(
            lambda o: (
                not set((homo.get(o, o)).lower()) & set(letters + '0123456789') and o not in 'İ\n'
            )
        )
    )
    w = letters[0]
    assert clean(f'{w}{other}{w}', lang) == f'{w} {w}'


@_DATA_SETTINGS
@given(
    st.sampled_from(sorted(LANGS)),
    st.integers(min_value=0, max_value=10**30),
    st.sampled_from(['', ' ', '-', '.', '\t']),
)
def test_data_clean_digits_spelled(lang, n, glue):
    words = LANGS[lang]['digits'].split()
    spelled = ' '.join(words[int(d)] for d in str(n))
    assert clean(str(n), lang) == spelled
    letter = LANGS[lang]['letters'][0]
    assert clean(f'{letter}{glue}{n}{glue}{letter}', lang) == f'{letter} {spelled} {letter}'


def test_data_clean_examples():
    assert (
        clean(
            '\n_START_ARTICLE_\nTitle\n_START_SECTION_\nA b\n_START_PARAGRAPH_\nOne._NEWLINE_Two',
            'en',
        )
        == 'title\na b\none\ntwo'
    )
    # the paper's pipeline: homoglyphs (Cyrillic а, fullwidth Ｆ, bold 𝐁) then lower case, and a
    # letter outside the alphabet becomes a space
    assert (
        clean('PаyPal Ｆull 𝐁old ２０ café Müller', 'en') == 'paypal full bold two zero caf m ller'
    )
    assert clean('Hyvää päivää, ÅLAND! café', 'fi') == 'hyvää päivää åland caf'
    assert (
        clean('Tru\u031bo\u031b\u0300ng ĐẠI học 2006 Wikipedia', 'vi')
        == 'trường đại học hai không không sáu ikipedia'
    )  # NFD composed first (fix); no w
    # Hebrew: no homoglyphs, niqqud splits the word as in the paper, digits spelled without
    # niqqud (fix), geresh/gershayim/maqaf kept
    assert clean('בְּרֵאשִׁית 12 בית־ספר צה״ל (INR)', 'he') == 'ב ר אש ית אחד שנים בית־ספר צה״ל'
    assert clean('İstanbul', 'en') == 'istanbul'  # fix: not "i stanbul"
    assert clean('  a \r\n\n\n b\t\u2028c  ', 'en') == 'a\nb c'


def test_data_homoglyph_map_covers_lookalikes():
    """The map comes from Unicode's confusables; it covers Cyrillic and Greek lookalikes,
    fullwidth and mathematical letters and digits, typographic quotes and dashes."""
    H = cleaning.homoglyphs()
    for src, dst in [
        ('аеорсухіјѕԁһԛԝАВЕКМНОРСТХЈЅԜ', 'aeopcyxijsdhqwabekmhopctxjsw'),
        ('αονιρυΑΒΕΖΗΙΚΜΝΟΡΤΥΧ', 'aovipuabezhlkmnoptyx'),
    ]:
        assert ''.join(H[c].lower() for c in src) == dst

    # confusables' prototypes of 0, 1 and I are O, l and l (as in the paper's table); fullwidth
    # forms go through NFKC, so fullwidth digits stay digits
    def want(c, proto):
        n = unicodedata.normalize('NFKC', c)
        return proto.get(n, n).lower()

    fullwidth = (
        [chr(c) for c in range(0xFF10, 0xFF1A)]
        + [chr(c) for c in range(0xFF21, 0xFF3B)]
        + [chr(c) for c in range(0xFF41, 0xFF5B)]
    )
    assert all(H[c].lower() == want(c, {'I': 'l'}) for c in fullwidth)
    math = [
        chr(c)
        for c in range(0x1D400, 0x1D800)
        if unicodedata.normalize('NFKC', chr(c)).isalnum()
        and unicodedata.normalize('NFKC', chr(c)).isascii()
    ]
    ok = [c for c in math if H.get(c, '').lower() == want(c, {'0': 'O', '1': 'l', 'I': 'l'})]
    assert len(math) > 650 and len(ok) >= len(math) - 20  # the m-likes map to "rn", not one letter
    assert ''.join(H[c] for c in '𝐌𝐚𝐭𝐡𝟐𝟑') == 'Math23' and clean('𝐌𝐚𝐭𝐡𝟐𝟑', 'en') == 'math two three'
    assert {H[c] for c in '‘’‛′'} == {"'"} and {H[c] for c in '“”‟″'} == {"''"}
    assert {H[c] for c in '‐‑‒–−'} == {'-'}


# --- end to end on real text -------------------------------------------------------------------


@pytest.mark.parametrize('lang', sorted(LANGS))
def test_data_input_end_to_end(lang, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_data, 'CHUNK', 300)  # many pieces, long lines cut at a space
    src = _data_slice(f'raw/{lang}.txt', tmp_path / f'{lang}.txt', 80_000)
    argv = ['--input', src, '--lang', lang, '--out-dir', tmp_path / 'out', '--unigram', '300']
    meta = prepare_data.run([str(a) for a in argv])
    d = tmp_path / 'out' / f'input-{lang}'
    assert json.loads((d / 'meta.json').read_text()) == meta
    for key, typ in [
        ('name', str),
        ('dataset', str),
        ('lang', str),
        ('alphabet', list),
        ('vocab_size', int),
        ('space_id', int),
        ('newline_id', int),
        ('dtype', str),
        ('sizes', dict),
        ('source', list),
        ('cleaning', dict),
        ('unigram', dict),
        ('unigram_sets', dict),
        ('defaults', dict),
    ]:
        assert isinstance(meta[key], typ), key
    assert (
        meta['alphabet'][:2] == ['\n', ' ']
        and meta['vocab_size'] == len(meta['alphabet'])
        and meta['dtype'] == 'uint8'
    )
    text = {s: _data_decode(d, s, meta) for s in ('train', 'valid', 'test')}
    raw = src.read_text(encoding='utf-8')
    assert text['train'] + text['valid'] + text['test'] == clean(raw, lang) + '\n'
    n = sum(map(len, text.values()))
    assert len(text['valid']) == len(text['test']) == n // 20

    assert meta['defaults'] == {
        'unigram': LANGS[lang]['unigram'],
        'prior': 0.37 if lang == 'fi' else 0.2,
    }
    uni = meta['unigram']
    assert meta['unigram_sets'] == {'300': uni} and uni['vocab_size'] == 300
    sp = spm.SentencePieceProcessor(model_file=str(d / 'unigram-300.model'))
    dummy = '\u2581'
    # the paper's max_sentencepiece_length
    assert max(len(sp.id_to_piece(i).removeprefix(dummy)) for i in range(len(sp))) <= 16
    for split, t in text.items():
        labels = np.fromfile(d / f'{split}.unigram-300.bin', dtype=np.uint8)
        assert len(labels) == len(t) and set(np.unique(labels)) <= {0, 1} and labels[-1] == 1
        segs, rest = _data_segments(t, labels)
        assert ''.join(segs) == t and rest == ''
        codes = np.frombuffer(t.encode('utf-32-le'), dtype=np.uint32)
        assert labels[
            (codes == ord(' ')) | (codes == ord('\n'))
        ].all()  # whitespace => Unigram boundary
        first = True  # SentencePiece saw each word as ▁word: its first piece carries the ▁
        for seg in segs:
            word = seg[:-1] if seg[-1] in ' \n' else seg
            assert ' ' not in word and '\n' not in word
            assert (
                word == ''
                or (first and dummy + word in sp.id_to_piece(list(range(len(sp)))))
                or sp.piece_to_id(word) != sp.unk_id()
            ), seg
            first = seg[-1] in ' \n'
        assert uni['shortening_factor'][split] == pytest.approx(len(t) / labels.sum(), abs=1e-3)
    train = text['train']
    assert 1 < uni['shortening_factor']['train'] < len(train) / train.count(' ')

    if lang == 'en':  # a re-run skips both steps and changes nothing
        before = {
            p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in ('.bin', '.model')
        }
        capsys.readouterr()
        assert prepare_data.run([str(a) for a in argv]) == meta
        assert capsys.readouterr().out.count('skipping') == 2
        assert before == {
            p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in ('.bin', '.model')
        }


def test_data_text8_input_kept_as_is(tmp_path, capsys):
    raw = shared_data('text8-head.txt').read_text()[:200_000]
    (tmp_path / 't8.txt').write_text(raw)
    meta = prepare_data.run(
        [
            '--dataset',
            'text8',
            '--input',
            str(tmp_path / 't8.txt'),
            '--out-dir',
            str(tmp_path),
            '--unigram',
            '0',
        ]
    )
    d = tmp_path / 'text8'
    assert (
        meta['alphabet'] == [' '] + list('abcdefghijklmnopqrstuvwxyz') and meta['vocab_size'] == 27
    )
    assert meta['space_id'] == 0 and meta['newline_id'] is None and meta['dtype'] == 'uint8'
    assert meta['sizes'] == {'train': 180_000, 'valid': 10_000, 'test': 10_000}
    assert ''.join(_data_decode(d, s, meta) for s in ('train', 'valid', 'test')) == raw


# --- downloads against a local server ------------------------------------------------------------


class _DataHandler(http.server.BaseHTTPRequestHandler):
    """Files with an ETag (honouring Range and If-Range), and the two calls huggingface_hub
    makes: the tree listing of a dataset folder, and HEAD/GET of resolve/main/<file>."""

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        srv = self.server
        path = self.path.split('?')[0]
        srv.log.append((self.command, path, self.headers.get('Range')))
        m = re.match(r'/api/datasets/google/wiki40b/tree/main/(\w+)$', path)
        if m:
            tree = [
                {
                    'type': 'file',
                    'path': p[len('/datasets/google/wiki40b/resolve/main/') :],
                    'size': len(b),
                    'oid': hashlib.sha1(b).hexdigest(),
                    'lfs': {'oid': hashlib.sha256(b).hexdigest(), 'size': len(b),
                            'pointerSize': 134},
                }
                for p, b in srv.files.items()
                if p.startswith(f'/datasets/google/wiki40b/resolve/main/{m[1]}/')
            ]
            return self._send(
                200, json.dumps(tree).encode(), head, {'Content-Type': 'application/json'}
            )
        body = srv.files.get(path)
        if body is None:
            return self.send_error(404)
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        headers = {'ETag': etag, 'X-Repo-Commit': 'c' * 40} if srv.etags else {}
        rng, if_range = self.headers.get('Range'), self.headers.get('If-Range')
        if rng and srv.ranges and (if_range is None or if_range == etag):
            start = int(rng.split('=')[1].split('-')[0])
            if start >= len(body):
                return self._send(416, b'', head, {'Content-Range': f'bytes */{len(body)}'})
            headers['Content-Range'] = f'bytes {start}-{len(body) - 1}/{len(body)}'
            return self._send(206, body[start:], head, headers, flaky=path in srv.flaky)
        self._send(200, body, head, headers, flaky=path in srv.flaky and not head)

    def _send(self, code, payload, head, headers, flaky=False):
        self.send_response(code)
        for k, v in {**headers, 'Content-Length': str(len(payload))}.items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        if flaky:  # first attempt: the connection drops midway
            self.server.flaky.discard(self.path.split('?')[0])
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def _data_server(monkeypatch):
    monkeypatch.setattr(prepare_data, 'RETRIES', 2)   # retried at once, not after seconds
    monkeypatch.setattr(prepare_data, 'BACKOFF', 0)
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _DataHandler)
    srv.files, srv.flaky, srv.log, srv.ranges, srv.etags = {}, set(), [], True, True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.base = f'http://127.0.0.1:{srv.server_address[1]}'
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize('ranges', [True, False])
def test_data_download_resumes(_data_server, tmp_path, ranges):
    body = np.random.default_rng(0).bytes(300_000)
    _data_server.files['/f.bin'], _data_server.ranges = body, ranges
    _data_server.flaky.add('/f.bin')
    dest = prepare_data.download(_data_server.base + '/f.bin', tmp_path / 'f.bin')
    assert dest.read_bytes() == body and not list(tmp_path.glob('f.bin.part*'))
    if ranges:  # the second request asked only for the missing half
        assert _data_server.log[-1] == ('GET', '/f.bin', f'bytes={len(body) // 2}-')
    # a killed run left a .part and its version: the next run continues it
    (tmp_path / 'g.bin.part').write_bytes(body[:1000])
    etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
    (tmp_path / 'g.bin.part.json').write_text(json.dumps({'validator': etag, 'total': len(body)}))
    prepare_data.download(_data_server.base + '/f.bin', tmp_path / 'g.bin')
    assert (tmp_path / 'g.bin').read_bytes() == body and _data_server.log[-1][2] == 'bytes=1000-'


@pytest.mark.parametrize('etags', [True, False])
def test_data_download_changed_on_server_not_spliced(_data_server, tmp_path, capsys, etags,
                                                     monkeypatch):
    """A .part cut from an old version of the file is not continued with the new one (If-Range
    with the ETag); a server that gives no version is never asked for a Range: from zero."""
    old, new = b'A' * 50_000, b'B' * (50_000 if etags else 60_000)
    _data_server.files['/f.bin'], _data_server.etags = old, etags
    _data_server.flaky.add('/f.bin')
    monkeypatch.setattr(prepare_data, 'RETRIES', 0)
    with pytest.raises(prepare_data.DownloadError):  # cut midway, no retries left
        prepare_data.download(_data_server.base + '/f.bin', tmp_path / 'f.bin')
    assert (tmp_path / 'f.bin.part').read_bytes() == old[:25_000]
    _data_server.files['/f.bin'] = new
    monkeypatch.setattr(prepare_data, 'RETRIES', 1)
    dest = prepare_data.download(_data_server.base + '/f.bin', tmp_path / 'f.bin')
    assert dest.read_bytes() == new and not list(tmp_path.glob('f.bin.part*'))
    if etags:
        assert 'changed on the server' in capsys.readouterr().err
    else:
        assert _data_server.log[-1] == ('GET', '/f.bin', None)


def _data_zip(text):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w', zipfile.ZIP_DEFLATED) as z:
        z.writestr('text8', text)
    return buf.getvalue()


def test_data_text8_download(_data_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_data, 'CHUNK', 1000)  # text8 is one line: it is cut at spaces
    words = np.random.default_rng(1).choice(['the', 'cat', 'sat', 'on', 'a', 'mat'], 6000)
    text = ' ' + ' '.join(words)
    _data_server.files['/text8.zip'] = _data_zip(text)
    _data_server.flaky.add('/text8.zip')
    argv = [
        '--text8-url',
        _data_server.base + '/text8.zip',
        '--out-dir',
        str(tmp_path),
        '--unigram',
        '0',
    ]
    meta = prepare_data.run(argv)
    d = tmp_path / 'text8'
    n = len(text)
    assert meta['sizes'] == {'train': n - 2 * (n // 20), 'valid': n // 20, 'test': n // 20}
    assert ''.join(_data_decode(d, s, meta) for s in ('train', 'valid', 'test')) == text
    assert meta['source'] == [_data_server.base + '/text8.zip'] and meta['unigram'] is None
    assert (d / 'download' / 'text8.zip').exists() and not list(d.rglob('*.part*'))
    requests = len(_data_server.log)
    prepare_data.run(argv)  # finished: no network needed again
    assert len(_data_server.log) == requests and 'skipping' in capsys.readouterr().out
    # a corrupt archive in the download folder (Bad CRC-32): checked before use, removed and
    # fetched again in the same run
    z = bytearray((d / 'download' / 'text8.zip').read_bytes())
    z[len(z) // 2] ^= 0xFF
    (d / 'download' / 'text8.zip').write_bytes(bytes(z))
    capsys.readouterr()
    assert prepare_data.run(argv + ['--force'])['sizes'] == meta['sizes']
    assert 'text8.zip: damaged' in capsys.readouterr().err
    assert _data_server.log[-1] == ('GET', '/text8.zip', None)
    assert (d / 'download' / 'text8.zip').read_bytes() == _data_server.files['/text8.zip']
    # the server's own file damaged: fetched twice, then one line naming it, nothing kept
    _data_server.files['/text8.zip'] = bytes(z)
    (d / 'download' / 'text8.zip').write_bytes(bytes(z))
    msg = _data_fail(argv + ['--force'], capsys, d)
    assert 'text8.zip: damaged again' in msg and '--input' in msg
    assert not (d / 'download' / 'text8.zip').exists()


def _data_wiki40b_docs():
    return {
        split: [
            f'\n_START_ARTICLE_\n{split.title()} {i}\n_START_PARAGRAPH_\nIn {1990 + i} the '
            f'café opened._NEWLINE_It is Ｂig.'
            for i in range(30)
        ]
        for split in ('train', 'validation', 'test')
    }


def _data_hub(srv):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _data_wiki40b_docs()
    for split, texts in docs.items():
        buf = io.BytesIO()
        pq.write_table(pa.table({'wikidata_id': ['Q1'] * len(texts), 'text': texts}), buf)
        srv.files[f'/datasets/google/wiki40b/resolve/main/en/{split}-00000-of-00001.parquet'] = (
            buf.getvalue()
        )
    srv.files['/datasets/google/wiki40b/resolve/main/en/README.md'] = b'not a shard'
    return docs


def _data_hub_run(srv, tmp_path, *argv):
    """prepare_data.py as typed, in a fresh interpreter (one catches a submodule of
    huggingface_hub used but not imported), the hub found through the library's own settings."""
    env = dict(os.environ, HF_ENDPOINT=srv.base, HF_HUB_CACHE=str(tmp_path / 'hf-cache'))
    return subprocess.run([sys.executable, prepare_data.__file__, *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_data_wiki40b_through_huggingface_hub(_data_server, tmp_path, monkeypatch):
    """A fake hub on 127.0.0.1 named by HF_ENDPOINT: huggingface_hub lists the shards and
    downloads them into the cache HF_HUB_CACHE names; a shard damaged in the cache is noticed
    (its listed SHA-256) and fetched again; the same shards by hand through --input keep their
    splits."""
    docs = _data_hub(_data_server)
    argv = ['--lang', 'en', '--unigram', '0', '--max-train-chars', '500']
    r = _data_hub_run(_data_server, tmp_path, *argv)
    assert r.returncode == 0, r.stderr
    d = tmp_path / 'data' / 'wiki40b-en'
    meta = json.loads((d / 'meta.json').read_text())
    assert (
        meta['name'] == 'wiki40b-en' and meta['dataset'] == 'wiki40b' and len(meta['source']) == 3
    )
    assert meta['source'][0] == 'hf://datasets/google/wiki40b/en/train-00000-of-00001.parquet'
    full_train = '\n'.join(clean(t, 'en') for t in docs['train']) + '\n'
    assert _data_decode(d, 'train', meta) == full_train[:500]
    assert (
        _data_decode(d, 'valid', meta)
        == '\n'.join(clean(t, 'en') for t in docs['validation']) + '\n'
    )
    assert _data_decode(d, 'test', meta).startswith(
        'test zero\nin one nine nine zero the caf opened\nit is big\n'
    )
    shards = sorted((tmp_path / 'hf-cache').rglob('snapshots/*/en/*.parquet'))
    assert len(shards) == 3 and not any('README' in p for _, p, _ in _data_server.log)
    # a capped download is not the paper's wiki40b-en, and says so
    total = sum(meta['sizes'].values())
    what = f'{total:,} characters of wiki40b-en (capped)'
    assert meta['extent'] == {'whole': False, 'what': what}
    assert 'wiki40b-en (capped)' in r.stdout
    monkeypatch.chdir(tmp_path)
    why = dataset.paper_data_problem('data/wiki40b-en')
    assert 'capped' in why and why.endswith('python prepare_data.py --dataset wiki40b --lang en')
    # a shard damaged in the cache (same size, other bytes): removed and fetched again
    blob = shards[0].resolve()
    blob.write_bytes(blob.read_bytes()[::-1])
    r = _data_hub_run(_data_server, tmp_path, *argv, '--force')
    assert r.returncode == 0 and 'SHA-256' in r.stderr, r.stderr
    assert json.loads((d / 'meta.json').read_text())['sizes'] == meta['sizes']
    # the same shards by hand: --input keeps their splits (named train/validation/test)
    manual = prepare_data.run(
        [
            '--dataset',
            'wiki40b',
            '--lang',
            'en',
            '--input',
            *map(str, shards),
            '--name',
            'manual',
            '--out-dir',
            str(tmp_path),
            '--unigram',
            '0',
            '--max-train-chars',
            '500',
        ]
    )
    assert manual['sizes'] == meta['sizes'] and manual['cleaning']['split'].startswith('official')


def test_data_cc100_stream(_data_server, tmp_path, capsys):
    lines = [f'Line {i}: Hello World, the stream goes on.' for i in range(3000)]
    _data_server.files['/en.txt.xz'] = lzma.compress('\n'.join(lines).encode())
    _data_server.flaky.add('/en.txt.xz')
    argv = [
            '--dataset',
            'cc100',
            '--lang',
            'en',
            '--cc100-base',
            _data_server.base,
            '--out-dir',
            str(tmp_path),
            '--unigram',
            '0',
            '--max-eval-chars',
            '300',
            '--max-train-chars',
            '2000',
        ]
    msg = _data_fail(argv, capsys, tmp_path / 'cc100-en')   # cut midway: no mid-stream resume
    assert 'en.txt.xz' in msg and 'cut short' in msg and 're-run' in msg
    meta = prepare_data.run(argv)
    d = tmp_path / 'cc100-en'
    want = clean('\n'.join(lines[:200]), 'en')
    assert meta['sizes'] == {'train': 2000, 'valid': 300, 'test': 300}
    got = ''.join(_data_decode(d, s, meta) for s in ('valid', 'test', 'train'))
    assert got == want[:2600]
    assert meta['extent']['whole'] is False and dataset.paper_data_problem(d)
    # at the default caps, a download is the paper's dataset: nothing to say
    meta = prepare_data.run(argv[:6] + ['--out-dir', tmp_path / 'whole', '--unigram', '0'])
    assert meta['extent'] == {'whole': True, 'what': 'the whole cc100'}
    assert dataset.paper_data_problem(tmp_path / 'whole' / 'cc100-en') is None


def test_data_server_down_names_url(_data_server, tmp_path, capsys):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    url = f'http://127.0.0.1:{port}/text8.zip'
    msg = _data_fail(
        ['--text8-url', url, '--out-dir', tmp_path],
        capsys,
        tmp_path,
    )
    assert url in msg and '--input' in msg
    msg = _data_fail(
        ['--text8-url', _data_server.base + '/missing.zip', '--out-dir', tmp_path], capsys, tmp_path
    )
    assert '404' in msg and '/missing.zip' in msg  # a 404 is not retried


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'case',
    [
        'empty',
        'binary',
        'not-utf8',
        'bad-zip',
        'missing',
        'unknown-lang',
        'out-dir-is-file',
    ],
)
def test_data_bad_input(case, tmp_path, capsys):
    f, lang, out = tmp_path / 'in.txt', 'en', tmp_path / 'out'
    contents = {
        'empty': b'',
        'binary': np.random.default_rng(0).bytes(5000) + b'\x00',
        'not-utf8': bytes(range(0x80, 0x100)) * 40,
        'unknown-lang': b'Hallo Welt\n',
        'out-dir-is-file': b'hello\n',
        'missing': None,
    }
    if case == 'bad-zip':
        f = tmp_path / 'in.zip'
        f.write_bytes(b'PK\x03\x04 definitely not a zip')
    elif contents[case] is not None:
        f.write_bytes(contents[case])
    if case == 'unknown-lang':
        lang = 'de'
    if case == 'out-dir-is-file':
        out = f / 'sub'
    msg = _data_fail(
        ['--input', f, '--lang', lang, '--out-dir', out, '--unigram', '0'], capsys, out
    )
    expect = {
        'empty': 'too little text',
        'binary': 'binary',
        'not-utf8': 'not UTF-8',
        'bad-zip': 'corrupt',
        'missing': 'No such file',
        'unknown-lang': "choose from 'en', 'fi', 'he', 'vi'",
        'out-dir-is-file': 'Not a directory',
    }[case]
    assert expect in msg


def test_data_write_failure_leaves_nothing(tmp_path):
    """A write the OS refuses midway (here a file-size limit, as a full disk would): one line,
    exit 1, and no split, meta.json or temporary file left behind."""
    import resource

    f, out = tmp_path / 'in.txt', tmp_path / 'out'
    f.write_text('hello world\n' * 20_000)

    def limit():  # files may grow to 100 kB; SIGXFSZ ignored so the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    r = subprocess.run(
        [
            sys.executable,
            str(Path(prepare_data.__file__)),
            '--input',
            str(f),
            '--lang',
            'en',
            '--out-dir',
            str(out),
            '--unigram',
            '0',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    _data_one_line(r, 1, 'File too large')
    names = [p.name for p in out.rglob('*')]
    assert not [n for n in names if n == 'meta.json' or n.endswith('.bin')] and not _data_temps(
        out
    ), names


def test_data_cli_exit_code_and_one_line(tmp_path):
    f = tmp_path / 'in.txt'
    f.write_text('hello\n')
    r = subprocess.run(
        [
            sys.executable,
            str(Path(prepare_data.__file__)),
            '--input',
            str(f),
            '--lang',
            'xx',
            '--out-dir',
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count('\n') == 1
    assert (
        r.stderr.startswith("error: argument --lang: invalid choice: 'xx'")
        and "'en', 'fi'" in r.stderr
    )


# --- faults through the real CLI (issue 10): exit code, one error line, what is left on disk -----


def _data_cli(*argv, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, str(Path(prepare_data.__file__)), *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _data_one_line(r, code, *words):
    """Exit code `code`, stderr one `error:` line naming `words`, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, r.stderr
    assert len(lines) == 1 and lines[0].startswith('error: ') and 'Traceback' not in r.stderr, (
        r.stderr
    )
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def _data_main(argv, capsys):
    """main() as the CLI runs it: (exit code, stdout, stderr); 0 when it returns."""
    try:
        code = prepare_data.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


@pytest.mark.parametrize(
    'argv,words',
    [
        (['--text8-url', 'notaurl'], ['--text8-url', 'not an http(s) URL']),
        (['--cc100-base', 'ftp://x', '--dataset', 'cc100', '--lang', 'en'], ['--cc100-base']),
        (['--unigram', 'many'], ['--unigram', "'many'"]),
        (['--name', 'a/b'], ['--name', 'folder name']),
        (['--bogus'], ['unrecognized arguments: --bogus']),
    ],
)
def test_data_cli_bad_flags_one_line_exit_2(tmp_path, capsys, argv, words):
    _data_one_line(_data_main(argv + ['--out-dir', tmp_path], capsys), 2, *words)
    assert not list(tmp_path.iterdir())  # refused before anything is written


def test_data_cli_tiny_input_is_an_error(tmp_path, capsys):
    (tmp_path / 'in.txt').write_text('hi\n')
    r = _data_main(
        [
            '--input',
            tmp_path / 'in.txt',
            '--lang',
            'en',
            '--out-dir',
            tmp_path / 'out',
            '--unigram',
            '0',
        ],
        capsys,
    )
    _data_one_line(r, 1, 'too little text', 'in.txt', 'too few for a run')
    assert not (tmp_path / 'out').exists()  # the folders it made, lock and all, removed


def test_data_cli_input_edited_in_place_is_noticed(tmp_path, capsys):
    """Same path, same size, same mtime, other text: the SHA-256 in the fingerprint notices it."""
    f, out = tmp_path / 'in.txt', tmp_path / 'out'
    f.write_text('the cat sat on the mat\n' * 50)
    argv = ['--input', f, '--lang', 'en', '--out-dir', out, '--unigram', '0']
    assert _data_main(argv, capsys).returncode == 0
    d = out / 'input-en'
    meta = json.loads((d / 'meta.json').read_text())
    assert meta['inputs'][0]['size'] == f.stat().st_size and len(meta['inputs'][0]['sha256']) == 64
    st = f.stat()
    f.write_text('the dog sat on the log\n' * 50)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = _data_main(argv, capsys)
    assert r.returncode == 0 and 'rebuilding' in r.stderr and 'skipping' not in r.stdout
    assert _data_decode(d, 'train', json.loads((d / 'meta.json').read_text())).startswith('the dog')


def test_data_cli_other_options_never_mix(tmp_path, capsys):
    """A dataset prepared with one cap is never mixed with another: the run with the other
    option rebuilds the splits (and drops labels made from the old ones) and records it; the
    same options again skip."""
    f, out = tmp_path / 'in.txt', tmp_path / 'out'
    f.write_text('Café Müller opened in 1990.\n' * 40)
    argv = ['--input', f, '--lang', 'en', '--out-dir', out]
    assert _data_main(argv + ['--unigram', '30'], capsys).returncode == 0
    d = out / 'input-en'
    meta = json.loads((d / 'meta.json').read_text())
    assert meta['cleaning']['max_train_chars'] == 400_000_000 and meta['sizes']['train'] > 900
    r = _data_main(argv + ['--unigram', '0', '--max-train-chars', '500'], capsys)
    meta = json.loads((d / 'meta.json').read_text())
    assert r.returncode == 0 and 'rebuilding' in r.stderr
    assert meta['cleaning']['max_train_chars'] == 500 and meta['sizes']['train'] < 600
    assert _data_decode(d, 'train', meta).startswith('caf m ller opened')
    assert meta['unigram_sets'] == {} and not list(d.glob('*unigram*'))
    r = _data_main(argv + ['--unigram', '0', '--max-train-chars', '500'], capsys)
    assert r.returncode == 0 and 'skipping' in r.stdout


def _data_fitting(tmp_path):
    """prepare_data.py started on text8-style text long to fit Unigram on (~20 s), once its
    SentencePiece child runs → (the process, its out dir, the child's pid)."""
    # 150k random words, no cleaning (text8): training outlasts the wait below by far (~20 s)
    rng, letters = np.random.default_rng(0), np.array(list('abcdefghijklmnopqrstuvwxyz'))
    src = tmp_path / 'words.txt'
    src.write_text(' ' + ' '.join(''.join(rng.choice(letters, rng.integers(3, 10)))
                                  for _ in range(150_000)))
    out = tmp_path / 'out'
    p = subprocess.Popen(
        [
            sys.executable,
            str(Path(prepare_data.__file__)),
            '--input',
            str(src),
            '--dataset',
            'text8',
            '--out-dir',
            str(out),
            '--unigram',
            '8000',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in p.stderr:  # wait until the training has begun
        if 'training SentencePiece' in line:
            break
    children = Path(f'/proc/{p.pid}/task/{p.pid}/children')
    kid = None
    for _ in range(100):  # and its process (if any) is up: then SentencePiece is running
        kids = children.read_text().split() if children.exists() else []
        kid = next((k for k in kids if Path(f'/proc/{k}/cmdline').exists()
                    and b'SentencePieceTrainer' in Path(f'/proc/{k}/cmdline').read_bytes()), None)
        if kid:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    return p, out, kid


def test_data_cli_ctrl_c_during_unigram_training_stops_at_once(tmp_path):
    """SentencePiece's C++ loop holds off Python's Ctrl-C handler: training runs in a child
    process, so SIGINT ends the run without waiting for the fit: exit 130, splits kept, no
    model."""
    p, out, kid = _data_fitting(tmp_path)
    assert kid and p.poll() is None, 'prepare_data.py finished before Ctrl-C: give it more text'
    # the fit frozen first: a run that waited for it to end would never end, so the event
    # tested is the run ending with its fit unfinished; the limit only stops a hang (ending
    # takes killing a child and removing temporary files)
    os.kill(int(kid), signal.SIGSTOP)
    try:
        p.send_signal(signal.SIGINT)
        _, rest = p.communicate(timeout=60)
    finally:
        p.kill()
        if Path(f'/proc/{kid}').exists():
            os.kill(int(kid), signal.SIGKILL)
    lines = rest.strip().splitlines()
    assert p.returncode == 130, (p.returncode, rest)
    assert (
        len(lines) == 1 and lines[0].startswith('error: interrupted') and 'Traceback' not in rest
    ), rest
    d = out / 'text8'
    assert (d / 'train.bin').exists() and (d / '.splits.json').exists()
    assert not (d / 'meta.json').exists() and not list(d.glob('*unigram*')) and not _data_temps(d)
    _data_lock_free(d)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='PR_SET_PDEATHSIG: Linux only')
def test_data_unigram_fit_dies_with_its_parent(tmp_path):
    """The SentencePiece child (in a session of its own) does not go on fitting once
    prepare_data.py is killed outright (SIGKILL: no handler runs), as after a power cut's
    or a scheduler's kill."""
    p, _, kid = _data_fitting(tmp_path)
    assert kid and p.poll() is None, 'prepare_data.py finished before the kill'
    p.kill()
    p.communicate(timeout=60)
    for _ in range(100):
        stat = Path(f'/proc/{kid}/stat')
        if not stat.exists() or stat.read_text().rsplit(')', 1)[1].split()[0] in 'ZX':
            break
        time.sleep(0.05)
    else:
        os.kill(int(kid), signal.SIGKILL)
        pytest.fail('the SentencePiece child went on fitting after its parent was killed')


# --- the printed fixes, the offline quick start, locks (issues 18 and 19) -------------------------


def _data_run_printed(msg, cwd, before=None):
    """Runs the command after 'run: ' in msg exactly as printed, in a POSIX shell in cwd, where
    `python prepare_data.py` names this interpreter and this script (as in the repository root)."""
    m = re.search(r'run: (python prepare_data\.py[^;]*?)(?:; |\.?$)', msg)
    assert m, msg
    cwd, bindir = Path(cwd), Path(cwd) / '.bin'
    bindir.mkdir(exist_ok=True)
    (bindir / 'python').write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'
    )  # this venv's python
    (bindir / 'python').chmod(0o755)
    if not (cwd / 'prepare_data.py').exists():
        (cwd / 'prepare_data.py').symlink_to(prepare_data.__file__)
    if before:
        before()
    env = {**os.environ, 'PATH': f'{bindir}{os.pathsep}{os.environ["PATH"]}'}
    return subprocess.run(
        m[1], shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _data_words(n, seed=0):
    words = np.random.default_rng(seed).choice(
        ['the', 'cat', 'sat', 'on', 'a', 'mat', 'dog', 'ran'], n
    )
    return ' ' + ' '.join(words)


def test_data_text8_slice_is_the_default_dataset(tmp_path, capsys, monkeypatch):
    """--dataset text8 --input FILE without --name writes <out>/text8, the folder train.py reads
    by default; meta.json says which file it was made from."""
    text = _data_words(3000)
    (tmp_path / 'head.txt').write_text(text)
    meta = prepare_data.run(
        [
            '--dataset',
            'text8',
            '--input',
            str(tmp_path / 'head.txt'),
            '--out-dir',
            str(tmp_path / 'data'),
            '--unigram',
            '0',
        ]
    )
    d = tmp_path / 'data' / 'text8'
    assert meta['name'] == 'text8' and (d / 'meta.json').exists()
    assert meta['source'] == [str((tmp_path / 'head.txt').resolve())]
    # it says what it is: a slice, not the paper's text8, in meta.json and in the summary
    what = f'a {len(text):,}-character slice of text8 made from {meta["source"][0]}'
    assert meta['extent'] == {'whole': False, 'what': what} and what in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert dataset.paper_data_problem('data/text8') == (
        f"data/text8 is {what}; the paper's text8 is: python prepare_data.py --dataset text8")
    # each split's whitespace shortening factor: its characters per space
    for split in ('train', 'valid', 'test'):
        chars = _data_decode(d, split, meta)
        want = round(len(chars) / chars.count(' '), 4)
        assert meta['whitespace_shortening_factor'][split] == want


def test_data_progress_lines_while_reading_a_large_input(tmp_path):
    """A large input prints a progress line to stderr every 2^24 characters read; a small one
    none (the other tests' one-line stderr)."""
    words = np.random.default_rng(0).choice(['the', 'cat', 'sat', 'on', 'a', 'mat'], 6_000_000)
    (tmp_path / 'big.txt').write_text(' ' + ' '.join(words))
    r = subprocess.run([sys.executable, prepare_data.__file__, '--dataset', 'text8', '--input',
                        tmp_path / 'big.txt', '--out-dir', tmp_path, '--unigram', '0'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    read = re.findall(r'^the splits: ([\d,]+) characters read$', r.stderr, re.M)
    assert len(read) == 1 and int(read[0].replace(',', '')) >= 1 << 24, r.stderr


def test_data_suggested_remake_keeps_the_recorded_settings(tmp_path, capsys, monkeypatch):
    """A damaged byte dataset of its own name and caps: the command train.py's loader suggests
    rebuilds it with its recorded settings (--bytes, the input, the caps, the label size), run
    as printed; without meta.json, those of its splits (.splits.json)."""
    (tmp_path / 'he.txt').write_text(_data_varied_words(3000))
    argv = ['--input', tmp_path / 'he.txt', '--bytes', '--lang', 'he', '--name', 'hb',
            '--max-eval-chars', '900', '--unigram', '50']
    monkeypatch.chdir(tmp_path)
    meta = prepare_data.run(argv)
    d = Path('data/hb')
    (d / 'train.bin').write_bytes(b'x')
    with pytest.raises(common.UserError) as e:
        dataset.load_data(d, 'unigram')
    r = _data_run_printed(f'run: {str(e.value).split("remake the dataset with: ")[1]}', tmp_path)
    assert r.returncode == 0, r.stderr
    again = json.loads((d / 'meta.json').read_text())
    assert again['settings'] == meta['settings'] and again['sizes'] == meta['sizes']
    assert meta['settings']['encoding'] == 'bytes' and meta['settings']['unigram'] == 50
    (d / 'meta.json').unlink()
    words = shlex.split(dataset.prepare_command(data=d))
    assert words[words.index('--input') + 1] == meta['settings']['input'][0]
    assert {'--bytes', '--max-eval-chars', '--name'} <= set(words) and '--unigram' not in words


@pytest.mark.parametrize('encoding', ['paper', 'bytes', 'chars'])
def test_data_one_naming_rule_both_ways(encoding):
    """Every default dataset name: the command suggested for it by name alone makes that same
    folder (prepare_data.py's resolve reads the flags), so the rule runs one way only."""
    for source in [*dataset.DATASETS, 'input']:
        for lang in [None, *LANGS]:
            name = dataset.default_name(source, lang, encoding)
            words = shlex.split(dataset.prepare_command(data=Path('data') / name))[2:]
            needs_lang = source in ('wiki40b', 'cc100') or (source, encoding) == ('input', 'paper')
            if needs_lang and not lang:
                continue   # (these need a language; --input alone is text8)
            args = prepare_data.parser().parse_args(words)
            assert prepare_data.resolve(args)[0] == Path('data') / name, (words, name)


def test_data_same_input_by_another_path_is_the_same(tmp_path, capsys, monkeypatch):
    """Relative, absolute or through a symlink: the same file is the same input (splits kept)."""
    (tmp_path / 'in.txt').write_text('the cat sat on the mat\n' * 60)
    (tmp_path / 'link.txt').symlink_to(tmp_path / 'in.txt')
    monkeypatch.chdir(tmp_path)
    base = ['--lang', 'en', '--out-dir', 'out', '--unigram', '0']
    assert _data_main(['--input', 'in.txt', *base], capsys).returncode == 0
    for path in (tmp_path / 'in.txt', './link.txt'):
        r = _data_main(['--input', path, *base], capsys)
        assert (
            r.returncode == 0 and 'splits done' in r.stdout and 'input changed' not in r.stderr
        ), r.stderr


def _data_zip_file(path, text):
    path.write_bytes(_data_zip(text))


def test_data_unresolvable_host_fails_at_once_with_a_runnable_howto(tmp_path, capsys,
                                                                   monkeypatch):
    """No retries for a host that cannot be resolved (or refuses): the one error line gives the
    offline command, which runs as printed once the file is where it says."""
    out = tmp_path / 'data'
    argv = ['--text8-url', 'http://nonexistent.invalid/text8.zip', '--out-dir', out]
    monkeypatch.setattr(prepare_data, 'BACKOFF', 30)   # a retry would show as a wait
    r = _data_main(argv + ['--unigram', '0'], capsys)
    msg = _data_one_line(r, 1, 'nonexistent.invalid', 'download failed', '--input text8.zip')
    assert 'retry' not in r.stderr and not list(out.rglob('*.bin'))
    with socket.socket() as s:  # a port with nothing listening: refused, not retried either
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    r = _data_main(['--text8-url', f'http://127.0.0.1:{port}/text8.zip', '--out-dir', out],
                   capsys)
    _data_one_line(r, 1, 'Connection refused', '--input text8.zip')
    text = _data_words(2000)
    done = _data_run_printed(
        msg, tmp_path, before=lambda: _data_zip_file(tmp_path / 'text8.zip', text)
    )
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / 'text8' / 'meta.json').read_text())
    assert ''.join(_data_decode(out / 'text8', s, meta) for s in ('train', 'valid', 'test')) == text


def _data_lock_free(d):
    """Nobody holds d/.lock: the next run may take it."""
    import filelock

    with filelock.FileLock(d / '.lock', timeout=0):
        pass


def test_data_no_lock_left_behind(tmp_path, capsys, monkeypatch):
    """The run that holds <out>/.lock releases it however it ends: success, error, Ctrl-C (the
    finished steps kept, exit 130)."""
    f, out = tmp_path / 'in.txt', tmp_path / 'out'
    f.write_text('the cat sat on the mat\n' * 60)
    argv = ['--input', f, '--lang', 'en', '--out-dir', out, '--unigram', '0']
    assert _data_main(argv, capsys).returncode == 0
    _data_lock_free(out / 'input-en')
    f.write_text('the dog sat on the log\n' * 60)  # changed: rebuilt, and this time Ctrl-C strikes

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_data, 'splits', interrupted)
    assert _data_main(argv, capsys).returncode == 130
    assert (out / 'input-en').exists()
    _data_lock_free(out / 'input-en')

    def fault(*a):
        raise prepare_data.UserError('a fault')

    monkeypatch.setattr(prepare_data, 'splits', fault)
    assert _data_main(argv, capsys).returncode == 1
    _data_lock_free(out / 'input-en')


def test_data_refused_run_keeps_the_holders_lock(tmp_path, capsys):
    import fcntl

    d = tmp_path / 'out' / 'input-en'
    (tmp_path / 'in.txt').write_text('hello world\n' * 100)
    d.mkdir(parents=True)
    with open(d / '.lock', 'a+') as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = _data_main(
            ['--input', tmp_path / 'in.txt', '--lang', 'en', '--out-dir', tmp_path / 'out'], capsys
        )
        _data_one_line(r, 1, 'another process', str(d / '.lock'))
        assert sorted(p.name for p in d.iterdir()) == ['.lock']
        assert os.stat(d / '.lock').st_ino == os.fstat(held.fileno()).st_ino
    argv = ['--input', tmp_path / 'in.txt', '--lang', 'en', '--out-dir', tmp_path / 'out']
    assert _data_main(argv + ['--unigram', '0'], capsys).returncode == 0  # released: it runs


# --- flags and paths: checked as they are parsed ------------------------------------------------


@pytest.mark.parametrize(
    'argv,words',
    [
        (['--max-train-chars', '0'], ['--max-train-chars', '[1, 1000000000000]']),
        (['--max-train-chars', '-5'], ['--max-train-chars', '-5', '[1, 1000000000000]']),
        (['--max-eval-chars', '1.5'], ['--max-eval-chars', 'an integer', '1.5']),
        (['--unigram', '-3'], ['--unigram', '[0, 1000000]']),
        (['--bytes', '--chars'], ['--chars', 'not allowed with', '--bytes']),
        (['--dataset', 'enwik8', '--chars'], ['enwik8 is bytes']),
        (['--dataset', 'enwik8', '--lang', 'he'], ['enwik8 is English']),
        (['--dataset', 'wiki40b', '--bytes'], ['needs --lang']),
        (['--lang', 'xx'], ['--lang', "'xx'", "'en', 'fi', 'he', 'vi'"]),
        (['--lang', 'de'], ['--lang', "'de'", "'en', 'fi', 'he', 'vi'"]),
        (['--name', 'a/b'], ['--name', 'folder name']),
        (['--name', '..'], ['--name', 'folder name']),
        (['--dataset', 'text8', '--lang', 'fi'], ['text8 is English']),
        (['--dataset', 'cc100'], ['needs --lang']),
    ],
)
def test_data_flags_checked_at_parse_time(tmp_path, capsys, argv, words):
    _data_one_line(_data_main(argv + ['--out-dir', tmp_path / 'o'], capsys), 2, *words)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    'case',
    [
        'long-name',
        'too-deep-through-a-file',
        'deep-missing',
        'too-long',
        'folder',
        'fifo',
        'unreadable',
    ],
)
def test_data_bad_paths_one_line(case, tmp_path, capsys):
    f = tmp_path / 'in.txt'
    f.write_text('hello world\n' * 50)
    deep = Path(*['d'] * 25)
    flag, path = (
        '--input',
        {
            'long-name': tmp_path / ('x' * 300),
            'too-deep-through-a-file': f / deep / 'in.txt',
            'deep-missing': tmp_path / deep / 'in.txt',
            'too-long': tmp_path / Path(*['y' * 200] * 25),
            'folder': tmp_path,
            'fifo': tmp_path / 'fifo',
            'unreadable': tmp_path / 'secret.txt',
        }[case],
    )
    if case == 'fifo':
        os.mkfifo(path)
    if case == 'unreadable':
        if os.geteuid() == 0:
            pytest.skip('root reads files whatever their mode')
        path.write_text('hello\n')
        path.chmod(0)
    r = _data_main([flag, path, '--lang', 'en', '--out-dir', tmp_path / 'o'], capsys)
    line = _data_one_line(r, 1)  # the operating system's word for it, through common.main
    assert str(path)[:60] in line
    # the same path under --out-dir: a folder 25 levels deep is made; the others end in one line
    r = _data_main(
        [
            '--input',
            f,
            '--lang',
            'en',
            '--out-dir',
            f if case == 'folder' else path / 'o',
            '--unigram',
            '0',
        ],
        capsys,
    )
    if case == 'deep-missing':
        assert r.returncode == 0 and (path / 'o' / 'input-en' / 'meta.json').exists()
    else:
        assert (
            r.returncode in (1, 2)
            and len(r.stderr.strip().splitlines()) == 1
            and 'Traceback' not in r.stderr
        )
        assert (
            r.stderr.startswith('error: ') and str(f if case == 'folder' else path)[:60] in r.stderr
        )


def test_data_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(['--help'])
    shown = ' '.join(capsys.readouterr().out.split())
    for action in prepare_data.parser()._actions:
        if action.dest != 'help':
            assert 'default' in action.help and ' '.join(action.help.split()) in shown, (
                action.option_strings
            )


# --- Unigram label sets: added, kept, replaced, and always what meta.json says -------------------


def _data_varied_words(n, seed=0):
    """Text8-style text over a few hundred made-up words with Zipf-like frequencies."""
    rng = np.random.default_rng(seed)
    letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
    vocab = [''.join(rng.choice(letters, rng.integers(2, 9))) for _ in range(400)]
    p = 1 / np.arange(1, 401)
    return ' ' + ' '.join(rng.choice(vocab, n, p=p / p.sum()))


def _data_label_files(d):
    return sorted(p.name for p in d.iterdir() if 'unigram-' in p.name)


def _data_described(meta):
    """The label files meta.json's label sets stand for."""
    names = []
    for V in meta['unigram_sets']:
        names.append(f'unigram-{V}.model')
        names += [f'{s}.unigram-{V}.bin' for s in ('train', 'valid', 'test')]
    return sorted(names)


def test_data_unigram_sets_added_kept(tmp_path, capsys):
    f, out = tmp_path / 'head.txt', tmp_path / 'data'
    f.write_text(_data_varied_words(6000))
    base = ['--dataset', 'text8', '--input', f, '--out-dir', out, '--name', 'head']
    d = out / 'head'

    def run(*extra):
        r = _data_main(base + list(extra), capsys)
        assert r.returncode == 0, r.stderr
        meta = json.loads((d / 'meta.json').read_text())
        assert _data_label_files(d) == _data_described(
            meta
        )  # meta.json describes exactly what is there
        return r, meta

    _, meta = run('--unigram', '60')
    _, meta = run('--unigram', '80')
    assert sorted(meta['unigram_sets']) == ['60', '80'] and meta['unigram']['vocab_size'] == 80
    r, meta = run('--unigram', '0')  # none made, those present kept
    assert sorted(meta['unigram_sets']) == ['60', '80'] and meta['unigram']['vocab_size'] == 80
    r, meta = run('--unigram', '60')  # made already: skipped, nothing changed
    assert 'unigram-60 done, skipping' in r.stdout and meta['unigram']['vocab_size'] == 80
    assert sorted(meta['unigram_sets']) == ['60', '80']


def test_data_labels_added_by_the_printed_and_the_natural_commands(tmp_path, capsys):
    """The command a user would write adds labels to the existing splits: --name N --unigram V
    (the dataset's recorded source and options)."""
    f, out = tmp_path / 'head.txt', tmp_path / 'data'
    f.write_text(_data_varied_words(6000))
    prepare_data.run(
        [
            '--dataset',
            'text8',
            '--input',
            str(f),
            '--out-dir',
            str(out),
            '--name',
            'head',
            '--unigram',
            '0',
        ]
    )
    d = out / 'head'
    for argv, V in ((['--name', 'head', '--unigram', '70'], '70'),
                    (['--name', 'head', '--unigram', '50'], '50')):
        r = _data_main(argv + ['--out-dir', out], capsys)
        assert r.returncode == 0 and 'splits done' in r.stdout, r.stderr
        assert V in json.loads((d / 'meta.json').read_text())['unigram_sets']
    assert sorted(json.loads((d / 'meta.json').read_text())['unigram_sets']) == ['50', '70']


_DATA_META_EDITS = [
    (lambda m: {**m, 'unigram': 300}, ['"unigram" is 300']),
    (lambda m: {**m, 'unigram_sets': {'60': {**m['unigram_sets']['60'], 'vocab_size': '60'}}},
     ['"unigram_sets" is']),
    (lambda m: {**m, 'unigram_sets': [60]}, ['"unigram_sets" is [60]']),
    (lambda m: [m], ['not an object']),
]


def test_data_hand_edited_meta_is_one_line(tmp_path, capsys):
    f, out = tmp_path / 'head.txt', tmp_path / 'data'
    f.write_text(_data_varied_words(4000))
    argv = ['--dataset', 'text8', '--input', f, '--out-dir', out, '--unigram', '60']
    assert _data_main(argv, capsys).returncode == 0
    path = out / 'text8' / 'meta.json'
    good = json.loads(path.read_text())
    for edit, words in _DATA_META_EDITS:
        path.write_text(json.dumps(edit(good)))
        _data_one_line(_data_main(argv[:-1] + ['0'], capsys), 1, str(path), *words)


# --- the labels from SentencePiece's pieces ---------------------------------------------------


class _FakeSP:
    def __init__(self, pieces):
        self.pieces = pieces

    def encode(self, words, out_type=str):
        return [self.pieces[w] for w in words]


def test_data_word_labels_from_dummy_prefix_pieces():
    sp = _FakeSP(
        {
            'abc': ['\u2581', 'ab', 'c'],
            'abcd': ['\u2581ab', 'cd'],
            'x': ['\u2581x'],
            'xyz': ['\u2581', 'x', 'y', 'z'],
            'old': ['o', 'ld'],
        }
    )
    got = prepare_data.word_labels(sp, ['abc', 'abcd', 'x', 'xyz', 'old'])
    assert got == {
        'abc': b'\x00\x01\x00',
        'abcd': b'\x00\x01\x00\x00',
        'x': b'\x00',
        'xyz': b'\x01\x01\x00',
        'old': b'\x01\x00\x00',
    }


def test_data_unigram_size_refused_splits_kept(tmp_path, capsys):
    f, out = tmp_path / 'head.txt', tmp_path / 'data'
    f.write_text(_data_varied_words(3000))
    msg = _data_fail(
        ['--dataset', 'text8', '--input', f, '--out-dir', out, '--unigram', '5'], capsys
    )
    assert '--unigram 5' in msg and 'smaller than required_chars' in msg
    high = _data_fail(  # too large for the text: SentencePiece's words, the splits kept
        ['--dataset', 'text8', '--input', f, '--out-dir', out, '--unigram', '100000'], capsys
    )
    assert '--unigram 100000' in high and 'too high' in high and 'SentencePiece' in high
    assert (out / 'text8' / 'train.bin').exists() and not list(out.rglob('*unigram-100000*'))


# ---------------------------------------------------------------------------------------------
# The command-line contract under random flags and damaged datasets (fuzzed)
# ---------------------------------------------------------------------------------------------
_FUZZ_FLAGS = [
    '--dataset',
    '--lang',
    '--name',
    '--max-train-chars',
    '--max-eval-chars',
    '--unigram',
    '--bytes',
    '--chars',
    '--text8-url',
    '--hf-base',
]
_FUZZ_VALUES = [
    '0',
    '-5',
    '1',
    '7',
    '2.5',
    '1e309',
    'nan',
    'inf',
    '-inf',
    '99999999999999999999999',
    '',
    ' ',
    'x',
    'en',
    'de',
    'text8',
    'input',
    'http://127.0.0.1:9/x',
    'a\0b',
    'é' * 300,
]


def _fuzz_damage(meta, draw):
    """meta.json with one field deleted or given a value of another type."""
    key = draw(st.sampled_from(sorted(meta)))
    if draw(st.booleans()):
        del meta[key]
    else:
        meta[key] = draw(
            st.sampled_from([None, 300, -1, 'x', [], {}, [1, 'a'], {'vocab_size': 'x'}])
        )
    return meta


@settings(
    max_examples=int(os.environ.get('FUZZ_EXAMPLES', 30)), deadline=None, **HYPOTHESIS_FIXTURES
)
@given(data=st.data())
def test_data_fuzzed_flags_and_damaged_datasets_keep_the_contract(tmp_path, capsys, data):
    """Whatever the flags, and whatever was done to an existing dataset's meta.json: no traceback,
    exit 0, 1 or 2 with one `error:` line on failure, no temporary file left, and every meta.json
    on disk whole JSON; a bad flag (exit 2) writes nothing."""
    where = Path(tempfile.mkdtemp(dir=tmp_path))
    (where / 'in.txt').write_text(_data_words(4000))
    base = ['--input', where / 'in.txt', '--out-dir', where / 'data', '--name', 'd', '--lang', 'en']
    if data.draw(st.booleans(), label='damaged existing dataset'):
        assert prepare_data.run([str(a) for a in base + ['--unigram', '0']])
        path = where / 'data' / 'd' / 'meta.json'
        meta = _fuzz_damage(json.loads(path.read_text()), data.draw)
        path.write_text(json.dumps(meta))
    before = sorted(p for p in where.rglob('*'))
    argv = list(base) + ['--unigram', data.draw(st.sampled_from(['0', '0', '30']))]
    flags = st.lists(st.sampled_from(_FUZZ_FLAGS), min_size=1, max_size=3, unique=True)
    for flag in data.draw(st.just([]) | flags, label='flags'):
        argv += [flag, data.draw(st.sampled_from(_FUZZ_VALUES))]
    capsys.readouterr()
    with no_hang(60):
        code, out, err = run_main(prepare_data.main, argv, capsys)
    code = 0 if code is None or isinstance(code, dict) else code
    event(f'exit {code}')  # --hypothesis-show-statistics: how far the examples got
    assert_cli_contract(code, err, argv)
    assert not _data_temps(where), argv
    for meta_file in where.rglob('meta.json'):
        json.loads(meta_file.read_text())
    assert code != 2 or sorted(p for p in where.rglob('*')) == before, (argv, err)
    if code == 0:  # what it leaves is a dataset train.py accepts (the last --name counts)
        name = argv[len(argv) - argv[::-1].index('--name')]
        dataset.read_meta(where / 'data' / str(name))


# --- issues 31 and 35: offline at once, plausible data, interrupted work, any file name -----------


def _data_closed_port():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.parametrize('source', ['text8', 'cc100'])
def test_data_unreachable_host_one_attempt_then_both_ways_on(source, tmp_path, capsys, monkeypatch):
    """A host that refuses the connection, or that no name server knows: one connection attempt
    for every source (no retry loop, huggingface_hub's own included), then one line with the two
    commands that need no network, quoted for the shell, each flag once."""
    looked_up = []
    real = socket.getaddrinfo

    def counting(host, *a, **k):
        looked_up.append(host)
        return real(host, *a, **k)

    monkeypatch.setattr(socket, 'getaddrinfo', counting)
    waits = []   # a retry loop's sleeps (ours or huggingface_hub's), recorded, not slept
    monkeypatch.setattr(time, 'sleep', waits.append)
    where = {
        'text8': ['--text8-url', '{}/text8.zip'],
        'cc100': ['--dataset', 'cc100', '--lang', 'he', '--cc100-base', '{}'],
    }[source]
    out = tmp_path / 'my data'
    for base in (f'http://127.0.0.1:{_data_closed_port()}', 'http://nonexistent.invalid'):
        looked_up.clear()
        argv = [w.format(base) for w in where] + ['--out-dir', out]
        r = _data_main(argv, capsys)
        line = _data_one_line(r, 1, 'download failed', base.split('//')[1])
        assert len(looked_up) == 1 and not waits and 'retry' not in r.stderr, looked_up
        by_hand, own = re.search(r'run: (.*); or prepare text of your own: (.*)$', line).groups()
        for command in (by_hand, own):
            words = shlex.split(command)
            flags = [w for w in words if w.startswith('--')]
            assert len(flags) == len(set(flags)) and str(out) in words, command
        # the same dataset's command either way: from the files by hand, or from one's own text
        assert shlex.split(own)[-2:] == ['--input', 'FILE'] and f'--dataset {source}' in own
        assert own.replace('FILE', by_hand.split(' --input ')[1]) == by_hand


def _data_one_error(r):
    """The one stderr line of a run that failed cleanly (exit 1, no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith('error: '), r.stderr
    return lines[0]


@pytest.mark.parametrize('host', ['closed port', 'nonexistent.invalid'])
def test_data_wiki40b_hub_unreachable_one_line_nothing_left(host, tmp_path):
    """HF_ENDPOINT naming a port nothing listens on, or a host no name server knows: one line
    with both ways on without network (each flag once), no retries, and no dataset folder (or
    its lock) left behind."""
    base = f'http://127.0.0.1:{_data_closed_port()}'
    if host != 'closed port':
        base = f'http://{host}'
    srv = type('Hub', (), {'base': base})
    line = _data_one_error(_data_hub_run(srv, tmp_path, '--lang', 'he'))
    assert 'download failed' in line and base.split('//')[1] in line, line
    by_hand, own = re.search(r'run: (.*); or prepare text of your own: (.*)$', line).groups()
    for command in (by_hand, own):
        flags = [w for w in shlex.split(command) if w.startswith('--')]
        assert len(flags) == len(set(flags)), command
    assert own.endswith('--dataset wiki40b --lang he --input FILE'), own
    assert not (tmp_path / 'data').exists()


def test_data_design_card_command_without_network(tmp_path):
    """`python prepare_data.py --lang he` as typed, in a copy of the checkout, in a network
    namespace of its own (no network at all): one line naming the way on (--input FILE),
    exit 1, nothing left in data/."""
    if shutil.which('unshare') is None or subprocess.run(['unshare', '-n', 'true']).returncode:
        pytest.skip('needs unshare -n (util-linux, as root) for a process without network')
    repo = Path(prepare_data.__file__).parent
    for f in repo.glob('*.py'):
        shutil.copy(f, tmp_path)
    # (a limit only against a hang: the run ends at the first failed name lookup)
    r = subprocess.run(['unshare', '-n', sys.executable, 'prepare_data.py', '--lang', 'he'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    line = _data_one_error(r)
    assert 'python prepare_data.py --dataset wiki40b --lang he --input FILE' in line, line
    assert not (tmp_path / 'data').exists()


def test_data_text_in_another_script_is_refused(tmp_path, capsys):
    """Text whose letters mostly fall outside --lang's alphabet is refused, naming their script and
    the --lang that keeps them; the same text with its own --lang is a dataset."""
    f, out = tmp_path / 'he.txt', tmp_path / 'out'
    f.write_text('שלום עולם, זה טקסט בעברית עם 12 ו-TCP.\n' * 300)
    base = ['--input', f, '--out-dir', out, '--unigram', '0']
    msg = _data_fail(base + ['--lang', 'en'], capsys, out)
    assert 'Hebrew' in msg and '--lang he keeps them' in msg
    assert prepare_data.run(base + ['--lang', 'he', '--name', 'he'])['sizes']['train'] > 0
    assert cleaning.foreign_letters('12 345 !!! ... the cat', 'en') is None   # letters only count


def test_data_several_inputs_keep_their_roles_or_are_refused(tmp_path, capsys):
    """Several --input files: each in the split its name says, all three present; a name that says
    none, or a missing split, is refused before anything is made (never merged and cut 90/5/5)."""
    texts = {'my_train.txt': 'the cat sat\n' * 40, 'my_dev.txt': 'a dog ran\n' * 5,
             'my_test.txt': 'on a mat\n' * 5, 'notes.txt': 'hello\n' * 40}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / 'out'
    for names, said in [(['my_train.txt', 'my_test.txt'], 'no file named *valid*'),
                        (['my_train.txt', 'notes.txt'], 'says no split')]:
        r = _data_main(['--input', *[tmp_path / n for n in names], '--lang', 'en',
                        '--out-dir', out], capsys)
        _data_one_line(r, 2, said, '*train*', 'cut 90/5/5')
        assert not out.exists()
    names = ['my_test.txt', 'my_train.txt', 'my_dev.txt']
    meta = prepare_data.run(['--input', *[tmp_path / n for n in names], '--lang', 'en',
                             '--out-dir', out, '--unigram', '0'])
    d = out / 'input-en'
    roles = [('train', 'my_train.txt'), ('valid', 'my_dev.txt'), ('test', 'my_test.txt')]
    for split, name in roles:
        assert _data_decode(d, split, meta) == texts[name]


def test_data_giant_line_cut_only_between_words(tmp_path, capsys, monkeypatch):
    """A line far longer than a piece is cut at a space or ASCII punctuation (which cleaning makes
    a space): no word is split or merged with its neighbour; a word longer than a piece stays
    whole."""
    monkeypatch.setattr(prepare_data, 'CHUNK', 64)
    long_word = 'x' * 150
    text = 'abcdefg.' * 300 + 'one_two,three;' * 50 + long_word + '-' + 'abcdefg.' * 30
    (tmp_path / 'line.txt').write_text(text)
    out = tmp_path / 'out'
    meta = prepare_data.run(['--input', tmp_path / 'line.txt', '--lang', 'en', '--out-dir', out,
                             '--unigram', '0'])
    words = ''.join(_data_decode(out / 'input-en', s, meta) for s in dataset.SPLITS).split()
    assert words == clean(text, 'en').split()


def test_data_leftovers_of_a_killed_run_removed_and_redone_identically(tmp_path, capsys):
    """Temporary files a killed run left in the dataset folder go at the next run (under the lock);
    labels half made are made again, byte for byte as an uninterrupted run makes them."""
    f = tmp_path / 'in.txt'
    f.write_text(_data_varied_words(6000).strip() + '\n')
    out = tmp_path / 'out'
    argv = ['--input', f, '--lang', 'en', '--out-dir', out, '--unigram', '60']
    prepare_data.run(argv)
    d = out / 'input-en'
    done = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != '.lock'}
    # killed while labelling: meta.json not yet written, one label file cut, temporaries left
    (d / 'meta.json').unlink()
    (d / 'test.unigram-60.bin').write_bytes(b'\x01' * 10)
    leftovers = ['.valid.unigram-60.k3j_x0a9.bin', '.all.bin', '.meta.q1w2e3r4.json']
    for name in leftovers:
        (d / name).write_bytes(b'half')
    (d / '.notes.abcdefgh.txt').write_text('mine')   # hidden, but not one of the script's
    prepare_data.run(argv)
    again = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != '.lock'}
    assert again.pop('.notes.abcdefgh.txt') == b'mine' and again == done


def test_data_file_name_not_utf8_round_trips(tmp_path, capsys):
    """An input whose name is not UTF-8 (Latin-1 café) is recorded so that it reads back as the
    same name: a re-run by --name alone finds it; the CLI prints it without a traceback."""
    name = os.fsencode(tmp_path) + b'/caf\xe9.txt'
    with open(name, 'wb') as f:
        f.write(_data_words(3000).encode())
    out = tmp_path / 'out'
    r = subprocess.run([sys.executable, prepare_data.__file__, '--input', name, '--lang', 'en',
                        '--out-dir', out, '--unigram', '0'], capture_output=True)
    assert r.returncode == 0 and name in r.stdout, r.stderr   # the summary names it, as it is
    stored = json.loads((out / 'input-en' / 'meta.json').read_bytes().decode('ascii'))
    assert os.fsencode(stored['source'][0]) == name
    r = subprocess.run([sys.executable, prepare_data.__file__, '--name', 'input-en', '--out-dir',
                        out, '--unigram', '0'], capture_output=True)
    assert r.returncode == 0 and b'splits done' in r.stdout, r.stderr
    r = subprocess.run([sys.executable, prepare_data.__file__, '--dataset', 'text8', '--input',
                        name, '--out-dir', out, '--unigram', '0'], capture_output=True)
    assert r.returncode == 0, r.stderr
    stored = json.loads((out / 'text8' / 'meta.json').read_bytes().decode('ascii'))
    assert os.fsencode(stored['source'][0]) == name


# --- issue 33: raw UTF-8 bytes, text as it is, enwik8 ---------------------------------------------

# letters of four scripts, 1 to 4 bytes each in UTF-8 (SentencePiece cuts words between scripts)
_DATA_SCRIPTS = ('aéệ€', 'שלום', '中文字', '𝐁𝐂𝐃')


def _data_mixed_text(rng, words, scripts=_DATA_SCRIPTS):
    """Words of one script each (Zipf-like, over 200 made-up ones) between spaces, tabs and
    line breaks (CRLF too)."""
    vocab = []
    for i in range(200):
        letters = list(scripts[i % len(scripts)])
        vocab.append(''.join(rng.choice(letters, rng.integers(1, 7))))
    p = 1 / np.arange(1, 201)
    seps = rng.choice([' ', ' ', ' ', '\n', '\t', '\r\n'], words)
    return ''.join(w + s for w, s in zip(rng.choice(vocab, words, p=p / p.sum()), seps))


def test_data_bytes_are_the_files_bytes(tmp_path, capsys, monkeypatch):
    """--bytes: each split's ids are its file's bytes, untouched (BOM, CRLF, stray non-UTF-8
    bytes, a last line break, a giant line cut at its punctuation); one file: 90/5/5 of them."""
    monkeypatch.setattr(prepare_data, 'CHUNK', 500)   # giant lines: cut at '.', kept as they are
    rng = np.random.default_rng(0)
    files = {}
    for split in ('train', 'valid', 'test'):
        text = _data_mixed_text(rng, 300).replace('\n', '.')
        files[split] = b'\xef\xbb\xbf' + text.encode() + b'\xff\xc3\n'
        (tmp_path / f'{split}.txt').write_bytes(files[split])
    inputs = [tmp_path / f'{s}.txt' for s in ('train', 'valid', 'test')]
    meta = prepare_data.run(['--bytes', '--input', *inputs, '--name', 'b', '--out-dir',
                             tmp_path / 'data', '--unigram', '0'])
    for split, raw in files.items():
        assert (tmp_path / 'data' / 'b' / f'{split}.bin').read_bytes() == raw
    assert meta['encoding'] == 'bytes' and meta['alphabet'] == [chr(i) for i in range(256)]
    assert (meta['vocab_size'], meta['space_id'], meta['newline_id']) == (256, 32, 10)
    assert meta['sizes'] == {s: len(raw) for s, raw in files.items()} and meta['defaults'] == {}
    assert dataset.unit(meta) == 'byte' and dataset.unit({'alphabet': ['a']}) == 'char'
    one = prepare_data.run(['--bytes', '--input', inputs[0], '--lang', 'he', '--out-dir',
                            tmp_path / 'data', '--unigram', '0'])
    d = tmp_path / 'data' / 'input-he-bytes'
    n = len(files['train'])
    assert one['sizes'] == {'train': n - 2 * (n // 20), 'valid': n // 20, 'test': n // 20}
    got = b''.join((d / f'{s}.bin').read_bytes() for s in ('train', 'valid', 'test'))
    assert got == files['train'] and one['defaults'] == {'unigram': 200, 'prior': 0.2}


def test_data_bytes_as_text_maps_characters_to_their_last_byte():
    word = ('a\xff' + 'ש'.encode().decode('latin-1') + '𝐁'.encode().decode('latin-1'))
    assert prepare_data.as_text(word, 'bytes') == ('a\ufffdש𝐁', [1, 2, 4, 8])
    sp = _FakeSP({'a\ufffdש𝐁': ['\u2581a', '\ufffdש', '𝐁']})
    # a ends at byte 0, ש at its 2nd byte (3); 𝐁, the last piece, is closed by what follows
    assert prepare_data.word_labels(sp, [word], 'bytes') == {word: b'\x01\x00\x00\x01' + bytes(4)}


@settings(max_examples=3, deadline=None, database=None, **HYPOTHESIS_FIXTURES)
@given(seed=st.integers(0, 2**32 - 1), scripts=st.sets(st.sampled_from(_DATA_SCRIPTS), min_size=2))
def test_data_unigram_on_bytes_ends_characters_as_on_chars(tmp_path, capsys, seed, scripts):
    """The same (NFC, UTF-8) text as bytes and as characters: the same SentencePiece model,
    and each byte label is the label of the character it is the last byte of (0 on the other
    bytes): piece ends land on the last byte of a character, whitespace bytes close words."""
    rng = np.random.default_rng(seed)
    where = Path(tempfile.mkdtemp(dir=tmp_path))
    inputs = []
    for split, n in (('train', 3000), ('valid', 300), ('test', 300)):
        inputs.append(where / f'{split}.txt')
        inputs[-1].write_text(_data_mixed_text(rng, n, sorted(scripts)), encoding='utf-8')
    base = ['--input', *inputs, '--out-dir', where, '--unigram', '30']
    by_byte = prepare_data.run(['--bytes', '--name', 'b', *base])
    by_char = prepare_data.run(['--chars', '--name', 'c', *base])
    assert (where / 'b' / 'unigram-30.model').read_bytes() == \
        (where / 'c' / 'unigram-30.model').read_bytes()
    raw = (where / 'b' / 'train.bin').read_bytes()
    byte_labels = np.fromfile(where / 'b' / 'train.unigram-30.bin', np.uint8)
    char_labels = np.fromfile(where / 'c' / 'train.unigram-30.bin', np.uint8)
    text = raw.decode('utf-8')
    last_bytes = np.cumsum([len(c.encode()) for c in text]) - 1
    assert len(char_labels) == len(text) == by_char['sizes']['train']
    want = np.zeros(len(raw), np.uint8)
    want[last_bytes] = char_labels
    assert np.array_equal(byte_labels, want) and by_byte['sizes']['train'] == len(raw)
    ws = np.isin(np.frombuffer(raw, np.uint8), list(b' \t\r\n'))
    assert byte_labels[ws].all() and 0 < byte_labels[~ws].sum() < (~ws).sum()


def test_data_chars_alphabet_from_train_unseen_is_unknown(tmp_path, capsys):
    """--chars: NFC, no cleaning; the alphabet is U+FFFD then train's sorted characters; a
    character train lacks is id 0 in valid and test; uint16 where the alphabet needs it."""
    cjk = ''.join(chr(0x4E00 + i) for i in range(300))
    (tmp_path / 'train.txt').write_text('Cafe\u0301 X!\n' + cjk + '\n', encoding='utf-8')
    (tmp_path / 'valid.txt').write_text('Café Z', encoding='utf-8')
    (tmp_path / 'test.txt').write_text('\ufffdX', encoding='utf-8')
    inputs = [tmp_path / f'{s}.txt' for s in ('train', 'valid', 'test')]
    meta = prepare_data.run(['--chars', '--input', *inputs, '--out-dir', tmp_path,
                             '--unigram', '0'])
    alphabet = meta['alphabet']
    want = sorted(set(unicodedata.normalize('NFC', 'Cafe\u0301 X!\n' + cjk + '\n')))
    assert alphabet == ['\ufffd'] + want and meta['dtype'] == 'uint16'
    assert meta['encoding'] == 'chars' and meta['name'] == 'input-chars'
    assert meta['space_id'] == alphabet.index(' ') and meta['newline_id'] == alphabet.index('\n')
    d = tmp_path / 'input-chars'
    assert _data_decode(d, 'train', meta) == 'Café X!\n' + cjk + '\n'
    assert _data_decode(d, 'valid', meta) == 'Café \ufffd'       # Z: unseen
    assert np.fromfile(d / 'test.bin', np.uint16).tolist() == [0, alphabet.index('X')]
    dataset.read_meta(d)


def test_data_enwik8_download_split_and_offline(_data_server, tmp_path, capsys, monkeypatch):
    """--dataset enwik8: the zip's one file `enwik8` from --enwik8-url (text8's resumed
    download), its bytes cut 90/5/5 in order (90M / 5M / 5M of the real 100M); offline, the
    command printed runs on the zip fetched by hand."""
    raw = _data_mixed_text(np.random.default_rng(3), 2000).encode() + b'<page>\xff</page>\n'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as z:
        z.writestr('enwik8', raw)
    _data_server.files['/enwik8.zip'] = buf.getvalue()
    _data_server.flaky.add('/enwik8.zip')
    argv = ['--dataset', 'enwik8', '--enwik8-url', _data_server.base + '/enwik8.zip',
            '--out-dir', tmp_path, '--unigram', '0']
    meta = prepare_data.run(argv)
    d = tmp_path / 'enwik8'
    n = len(raw)
    assert meta['sizes'] == {'train': n - 2 * (n // 20), 'valid': n // 20, 'test': n // 20}
    assert b''.join((d / f'{s}.bin').read_bytes() for s in ('train', 'valid', 'test')) == raw
    assert meta['encoding'] == 'bytes' and meta['vocab_size'] == 256 and meta['lang'] == 'en'
    assert meta['source'] == [_data_server.base + '/enwik8.zip']
    assert (d / 'download' / 'enwik8.zip').exists() and not list(d.rglob('*.part*'))
    capsys.readouterr()
    r = _data_main(['--dataset', 'enwik8', '--enwik8-url', f'http://127.0.0.1:{_data_closed_port()}'
                    '/enwik8.zip', '--out-dir', tmp_path / 'off', '--unigram', '0'], capsys)
    msg = _data_one_line(r, 1, 'download failed', '--input enwik8.zip', '--dataset enwik8')
    (tmp_path / 'enwik8.zip').write_bytes(buf.getvalue())
    done = _data_run_printed(msg, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / 'off' / 'enwik8' / 'train.bin').read_bytes() == raw[:n - 2 * (n // 20)]


def test_data_unigram_on_chars_survives_sentencepieces_own_marks(tmp_path, capsys):
    """Text as it is may hold U+2581, SentencePiece's whitespace mark, even as a word of its own:
    it is fitted and labelled as any other character."""
    rng = np.random.default_rng(5)
    text = _data_mixed_text(rng, 2000, ('ab\u2581', 'שלום')) + ' \u2581 \u2581\u2581 x\u2581\n'
    (tmp_path / 'in.txt').write_text(text, encoding='utf-8')
    meta = prepare_data.run(['--chars', '--input', tmp_path / 'in.txt', '--out-dir', tmp_path,
                             '--unigram', '30'])
    d = tmp_path / 'input-chars'
    labels = np.fromfile(d / 'train.unigram-30.bin', np.uint8)
    ids = np.fromfile(d / 'train.bin', meta['dtype'])
    assert len(labels) == len(ids) and labels[ids == meta['space_id']].all()


def test_data_over_the_file_size_limit_is_one_line_naming_the_file_and_the_limit(tmp_path):
    """Under `ulimit -f` (RLIMIT_FSIZE) a write fails with EFBIG and no file name of its own:
    the error line names the dataset's file and the limit; nothing of the dataset is left."""
    (tmp_path / 'in.txt').write_text(_data_varied_words(40_000))
    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    r = subprocess.run([sys.executable, prepare_data.__file__, '--input', tmp_path / 'in.txt',
                        '--lang', 'en', '--name', 'capped', '--out-dir', tmp_path,
                        '--unigram', '0'],
                       capture_output=True, text=True, timeout=300, preexec_fn=limited)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert 'capped' in lines[0] and 'file-size limit' in lines[0], lines[0]
    assert not (tmp_path / 'capped').exists()


def test_data_input_from_a_pipe_is_named_a_pipe(tmp_path):
    """`cat FILE | prepare_data.py --input /dev/stdin`: /dev/stdin is a pipe (it resolves to a
    name that is no file): one line saying the input is not a regular file, not 'No such
    file'; nothing made."""
    (tmp_path / 'in.txt').write_text(_data_varied_words(20_000))
    command = (f'cat {shlex.quote(str(tmp_path / "in.txt"))} | {shlex.quote(sys.executable)} '
               f'{shlex.quote(prepare_data.__file__)} --input /dev/stdin --lang en --name piped '
               f'--out-dir {shlex.quote(str(tmp_path))} --unigram 0')
    r = subprocess.run(['bash', '-c', command], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert 'not a regular file' in lines[0] and 'No such file' not in lines[0], lines[0]
    assert not (tmp_path / 'piped').exists()
