"""
Download, clean, split and encode character-level LM data for dynpool.

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --lang fi --unigram 0    # wiki40b Finnish, no Unigram boundaries
    python prepare_data.py --dataset cc100 --lang en --max-train-chars 100000000
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --input text8.zip                            # text8 fetched by hand

Output (see DESIGN.md): data/<name>/{train,valid,test}.bin (uint8 token ids, memmap), meta.json,
and with --unigram V: unigram-V.model + {split}.unigram-V.bin boundary labels.

Notable features
- Cleaning is the paper's released text8-style cleaner (its order, alphabets and digit names):
  wiki40b markers -> line breaks, homoglyphs -> ASCII (Unicode's confusables, not for Hebrew),
  lower case, each digit spelled as its own word, anything outside the language's alphabet -> a
  space, whitespace collapsed. Fixes kept where it is broken: NFC first, İ -> i, Hebrew digit words
  without niqqud. --fold-accents folds é -> e instead (not the paper's data). `clean(text, lang)`
  is the public entry point; everything streams in ~4 MB chunks.
- Splits: text8 the standard first 90M / next 5M / last 5M chars. wiki40b keeps the official
  train/validation/test splits, train capped at --max-train-chars, the others at --max-eval-chars.
  cc-100 (one stream, never fully downloaded): first --max-eval-chars cleaned chars -> valid, next
  ones -> test, the rest -> train up to its cap. A single --input file: first 90% train, 5% valid,
  5% test (cut on characters, like text8), read up to max-train-chars / 0.9 characters.
- Downloads: wiki40b through huggingface_hub (its cache, resume, token, offline mode); text8 and
  cc-100 over urllib with progress, retries with back-off, and resume with HTTP Range guarded by
  If-Range, so a file changed on the server is fetched anew rather than spliced.
- Every output is written to *.tmp and renamed when complete; meta.json is written last, so a
  directory without meta.json is never a finished one. Re-runs skip finished steps (--force); a
  re-run with other cleaning options is refused, an input edited in place (size, mtime, SHA-256)
  is rebuilt, and a second run on the same dataset is refused by a lock.
- Unigram boundaries (the paper's subword supervision): SentencePiece is trained on whole words (one
  per sentence, no dummy prefix), in a child process so that Ctrl-C stops it at once, so a piece never
  spans a space; the labels mark the end of every piece, with each space/newline attached to the word
  before it. Words are encoded once (cached), not per use. A --unigram too large for the text stops
  with a message giving the largest size that works.
"""

import argparse
import codecs
import contextlib
import errno
import hashlib
import http.client
import io
import json
import os
import re
import sys
import time
import unicodedata
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

# -----------------------------------------------------------------------------
# languages: alphabet (id order after '\n' and ' '), digit names, default Unigram size
# The alphabets, digit names and pipeline order are those of the paper's released cleaner.

_AZ = "abcdefghijklmnopqrstuvwxyz"
_VI_VOWELS = "aăâeêioôơuưy"
_VI_TONES = "\u0300\u0301\u0309\u0303\u0323"  # grave, acute, hook, tilde, dot below

LANGS = {
    "en": dict(letters=_AZ, unigram=10000,
               digits="zero one two three four five six seven eight nine"),
    "fi": dict(letters=_AZ + "åäö", unigram=200,
               digits="nolla yksi kaksi kolme neljä viisi kuusi seitsemän kahdeksan yhdeksän"),
    # 27 letters (finals included), then maqaf, geresh, gershayim (as in צה״ל)
    "he": dict(letters="".join(chr(c) for c in range(0x5D0, 0x5EB)) + "\u05be\u05f3\u05f4",
               unigram=200, digits="אפס אחד שנים שלשה ארבעה חמשה ששה שבעה שמונה תשעה"),
    # no f, j, w, z; the tone-marked vowels precomposed (NFC)
    "vi": dict(letters="abcdeghiklmnopqrstuvxy" + "ăâđêôơư" + "".join(
        unicodedata.normalize("NFC", v + t) for v in _VI_VOWELS for t in _VI_TONES),
               unigram=10000, digits="không một hai ba bốn năm sáu bảy tám chín"),
}
TEXT8_ALPHABET = [" "] + list(_AZ)

# --fold-accents only: Latin letters that no Unicode decomposition reduces to a basic letter
_FOLD_EXTRA = {"ß": "ss", "æ": "ae", "œ": "oe", "þ": "th", "ð": "d", "đ": "d", "ı": "i",
               "ł": "l", "ø": "o", "ŀ": "l", "ĸ": "k", "װ": "וו", "ױ": "וי", "ײ": "יי"}
_MARKERS = re.compile(r"_START_(?:ARTICLE|SECTION|PARAGRAPH)_|_NEWLINE_")
_HOMOGLYPHS = {}


def homoglyphs():
    """{character: ASCII} from Unicode's confusables (UTS #39, package confusable-homoglyphs):
    each non-ASCII character confusable with one ASCII character (or with ASCII punctuation
    only, as “ with ''), plus the fullwidth forms U+FF01-FF5E through their NFKC form."""
    if not _HOMOGLYPHS:
        data = _need("confusable_homoglyphs.confusables", "the homoglyph map of the cleaning")
        listed = {}  # the data lists confusables both ways; right-to-left ones wrapped in U+200E
        for key, protos in data.confusables_data.items():
            key = key.strip("\u200e")
            for p in (h["c"].strip("\u200e") for h in protos):
                if len(key) == 1 and not key.isascii() and p.isascii() and (
                        len(p) == 1 or not any(ch.isalnum() for ch in p)):
                    _HOMOGLYPHS.setdefault(key, p)  # the character's own prototype first
                elif len(key) == 1 and key.isascii() and len(p) == 1 and not p.isascii():
                    listed.setdefault(p, key)
        for c, a in listed.items():
            _HOMOGLYPHS.setdefault(c, a)
        for cp in range(0xFF01, 0xFF5F):
            a = unicodedata.normalize("NFKC", chr(cp))
            _HOMOGLYPHS.setdefault(chr(cp), _HOMOGLYPHS.get(a, a))
    return _HOMOGLYPHS


def _lang(lang):
    if lang not in LANGS:
        raise ValueError(f"unsupported language {lang!r}; supported: {', '.join(sorted(LANGS))}")
    return LANGS[lang]


class _CharMap(dict):
    """str.translate table of one language, filled lazily: each code point is decided once.
    Per character, in the paper's order: homoglyph -> lower case -> digit -> alphabet."""

    def __init__(self, lang, fold_accents):
        L = _lang(lang)
        self.letters, self.fold = set(L["letters"]) | {"\n"}, fold_accents
        self.digits = {str(d): f" {w} " for d, w in enumerate(L["digits"].split())}
        self.homoglyphs = homoglyphs() if lang != "he" else {}  # Hebrew letters look like l, o, v

    def __missing__(self, cp):
        out = self[cp] = self._map(chr(cp))
        return out

    def _map(self, c):
        if c in self.letters:
            return c
        c = self.homoglyphs.get(c, c)
        # fix: Python lower-cases İ to i + U+0307, whose dot would split the word
        low = "i" if c == "İ" else c.lower()
        return "".join(self._keep(ch) for ch in low)

    def _keep(self, ch):
        if ch in self.letters:
            return ch
        if ch in self.digits:  # each digit its own word
            return self.digits[ch]
        return self._fold(ch) if self.fold else " "

    def _fold(self, ch):
        """--fold-accents: other digits spelled, é -> e, ß -> ss, marks dropped, else a space."""
        d = unicodedata.decimal(ch, None)
        if d is not None:
            return self.digits[str(d)]
        t = "".join(_FOLD_EXTRA.get(x, x) for x in unicodedata.normalize("NFKC", ch).lower())
        base = "".join(x for x in unicodedata.normalize("NFD", t) if not unicodedata.combining(x))
        for s in (t, unicodedata.normalize("NFC", base)):
            if s and all(x in self.letters and x != "\n" for x in s):
                return s
        return "" if unicodedata.category(ch).startswith("M") else " "


_TABLES = {}


def clean(text: str, lang: str, fold_accents: bool = False) -> str:
    """The paper's cleaning of raw text (its released text8-style cleaner) with dynpool's fixes.
    Output: alphabet letters, single spaces and single newlines only, no empty lines, no spaces
    at line ends; clean(clean(x)) == clean(x). fold_accents: é -> e etc. instead of a space."""
    table = _TABLES.get((lang, fold_accents))
    if table is None:
        table = _TABLES[lang, fold_accents] = _CharMap(lang, fold_accents)
    text = _MARKERS.sub("\n", text)
    # fix: decomposed (NFD) input composed first, so ä = a + U+0308 stays one letter
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    text = text.translate(table)
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def die(msg, code=1):
    """A user-facing failure: one line on stderr, temp outputs removed, no traceback."""
    _remove_temps()
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def _why(e):
    """An exception's message, or its type's name where it has none."""
    return str(e) or type(e).__name__


# -----------------------------------------------------------------------------
# temp files: everything is written under a temporary name and renamed when complete

_TEMPS = set()


def _tmp(path):
    t = Path(str(path) + ".tmp")
    _TEMPS.add(t)
    return t


def _commit(tmp, path):
    os.replace(tmp, path)
    _TEMPS.discard(tmp)


def _remove_temps():
    for t in list(_TEMPS):
        try:
            t.unlink()
        except OSError:
            pass
        _TEMPS.discard(t)


def _write(f, data):
    f.write(data)  # one place for all binary writes (tests simulate a full disk here)

# -----------------------------------------------------------------------------
# download: resumable HTTP stream over urllib


class DownloadError(Exception):
    pass


class _Changed(Exception):
    """The server's file is not the one a .part was cut from: start over, never splice."""


def _range_total(headers):
    """The full size from a Content-Range header ("bytes a-b/total" or "bytes */total"), else None."""
    total = (headers.get("Content-Range") or "*/*").rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def _validator(headers):
    """The version of a server file: a strong ETag, else Last-Modified, else None."""
    etag = headers.get("ETag")
    return etag if etag and not etag.startswith("W/") else headers.get("Last-Modified")


class HTTPStream(io.RawIOBase):
    """A read-only file over HTTP. A dropped connection is retried with back-off and resumed
    with a Range request from the byte reached, guarded by If-Range with the file's version
    (ETag/Last-Modified): a file changed on the server raises _Changed instead of a splice."""

    def __init__(self, url, pos=0, retries=5, backoff=2.0, timeout=60, validator=None, total=None):
        self.url, self.pos, self.retries, self.backoff, self.timeout = url, pos, retries, backoff, timeout
        self.validator, self.total, self.resp = validator, total, None
        self._retry(lambda: None)  # connects

    def readable(self):
        return True

    def _connect(self):
        headers = {"User-Agent": "dynpool-prepare-data"}
        if self.pos:
            headers["Range"] = f"bytes={self.pos}-"
            if self.validator:
                headers["If-Range"] = self.validator
        try:
            resp = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416:  # nothing left after pos: the previous attempt had it all, unless the
                # server's size says the .part is longer than the file (download() then rejects it)
                self.total, self.resp = _range_total(e.headers) or self.pos, io.BytesIO()
                return
            raise
        version = _validator(resp.headers)
        total = _range_total(resp.headers) if resp.status == 206 else (
            int(resp.headers["Content-Length"]) if resp.headers.get("Content-Length") else None)
        if self.pos and ((self.validator and version != self.validator) or (
                self.total is not None and total is not None and total != self.total)):
            resp.close()
            raise _Changed(f"{self.url} changed on the server since the download began")
        self.validator, self.total = version, total
        if self.pos and resp.status != 206:  # same file, server ignored Range: skip what we have
            skip = self.pos
            while skip:
                got = resp.read(min(skip, 1 << 20))
                if not got:
                    raise http.client.IncompleteRead(b"")
                skip -= len(got)
        self.resp = resp

    def _retry(self, fn):
        err = None
        for attempt in range(self.retries + 1):
            try:
                if self.resp is None:
                    self._connect()
                return fn()
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code not in (408, 429):
                    raise DownloadError(f"{self.url}: HTTP {e.code} {e.reason}") from None
                err = f"HTTP {e.code} {e.reason}"
            except (OSError, http.client.HTTPException) as e:
                err = getattr(e, "reason", None) or _why(e)
            self.resp = None
            if attempt < self.retries:
                wait = self.backoff * 2 ** attempt
                print(f"{self.url}: {err}; retry {attempt + 1}/{self.retries} in {wait:.1f}s", file=sys.stderr)
                time.sleep(wait)
        raise DownloadError(f"{self.url}: {err}")

    def close(self):
        if self.resp is not None:
            self.resp.close()
        super().close()

    def readinto(self, b):
        def once():
            n = self.resp.readinto(b)
            if n == 0 and len(b) and self.total is not None and self.pos < self.total:
                raise http.client.IncompleteRead(b"", self.total - self.pos)
            return n
        n = self._retry(once)
        self.pos += n
        return n


class _Progress:
    def __init__(self, label):
        self.label, self.t0, self.last = label, time.time(), 0.0

    def __call__(self, done, total, final=False):
        now = time.time()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        mb = done / 1e6
        rate = mb / max(now - self.t0, 1e-9)
        of = f" / {total / 1e6:.1f} MB ({100 * done / total:.0f}%)" if total else " MB"
        tty = sys.stderr.isatty()
        end = "\n" if final or not tty else ""
        cr = "\r" if tty else ""
        print(f"{cr}{self.label}: {mb:.1f}{of} {rate:.1f} MB/s", end=end, file=sys.stderr, flush=True)


def download(url, dest, retries=5, backoff=2.0):
    """Fetch url to dest via dest.part, resumed only while the server's file is the same one
    (its version is kept in dest.part.json); rename only once the size checks."""
    dest = Path(dest)
    if dest.exists():
        print(f"have {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part, info = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    try:
        version = json.loads(info.read_text()) if part.exists() else {}
    except (OSError, ValueError):
        version = {}
    have = part.stat().st_size if version else 0  # a .part of unknown version is not resumed
    for _ in range(2):
        try:
            return _fetch(url, dest, part, info, have, version, retries, backoff)
        except _Changed as e:
            print(f"{e}; starting over", file=sys.stderr)
            have, version = 0, {}
    raise DownloadError(f"{url}: the file keeps changing on the server")


def _fetch(url, dest, part, info, have, version, retries, backoff):
    progress = _Progress(f"download {url}")
    with HTTPStream(url, pos=have, retries=retries, backoff=backoff, validator=version.get("validator"),
                    total=version.get("total")) as stream, open(part, "ab" if stream.pos else "wb") as f:
        if not stream.pos:
            info.write_text(json.dumps({"url": url, "validator": stream.validator, "total": stream.total}))
        while True:
            chunk = stream.read(1 << 20)
            if not chunk:
                break
            _write(f, chunk)
            progress(stream.pos, stream.total)
    progress(stream.pos, stream.total, final=True)
    size = part.stat().st_size
    if stream.total is not None and size != stream.total:
        # a .part that does not match is not resumable (a later run would take it as complete)
        part.unlink()
        info.unlink(missing_ok=True)
        raise DownloadError(f"{url}: got {size} bytes, expected {stream.total}")
    os.replace(part, dest)
    info.unlink(missing_ok=True)
    return dest

# -----------------------------------------------------------------------------
# reading raw text: (text, separator) pieces, cut at line ends so lines are cleaned whole

_BAD = {"n": 0, "first": None, "base": 0}


def _count_bad(e):
    _BAD["n"] += e.end - e.start
    if _BAD["first"] is None:
        _BAD["first"] = _BAD["base"] + e.start
    return "", e.end


codecs.register_error("dynpool_count", _count_bad)
CHUNK = 1 << 22


def text_pieces(fb, label):
    """Decode a binary stream as UTF-8 in ~4 MB pieces; invalid bytes are dropped and counted."""
    _BAD.update(n=0, first=None, base=0)
    dec = codecs.getincrementaldecoder("utf-8")(errors="dynpool_count")
    buf, total = "", 0
    while True:
        raw = fb.read(CHUNK)
        nul = raw.find(0)
        if nul >= 0:
            die(f"{label} looks binary (NUL byte at offset {total + nul}); "
                "expected UTF-8 text (UTF-16 files must be converted first)")
        _BAD["base"] = total
        buf += dec.decode(raw, final=not raw)
        total += len(raw)
        if _BAD["n"] > 4096 and _BAD["n"] > total // 100:
            die(f"{label} is not UTF-8 text: {_BAD['n']} invalid bytes in the first {total} "
                f"(first at byte {_BAD['first']})")
        if not raw:
            break
        cut = buf.rfind("\n")
        if cut >= 0:
            yield buf[:cut], "\n"
            buf = buf[cut + 1:]
        elif len(buf) > CHUNK:  # a giant line: cut at a space, or anywhere as a last resort
            cut = buf.rfind(" ")
            yield (buf[:cut], " ") if cut >= 0 else (buf, "")
            buf = buf[cut + 1:] if cut >= 0 else ""
    if _BAD["n"] and _BAD["n"] > total // 100:
        die(f"{label} is not UTF-8 text: {_BAD['n']} of {total} bytes invalid (first at byte {_BAD['first']})")
    if _BAD["n"]:
        print(f"warning: {label}: dropped {_BAD['n']} invalid UTF-8 bytes (first at byte {_BAD['first']})",
              file=sys.stderr)
    if buf:
        yield buf, ""


def _need(module, why):
    """Import an optional dependency, or stop with the pip command that installs it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        pkg = module.split(".")[0]
        die(f"{pkg} is not installed (pip install {pkg}); it is needed for {why}")


def parquet_docs(path):
    pq = _need("pyarrow.parquet", "wiki40b parquet shards")
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    col = "text" if "text" in names else next(
        (n for n in names if str(pf.schema_arrow.field(n).type) in ("string", "large_string", "binary")), None)
    if col is None:
        die(f"{path}: no text column (columns: {', '.join(names)})")
    for batch in pf.iter_batches(columns=[col], batch_size=256):
        for t in batch.column(0).to_pylist():
            if t:
                yield (t.decode("utf-8", "replace") if isinstance(t, bytes) else t), "\n"


def file_pieces(path, downloaded=False):
    """(text, separator) pieces of a raw .txt / .zip / .xz / .gz / .bz2 / .parquet file.
    A corrupt downloaded file is removed, so that the next run fetches it again."""
    import bz2, gzip, lzma, zipfile
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            yield from parquet_docs(path)
        elif suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                for m in sorted(n for n in z.namelist() if not n.endswith("/")):
                    with z.open(m) as fb:
                        yield from text_pieces(fb, f"{path}:{m}")
        else:
            opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}.get(suffix, open)
            with opener(path, "rb") as fb:
                yield from text_pieces(fb, str(path))
    except (zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError) as e:  # OSError: bad gzip/bz2 data
        _corrupt(path, _why(e), downloaded)
    except Exception as e:
        if type(e).__module__.startswith("pyarrow"):
            _corrupt(path, str(e).splitlines()[0] if str(e) else type(e).__name__, downloaded)
        raise


def _corrupt(path, why, downloaded):
    """Stop on a corrupt file; a downloaded one (and its blob in the hub cache) is removed first."""
    if downloaded:
        real = path.resolve()
        path.unlink(missing_ok=True)
        real.unlink(missing_ok=True)
        die(f"downloaded {path} is corrupt ({why}); it was removed: re-run to fetch it again")
    die(f"{path}: corrupt or unreadable ({why})")

# -----------------------------------------------------------------------------
# encoding: cleaned text -> token ids, streamed into a .bin under a character cap


class BinWriter:
    """Cleans (text, separator) pieces and appends their ids to path.tmp, stopping at cap."""

    def __init__(self, path, alphabet, dtype, lang, cap=None, fold_accents=False):
        self.path, self.tmp, self.lang, self.cap = Path(path), _tmp(path), lang, cap
        self.lut = np.full(0x110000, -1, dtype=np.int32)
        self.lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
        self.dtype, self.f = dtype, open(self.tmp, "wb")
        self.n = self.raw_chars = self.letters = self.signs = 0
        self.fold_accents = fold_accents
        self.clean_s, self.pending, self.full = 0.0, "", False
        if lang:
            words = LANGS[lang]["digits"].split()
            self.digit_cost = [(str(d), len(w)) for d, w in enumerate(words)]

    def add(self, text, sep):
        if self.full:
            return False
        if self.lang:
            t0 = time.perf_counter()
            self.raw_chars += len(text)
            n_digits = [text.count(d) for d, _ in self.digit_cost]
            self.signs += len(text) - text.count(" ") - text.count("\n") - sum(n_digits) - sum(
                map(len, _MARKERS.findall(text)))
            text = clean(text, self.lang, self.fold_accents)
            # letters that did not come from spelling out digits: few of them means wrong --lang
            self.letters += len(text) - text.count(" ") - text.count("\n") - sum(
                n * k for n, (_, k) in zip(n_digits, self.digit_cost))
            self.clean_s += time.perf_counter() - t0
        if text:
            if self.n or not self.lang:
                text = self.pending + text
            self.pending = sep
            self._put(text)
        elif not self.lang:
            self.pending += sep
        elif sep == "\n" or (sep == " " and not self.pending):
            self.pending = sep  # the strongest separator since the last text
        return not self.full

    def _put(self, text):
        if self.cap is not None and self.n + len(text) >= self.cap:
            text, self.full = text[: self.cap - self.n], True
        ids = self.lut[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
        if (ids < 0).any():  # only reachable without cleaning (text8)
            bad = text[int(np.argmax(ids < 0))]
            die(f"text8 input holds {bad!r}, not in a-z/space; use --lang en for other English text")
        _write(self.f, ids.astype(self.dtype).tobytes())
        self.n += len(text)

    def close(self):
        if self.lang and self.n and not self.full:
            self._put("\n")  # every line, the last one too, ends with a newline
        self.f.close()
        return self.n


def _cut(all_path, out, sizes, dtype):
    """Split all.bin into consecutive parts {split: (start, length)}."""
    data = _ids(all_path, dtype)
    for split, (start, length) in sizes.items():
        tmp = _tmp(out / f"{split}.bin")
        with open(tmp, "wb") as f:
            for i in range(start, start + length, 1 << 24):
                _write(f, data[i:min(i + (1 << 24), start + length)].tobytes())
        _commit(tmp, out / f"{split}.bin")
    del data


def _ids(path, dtype):
    """The token ids of a .bin, memory-mapped (numpy cannot map an empty file)."""
    return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def _text(ids, alphabet):
    """Token ids -> the text they stand for."""
    return np.array([ord(c) for c in alphabet], dtype="<u4")[ids].tobytes().decode("utf-32-le")


def _decode_blocks(path, alphabet, dtype, block=1 << 21):
    data = _ids(path, dtype)
    for i in range(0, len(data), block):
        yield _text(data[i:i + block], alphabet)

# -----------------------------------------------------------------------------
# Unigram boundaries (the paper's subword-supervised boundary predictor)


def train_unigram(out, alphabet, dtype, V, sample_chars):
    _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
    data = _ids(out / "train.bin", dtype)
    n = len(data)
    if n == 0:
        die("the train split is empty: nothing to fit Unigram on (pass --unigram 0)")
    # a few evenly spaced windows so the sample is not one article; edge words may be partial
    k = 8 if n > sample_chars else 1
    step, win = n // k, min(n, sample_chars) // k
    words = []
    for j in range(k):
        words += _text(data[j * step: j * step + win], alphabet).split()
    letters = "".join(c for c in alphabet if c not in " \n")
    ok, result = _in_child(_fit_unigram, words + list(letters), letters, V)
    if ok:
        return result
    m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", result)
    if m:
        die(f"--unigram {V} is too large for this text (SentencePiece allows at most {m[2]} here); "
            f"pass --unigram {m[2]} or less, or --unigram 0 to skip Unigram boundaries")
    die(f"SentencePiece failed: {result}")


def _fit_unigram(words, letters, V):
    """(True, model proto) or (False, SentencePiece's message); run in a child process."""
    import sentencepiece as spm
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            # each letter once more as a word of its own, so letters the sample lacks still get a piece
            sentence_iterator=iter(words), model_writer=model, model_type="unigram", vocab_size=V,
            # whole words in, identity normalisation, no dummy prefix: pieces are plain substrings
            normalization_rule_name="identity", add_dummy_prefix=False, split_by_whitespace=True,
            remove_extra_whitespaces=False, character_coverage=1.0, required_chars=letters,
            bos_id=-1, eos_id=-1, input_sentence_size=2_000_000, shuffle_input_sentence=True,
            max_sentence_length=1 << 16, num_threads=min(4, os.cpu_count() or 1), minloglevel=2)
    except RuntimeError as e:
        return False, (str(e).splitlines() or ["RuntimeError"])[0]
    return True, model.getvalue()


def _child_main(conn, fn, args):
    conn.send(fn(*args))
    conn.close()


def _in_child(fn, *args):
    """fn(*args) in a child process that never sees Ctrl-C: SentencePiece's C++ loop would hold
    off Python's handler until training ends, so on Ctrl-C the parent kills the child at once."""
    import multiprocessing as mp
    import signal
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    # SIGINT blocked while the child starts: it inherits the mask through exec and never sees
    # Ctrl-C. A Ctrl-C meanwhile (other threads may take it) is noted and raised once it runs.
    caught = []
    old = signal.signal(signal.SIGINT, lambda *_: caught.append(1))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    child = None
    try:
        child = ctx.Process(target=_child_main, args=(send, fn, args), daemon=True)
        child.start()
        send.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, old)
        if caught:
            raise KeyboardInterrupt
        while not recv.poll(0.1):
            if not child.is_alive():
                break
        if not recv.poll():
            return False, f"the training process died (exit code {child.exitcode})"
        return recv.recv()
    except EOFError:
        return False, f"the training process died (exit code {child.exitcode})"
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, old)
        if child is not None and child.is_alive():
            child.kill()
        if child is not None and child.pid is not None:
            child.join()
        recv.close()


def unigram_labels(sp, split_path, out_path, alphabet, dtype):
    """b_t = 1 where a piece ends; spaces/newlines close the word before them. Returns sum(b)."""
    cache = {"": b"\x01"}

    def fill(words):
        if len(cache) > 500_000:  # bound memory on 400M chars; hot words come straight back
            cache.clear()
            cache[""] = b"\x01"
        words = [w for w in set(words) if w not in cache]
        for w, pieces in zip(words, sp.encode(words, out_type=str) if words else []):
            if "".join(pieces) != w:  # cannot happen with identity normalisation; be safe
                pieces = list(w)
            lab = bytearray(len(w) + 1)
            pos = -1
            for p in pieces[:-1]:
                pos += len(p)
                lab[pos] = 1
            lab[-1] = 1
            cache[w] = bytes(lab)

    tmp, ones, carry = _tmp(out_path), 0, ""
    with open(tmp, "wb") as f:
        for text in _decode_blocks(split_path, alphabet, dtype):
            parts = (carry + text).replace("\n", " ").split(" ")
            carry = parts.pop()  # maybe a word cut by the block edge: finish it next time
            fill(parts)
            chunk = b"".join([cache[w] for w in parts])
            ones += chunk.count(1)
            _write(f, chunk)
        if carry:
            fill([carry])
            chunk = cache[carry][:-2] + b"\x01"  # no separator after the last word of the split
            ones += chunk.count(1)
            _write(f, chunk)
    _commit(tmp, out_path)
    return ones

# -----------------------------------------------------------------------------
# sources


WIKI40B = "google/wiki40b"


def _hub_error(e):
    """One line for an error raised inside huggingface_hub (or its HTTP client)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def list_wiki40b(lang, args):
    """Shard paths per split, listed by huggingface_hub (never guessed); offline (HF_HUB_OFFLINE=1)
    the shards already in the local cache."""
    hub = _need("huggingface_hub", "wiki40b downloads")
    constants = _need("huggingface_hub.constants", "wiki40b downloads")
    if constants.HF_HUB_OFFLINE:
        try:
            root = Path(hub.snapshot_download(WIKI40B, repo_type="dataset", cache_dir=args.hf_cache,
                                              allow_patterns=[f"{lang}/*.parquet"], local_files_only=True))
        except Exception:
            where = args.hf_cache or constants.HF_HUB_CACHE
            die(f"HF_HUB_OFFLINE is set and the hub cache {where} holds no {WIKI40B} shards for {lang!r}; "
                f"run once with network (unset HF_HUB_OFFLINE), pass the cache with --hf-cache, or pass "
                f"the shards with --dataset wiki40b --lang {lang} --input FILES")
        paths = [str(p.relative_to(root)) for p in sorted((root / lang).glob("*.parquet"))]
    else:
        api = hub.HfApi(endpoint=args.hf_base)
        try:
            paths = [f.path for f in api.list_repo_tree(WIKI40B, path_in_repo=lang, repo_type="dataset")
                     if f.path.endswith(".parquet")]
        except Exception as e:
            raise DownloadError(f"{args.hf_base or 'the hub'}: cannot list {WIKI40B}/{lang}: {_hub_error(e)}") from None
    shards = {s: sorted(p for p in paths if Path(p).name.startswith(s + "-")) for s in ("train", "validation", "test")}
    if not shards["train"]:
        raise DownloadError(f"{WIKI40B}: no parquet shards for language {lang!r}")
    return shards


def hub_download(path, args):
    """One wiki40b shard through huggingface_hub's cache (resumed, token from HF_TOKEN or login)."""
    hub = _need("huggingface_hub", "wiki40b downloads")
    for attempt in range(args.retries + 1):
        try:
            return hub.hf_hub_download(WIKI40B, path, repo_type="dataset", cache_dir=args.hf_cache,
                                       endpoint=args.hf_base)
        except Exception as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            err = _hub_error(e)
            if (status is not None and status < 500 and status not in (408, 429)) \
                    or type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") \
                    or attempt == args.retries:
                raise DownloadError(f"{path}: {err}") from None
        wait = args.backoff * 2 ** attempt
        print(f"{path}: {err}; retry {attempt + 1}/{args.retries} in {wait:.1f}s", file=sys.stderr)
        time.sleep(wait)


def _split_of(path):
    name = Path(path).name.lower()
    for key, split in (("train", "train"), ("valid", "valid"), ("dev", "valid"), ("test", "test")):
        if key in name:
            return split
    return None


def build_splits(args, out, alphabet, dtype, lang):
    """Writes train/valid/test.bin; returns (sources, split rule, cleaning stats)."""
    E, T = args.max_eval_chars, args.max_train_chars
    stats = {"clean_s": 0.0, "raw": 0, "letters": 0, "signs": 0}

    def run(writer, pieces):
        last = time.time()
        for text, sep in pieces:
            if not writer.add(text, sep):
                break
            if time.time() - last > 5:
                last = time.time()
                print(f"{writer.path.name}: {writer.n / 1e6:.1f}M chars", file=sys.stderr, flush=True)
        n = writer.close()
        stats["clean_s"] += writer.clean_s
        stats["raw"] += writer.raw_chars
        stats["letters"] += writer.letters
        stats["signs"] += writer.signs
        return n

    def by_split(docs_for_split, names):
        for split, cap in (("train", T), ("valid", E), ("test", E)):
            w = BinWriter(out / f"{split}.bin", alphabet, dtype, lang, cap, args.fold_accents)
            run(w, docs_for_split(names[split]))
            _commit(w.tmp, out / f"{split}.bin")

    def one_stream(pieces, cap, head):
        w = BinWriter(out / "all.bin", alphabet, dtype, lang, cap, args.fold_accents)
        N = run(w, pieces)
        if head:  # cc-100: valid and test first, so a capped stream fills them before train
            e = E if w.full or N >= 20 * E else N // 20
            sizes = {"valid": (0, e), "test": (e, e), "train": (2 * e, N - 2 * e)}
        else:  # text8 / --input: 90% train, 5% valid, 5% test, in that order
            e = N // 20
            sizes = {"train": (0, N - 2 * e), "valid": (N - 2 * e, e), "test": (N - e, e)}
        _cut(w.tmp, out, sizes, dtype)
        w.tmp.unlink()
        _TEMPS.discard(w.tmp)

    def files(paths):
        for p in paths:
            yield from file_pieces(p)

    if args.input:
        groups = {s: [p for p in args.input if _split_of(p) == s] for s in ("train", "valid", "test")}
        if len(args.input) > 1 and all(groups.values()) and sum(map(len, groups.values())) == len(args.input):
            by_split(files, groups)
            rule = "official (input files named train/valid/test)"
        else:
            cap = None if args.dataset == "text8" else int(T / 0.9)
            one_stream(files(args.input), cap, head=False)
            rule = "90% train / 5% valid / 5% test, in order"
        return [str(p) for p in args.input], rule, stats
    if args.dataset == "text8":
        zpath = download(args.text8_url, out / "download" / "text8.zip", args.retries, args.backoff)
        one_stream(file_pieces(zpath, downloaded=True), None, head=False)
        return [args.text8_url], "first 90M train / next 5M valid / last 5M test", stats
    if args.dataset == "wiki40b":
        shards = list_wiki40b(lang, args)
        names = {"train": shards["train"], "valid": shards["validation"], "test": shards["test"]}
        used = []

        def docs(paths):
            for p in paths:
                used.append(f"hf://datasets/{WIKI40B}/{p}")
                yield from file_pieces(hub_download(p, args), downloaded=True)
        by_split(docs, names)
        return used, "official wiki40b splits, capped", stats
    # cc-100: decompress the .xz while it streams in, stop as soon as the caps are filled
    import lzma
    url = f"{args.cc100_base}/{lang}.txt.xz"
    try:
        with HTTPStream(url, retries=args.retries, backoff=args.backoff) as stream, \
                lzma.open(io.BufferedReader(stream, 1 << 20)) as fb:
            one_stream(text_pieces(fb, url), T + 2 * E, head=True)
    except (lzma.LZMAError, EOFError) as e:
        die(f"{url}: corrupt xz stream ({_why(e)})")
    return [url], f"first {E} chars valid, next {E} test, then train (cleaned chars)", stats

# -----------------------------------------------------------------------------


def count_id(path, dtype, value):
    data = _ids(path, dtype)
    return sum(int(np.count_nonzero(data[i:i + (1 << 24)] == value)) for i in range(0, len(data), 1 << 24))


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors (exit 2, no usage dump)."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _url(value):
    """An argparse type: an http(s) URL with a host."""
    from urllib.parse import urlsplit
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL")
    return value.rstrip("/")


def _parser():
    p = _Parser(description="Download, clean, split and encode data for dynpool.")
    p.add_argument("--dataset", choices=["text8", "wiki40b", "cc100", "input"], default=None,
                   help="source; default text8 without --lang, wiki40b with it, input with --input and --lang")
    p.add_argument("--lang", default=None, help=f"language code, one of {', '.join(sorted(LANGS))}")
    p.add_argument("--input", nargs="+", type=Path, default=None, metavar="FILE",
                   help="local .txt/.zip/.xz/.gz/.parquet file(s) instead of downloading; one file is cut "
                        "90/5/5, several named *train*/*valid*/*test* keep their splits")
    p.add_argument("--name", default=None, help="output dir name under --out-dir (default text8, wiki40b-<lang>, ...)")
    p.add_argument("--out-dir", type=Path, default=Path("data"), help="parent of the output directory (default data)")
    p.add_argument("--fold-accents", action="store_true",
                   help="fold letters outside the alphabet to its letters (é -> e, ß -> ss, niqqud dropped) "
                        "instead of the paper's space")
    p.add_argument("--max-train-chars", type=int, default=400_000_000, help="cap on cleaned train characters (default 400M)")
    p.add_argument("--max-eval-chars", type=int, default=2_000_000, help="cap on cleaned valid and test characters each (default 2M)")
    p.add_argument("--unigram", type=int, default=None,
                   help="SentencePiece Unigram vocab size for boundary labels (default 10000 en/vi/text8, 200 fi/he; 0 = off)")
    p.add_argument("--unigram-sample-chars", type=int, default=4_000_000,
                   help="train characters sampled to fit the Unigram model (default 4M)")
    p.add_argument("--force", action="store_true", help="redo finished steps (completed downloads are kept)")
    p.add_argument("--hf-base", type=_url, default=None,
                   help="Hugging Face hub endpoint (default: huggingface_hub's, i.e. HF_ENDPOINT or huggingface.co)")
    p.add_argument("--hf-cache", type=Path, default=None,
                   help="huggingface_hub cache dir for the wiki40b shards (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    p.add_argument("--text8-url", type=_url,
                   default=os.environ.get("DYNPOOL_TEXT8_URL", "http://mattmahoney.net/dc/text8.zip"),
                   help="text8.zip URL (env DYNPOOL_TEXT8_URL; default mattmahoney.net)")
    p.add_argument("--cc100-base", type=_url, default=os.environ.get("DYNPOOL_CC100_BASE", "https://data.statmt.org/cc-100"),
                   help="cc-100 base URL holding <lang>.txt.xz (env DYNPOOL_CC100_BASE; default data.statmt.org)")
    p.add_argument("--retries", type=int, default=5, help="download retries per request (default 5)")
    p.add_argument("--backoff", type=float, default=2.0, help="first retry delay in seconds, doubled each retry (default 2)")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        die("interrupted; finished steps and completed downloads kept (a re-run continues), "
            "temp files removed", 130)
    except DownloadError as e:
        hint = {"wiki40b": f"the {args.lang}/*.parquet shards of {WIKI40B} (dataset on the Hugging Face hub) by "
                           f"hand and pass --dataset wiki40b --lang {args.lang} --input <train-*, validation-*, "
                           "test-* files>, or set HF_HUB_OFFLINE=1 to use the shards already cached",
                "cc100": f"{args.cc100_base}/{args.lang}.txt.xz (or its head) by hand and pass --input FILE "
                         f"--lang {args.lang}"}.get(args.dataset, "the file by hand and pass --input FILE")
        die(f"download failed: {e}. Without network, fetch {hint}")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            die(f"disk full while writing {getattr(e, 'filename', None) or args.out_dir}; free space or use --out-dir")
        die(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}")
    finally:
        _remove_temps()


def _resolve(args):
    """Fills in --dataset and --lang, checks the flags; returns the Unigram size."""
    if args.dataset is None:
        args.dataset = ("input" if args.lang else "text8") if args.input else ("wiki40b" if args.lang else "text8")
    if args.dataset == "text8":
        if args.lang not in (None, "en"):
            die(f"text8 is English; got --lang {args.lang}")
        args.lang = "en"
    elif args.lang is None:
        die(f"--dataset {args.dataset} needs --lang ({', '.join(sorted(LANGS))})")
    try:
        _lang(args.lang)
    except ValueError as e:
        die(str(e))
    if args.dataset == "input" and not args.input:
        die("--dataset input needs --input FILE...")
    for f in args.input or []:
        if not f.is_file():
            die(f"input file not found (or not a file): {f}")
    V = args.unigram if args.unigram is not None else LANGS[args.lang]["unigram"]
    if min(V, args.max_eval_chars, args.retries) < 0 or min(args.max_train_chars, args.unigram_sample_chars) < 1:
        die("--unigram, --max-eval-chars and --retries must not be negative, "
            "--max-train-chars and --unigram-sample-chars must be positive")
    return V


@contextlib.contextmanager
def _lock(out):
    """An advisory lock on <out>/.lock for the whole run; the OS drops it when the process dies."""
    import fcntl
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        die(f"{out} is being prepared by another run (pid {pid}); wait for it to finish or pass another --name")
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    try:
        yield
    finally:
        f.close()


def fingerprint(path):
    """Size, mtime and SHA-256 of an input file: a file edited in place is noticed on re-run."""
    st, h = os.stat(path), hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def cleaning_options(args, lang):
    """Everything that decides the cleaned text; meta.json records it, re-runs compare it."""
    if lang is None:
        return {"lang": None, "pipeline": "text8 as is (a-z and space)", "fold_accents": False}
    import importlib.metadata as md
    homo = None
    if lang != "he":
        homo = f"Unicode confusables via confusable-homoglyphs {md.version('confusable-homoglyphs')}"
    return {"lang": lang, "pipeline": "paper (wiki40b markers, homoglyphs, lower case, digits, alphabet)",
            "homoglyphs": homo, "fold_accents": args.fold_accents,
            "fixes": ["NFC first", "İ -> i"] + (["digit words without niqqud"] if lang == "he" else []),
            "alphabet": LANGS[lang]["letters"]}


def _differs(old, new):
    """The options of an existing dataset that differ from this run's, as one short phrase."""
    keys = sorted(set(old) | set(new), key=str)
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def _main(args):
    V = _resolve(args)
    lang = None if args.dataset == "text8" else args.lang  # text8 is already clean: kept as is
    name = args.name or {"text8": "text8", "input": f"input-{args.lang}"}.get(args.dataset, f"{args.dataset}-{args.lang}")
    out = args.out_dir / name
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        die(f"cannot write to output dir {out}: {e.strerror or e}")
    with _lock(out):
        return _prepare(args, out, name, lang, V)


def _prepare(args, out, name, lang, V):
    alphabet = TEXT8_ALPHABET if lang is None else ["\n", " "] + list(LANGS[lang]["letters"])
    dtype = "uint8" if len(alphabet) <= 256 else "uint16"
    cleaning = cleaning_options(args, lang)
    key = {"dataset": args.dataset, **cleaning, "max_train_chars": args.max_train_chars,
           "max_eval_chars": args.max_eval_chars, "input": [str(f) for f in args.input] if args.input else None}
    inputs = [fingerprint(f) for f in args.input] if args.input else None
    sizes, sources, rule, rate = _splits(args, out, alphabet, dtype, lang, key, inputs)
    space_id = alphabet.index(" ")
    n_space = count_id(out / "train.bin", dtype, space_id)
    mwl = sizes["train"] / n_space if n_space else None
    uni = _unigram(args, out, alphabet, dtype, V, sizes) if V else None
    meta = {"name": name, "dataset": args.dataset, "lang": args.lang, "alphabet": alphabet,
            "vocab_size": len(alphabet), "space_id": space_id,
            "newline_id": alphabet.index("\n") if "\n" in alphabet else None, "dtype": dtype,
            "sizes": sizes, "source": sources, "cleaning": {**key, "split": rule}, "inputs": inputs,
            "mean_word_length": round(mwl, 4) if mwl else None, "unigram": uni}
    tmp = _tmp(out / "meta.json")
    tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    _commit(tmp, out / "meta.json")

    print(f"\n== {out} ==")
    print(f"dataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} ({dtype}), split: {rule}")
    print("chars: " + ", ".join(f"{s} {sizes[s]:,}" for s in SPLITS))
    print(f"mean word length (whitespace shortening factor, train): {mwl:.3f}" if mwl else "no spaces in train")
    if uni:
        print(f"unigram-{V} shortening factor: " + ", ".join(f"{s} {v}" for s, v in uni["shortening_factor"].items()))
    if rate:
        print(f"cleaning rate: {rate / 1e6:.2f} M chars/s")
    return meta


SPLITS = ("train", "valid", "test")


def _splits(args, out, alphabet, dtype, lang, key, inputs):
    """Builds train/valid/test.bin unless an earlier run with the same options and input did;
    returns (sizes, sources, split rule, cleaning rate)."""
    stamp_path, itemsize = out / ".splits.json", np.dtype(dtype).itemsize
    try:
        stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    except ValueError:
        stamp = None
    if stamp and not args.force:
        if stamp.get("key") != key:
            die(f"{out} holds data prepared with other options ({_differs(stamp.get('key') or {}, key)}); "
                "pass --force to rebuild it, or --name NEW for a separate dataset")
        if stamp.get("inputs") != inputs:
            print(f"input changed since {out} was prepared (size, mtime or SHA-256): rebuilding", file=sys.stderr)
        elif all((out / f"{s}.bin").exists() and os.path.getsize(out / f"{s}.bin") == stamp["sizes"][s] * itemsize
                 for s in SPLITS):
            print(f"splits done in {out}, skipping (--force redoes)")
            return stamp["sizes"], stamp["source"], stamp["rule"], stamp["rate"]
    for f in [out / "meta.json", stamp_path, *out.glob("unigram-*.model"), *out.glob("*.unigram-*.bin")]:
        f.unlink(missing_ok=True)  # outputs of an earlier run go before the new ones are made
    sources, rule, stats = build_splits(args, out, alphabet, dtype, lang)
    sizes = {s: os.path.getsize(out / f"{s}.bin") // itemsize for s in SPLITS}
    src = ", ".join(map(str, sources))
    letters, signs = (stats["letters"], stats["signs"]) if lang else (sum(sizes.values()),) * 2
    why = None
    if stats["raw"] == 0 and lang or sum(sizes.values()) == 0 and not lang:
        why = f"no text in {src} (empty input?)"
    elif letters <= 0 or letters < 0.5 * signs:
        why = (f"only {max(letters, 0)} of the {signs} non-space, non-digit characters of {src} are {lang} "
               f"letters after cleaning ({''.join(LANGS[lang]['letters'][:3])}...); wrong --lang?")
    elif min(sizes.values()) == 0:
        why = (f"{src} is too small: it cleans to {sum(sizes.values())} characters, leaving an empty split "
               f"({', '.join(f'{s} {n}' for s, n in sizes.items())}); give more text")
    if why:
        for s in SPLITS:
            (out / f"{s}.bin").unlink(missing_ok=True)
        die(why)
    rate = stats["raw"] / stats["clean_s"] if stats["clean_s"] else None
    tmp = _tmp(stamp_path)
    tmp.write_text(json.dumps({"key": key, "inputs": inputs, "sizes": sizes, "source": sources,
                               "rule": rule, "rate": rate}, ensure_ascii=False))
    _commit(tmp, stamp_path)
    return sizes, sources, rule, rate


def _unigram(args, out, alphabet, dtype, V, sizes):
    """Fits SentencePiece Unigram-V on train and labels every split, unless done already."""
    meta_path, model_path = out / "meta.json", out / f"unigram-{V}.model"
    label_paths = {s: out / f"{s}.unigram-{V}.bin" for s in SPLITS}
    try:
        old = json.loads(meta_path.read_text()).get("unigram") if meta_path.exists() and not args.force else None
    except ValueError:
        old = None
    if old and old.get("vocab_size") == V and model_path.exists() and all(
            label_paths[s].exists() and os.path.getsize(label_paths[s]) == sizes[s] for s in SPLITS):
        print(f"unigram-{V} done, skipping (--force redoes)")
        return old
    meta_path.unlink(missing_ok=True)
    spm = _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
    t0 = time.time()
    print(f"unigram-{V}: training SentencePiece on up to {args.unigram_sample_chars:,} train characters",
          file=sys.stderr, flush=True)
    proto = train_unigram(out, alphabet, dtype, V, args.unigram_sample_chars)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    sf = {}
    for s in SPLITS:
        ones = unigram_labels(sp, out / f"{s}.bin", label_paths[s], alphabet, dtype)
        sf[s] = round(sizes[s] / ones, 4) if ones else None
    tmp = _tmp(model_path)
    tmp.write_bytes(proto)
    _commit(tmp, model_path)
    print(f"unigram-{V}: trained and labelled in {time.time() - t0:.1f}s")
    return {"vocab_size": V, "model": model_path.name, "shortening_factor": sf}


if __name__ == "__main__":
    main()
