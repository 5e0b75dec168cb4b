"""
Download, clean, split and encode character-level LM data for dynpool.

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --input text8-head.txt   # offline: a text8 file or slice -> data/text8
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --lang fi --unigram 0    # wiki40b Finnish, no Unigram boundaries
    python prepare_data.py --dataset cc100 --lang en --max-train-chars 100000000
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --name he-small --unigram 1000               # more labels, same splits

Output: data/<name>/{train,valid,test}.bin (uint8 token ids, memmap), meta.json, and per Unigram
size V: unigram-V.model + {split}.unigram-V.bin boundary labels (meta.json "unigram_sets" lists
every set present; "unigram" is the one train.py uses, the last one made).

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
  5% test (cut on characters, like text8), read up to max-train-chars / 0.9 characters. A text8
  --input shorter than text8 is recorded (meta.json "slice") and said to be a slice.
- Downloads: wiki40b through huggingface_hub (its cache, resume, token, offline mode); text8 and
  cc-100 over urllib with progress, retries with back-off, and resume with HTTP Range guarded by
  If-Range, so a file changed on the server is fetched anew rather than spliced. A host that
  cannot be resolved or refuses the connection fails at once, with the offline command.
- Every output is written to *.tmp and renamed when complete; meta.json is written last, so a
  directory without meta.json is never a finished one. Re-runs skip finished steps (--force); a
  re-run with other cleaning options is refused, an input edited in place (size, mtime, SHA-256)
  is rebuilt (inputs are compared by their resolved paths), and a second run on the same dataset
  is refused by a lock (<out>/.lock, removed by the run that holds it when it ends). Flags not
  given on an existing dataset take its recorded values. Every fix printed is a runnable command;
  prepare_command(meta, unigram=V) gives the one that adds Unigram-V labels to a dataset.
- Unigram boundaries (the paper's subword supervision): SentencePiece Unigram with the paper's
  released settings (dummy prefix, pieces up to 16 characters, digits split), fitted on the counts
  of every distinct train word (the whole split), in a child process so that Ctrl-C stops it at
  once. Words are encoded as SentencePiece sees them (▁word); the labels mark the last character of
  every piece, and the space/newline after a word closes its last piece, so every whitespace
  boundary is a Unigram boundary. Printed and recorded beside the labels' shortening factor: the
  left-context ceiling, the shortening factor and in-word recall of the Bayes decision of a causal
  predictor that sees the current word up to t (left_context_ceiling).
- LANGS holds the paper's per-language settings (Unigram size, Gumbel prior alpha), written to
  meta.json "defaults" for train.py.
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
import socket
import sys
import time
import unicodedata
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

# -----------------------------------------------------------------------------
# languages: alphabet (id order after '\n' and ' '), digit names, and the paper's per-language
# settings: Unigram vocabulary size of the boundary labels, Gumbel prior alpha (meta.json "defaults").
# The alphabets, digit names and pipeline order are those of the paper's released cleaner.

_AZ = "abcdefghijklmnopqrstuvwxyz"
_VI_VOWELS = "aăâeêioôơuưy"
_VI_TONES = "\u0300\u0301\u0309\u0303\u0323"  # grave, acute, hook, tilde, dot below

LANGS = {
    "en": dict(letters=_AZ, unigram=10000, prior=0.2,
               digits="zero one two three four five six seven eight nine"),
    "fi": dict(letters=_AZ + "åäö", unigram=200, prior=0.37,
               digits="nolla yksi kaksi kolme neljä viisi kuusi seitsemän kahdeksan yhdeksän"),
    # 27 letters (finals included), then maqaf, geresh, gershayim (as in צה״ל)
    "he": dict(letters="".join(chr(c) for c in range(0x5D0, 0x5EB)) + "\u05be\u05f3\u05f4",
               unigram=200, prior=0.2, digits="אפס אחד שנים שלשה ארבעה חמשה ששה שבעה שמונה תשעה"),
    # no f, j, w, z; the tone-marked vowels precomposed (NFC)
    "vi": dict(letters="abcdeghiklmnopqrstuvxy" + "ăâđêôơư" + "".join(
        unicodedata.normalize("NFC", v + t) for v in _VI_VOWELS for t in _VI_TONES),
               unigram=10000, prior=0.2, digits="không một hai ba bốn năm sáu bảy tám chín"),
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
            except urllib.error.URLError as e:
                if isinstance(e.reason, socket.gaierror):  # no network or no such host: waiting will not help
                    raise DownloadError(f"{self.url}: cannot resolve the host ({e.reason.strerror or e.reason})") from None
                if isinstance(e.reason, ConnectionRefusedError):
                    raise DownloadError(f"{self.url}: connection refused") from None
                err = _why(e.reason) if isinstance(e.reason, BaseException) else str(e.reason)
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

# The paper's released tokenizer settings; fitted on the word counts of the whole train split.
UNIGRAM_SETTINGS = dict(model_type="unigram", add_dummy_prefix=True, max_sentencepiece_length=16,
                        split_digits=True, split_by_whitespace=True, split_by_unicode_script=True,
                        remove_extra_whitespaces=True, normalization_rule_name="identity",
                        character_coverage=1.0)
_DUMMY = "\u2581"  # SentencePiece's word-start mark, added before every word (add_dummy_prefix)


def split_words(path, alphabet, dtype):
    """{word: count} of one split; words are cut at spaces and newlines."""
    import collections
    counts, carry = collections.Counter(), ""
    for text in _decode_blocks(path, alphabet, dtype):
        parts = (carry + text).replace("\n", " ").split(" ")
        carry = parts.pop()  # maybe a word cut by the block edge
        counts.update(parts)
    counts.update([carry])
    counts.pop("", None)
    return counts


def train_unigram(train_words, alphabet, V, max_words):
    """SentencePiece Unigram-V model proto fitted on {word: count} (the most frequent max_words
    words, all when 0), in a child process; stops with a runnable fix when V does not fit."""
    _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
    if not train_words:
        die("the train split has no words: nothing to fit Unigram on (pass --unigram 0)")
    words = train_words.most_common(max_words or None)
    letters = "".join(c for c in alphabet if c not in " \n")
    # each letter once more as a word of its own, so letters the text lacks still get a piece
    rows = [f"{w}\t{n}" for w, n in words] + [f"{c}\t1" for c in letters]
    ok, result = _in_child(_fit_unigram, rows, letters, V)
    if ok:
        return result
    m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", result)
    if m:
        raise UnigramSizeError(f"--unigram {V} is too large for this text (SentencePiece allows at most {m[2]} "
                               "here)", int(m[2]))
    m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", result)
    if m:
        raise UnigramSizeError(f"--unigram {V} is too small for this alphabet (SentencePiece needs at least "
                               f"{m[2]} pieces here)", int(m[2]))
    die(f"SentencePiece failed: {result}")


class UnigramSizeError(Exception):
    """A Unigram size the text or alphabet cannot take; .fit is one that works."""

    def __init__(self, msg, fit):
        super().__init__(msg)
        self.fit = fit


def _fit_unigram(rows, letters, V):
    """(True, model proto) or (False, SentencePiece's message); run in a child process."""
    import sentencepiece as spm
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            # one "word<TAB>count" row per distinct word: the whole split at the cost of its vocabulary
            sentence_iterator=iter(rows), input_format="tsv", model_writer=model, vocab_size=V,
            required_chars=letters, bos_id=-1, eos_id=-1, max_sentence_length=1 << 16,
            num_threads=min(4, os.cpu_count() or 1), minloglevel=2, **UNIGRAM_SETTINGS)
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


def word_labels(sp, words):
    """{word: in-word labels}, one byte per character: 1 at the last character of every piece
    but the word's last one (that piece is closed by the space after the word). SentencePiece
    sees each word as "▁word" (dummy prefix); the ▁ is dropped, and a piece that is only ▁
    with it."""
    words = list(words)
    out = {}
    for w, pieces in zip(words, sp.encode(words, out_type=str) if words else []):
        if pieces and pieces[0].startswith(_DUMMY):
            pieces = [pieces[0][1:]] + pieces[1:]
        pieces = [p for p in pieces if p]
        if "".join(pieces) != w:  # cannot happen with identity normalisation and full coverage
            pieces = list(w)
        lab, pos = bytearray(len(w)), -1
        for p in pieces[:-1]:
            pos += len(p)
            lab[pos] = 1
        out[w] = bytes(lab)
    return out


def unigram_labels(sp, split_path, out_path, alphabet, dtype):
    """b_t = 1 where a piece ends; spaces/newlines close the word before them. Returns sum(b)."""
    cache = {"": b"\x01"}

    def fill(words):
        if len(cache) > 500_000:  # bound memory on 400M chars; hot words come straight back
            cache.clear()
            cache[""] = b"\x01"
        for w, lab in word_labels(sp, {w for w in words if w not in cache}).items():
            cache[w] = lab + b"\x01"

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


def left_context_ceiling(train_words, valid_words, labels):
    """The best a causal boundary predictor can do on these labels from the current word alone.
    At an in-word position t it has seen the word's characters up to t (its prefix), not the
    rest: the Bayes decision is b_t = 1 iff P(b_t = 1 | prefix) > 0.5, counted on train_words
    ({word: count}); a prefix train never shows gets 0. Applied to valid_words, it returns
    {"ends": in-word label ends, "predicted": in-word decisions of 1, "hits": both, "in_word_recall"}.
    labels: {word: in-word labels (one 0/1 per character)} for every word of both."""
    wanted = {w[:k + 1] for w in valid_words for k in range(len(w))}
    total, ones = dict.fromkeys(wanted, 0), dict.fromkeys(wanted, 0)
    for w, n in train_words.items():
        lab = labels[w]
        for k in range(len(w)):
            p = w[:k + 1]
            if p not in total:  # its longer prefixes are not wanted either
                break
            total[p] += n
            ones[p] += n * lab[k]
    ends = predicted = hits = 0
    for w, n in valid_words.items():
        lab = labels[w]
        for k in range(len(w)):
            p = w[:k + 1]
            decide = 2 * ones[p] > total[p]
            ends += n * lab[k]
            predicted += n * decide
            hits += n * (decide and lab[k])
    return {"ends": ends, "predicted": predicted, "hits": hits,
            "in_word_recall": hits / ends if ends else None}

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
# command line: every flag checked as it is parsed (exit 2, one line naming the flag)


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


def _int_in(lo, hi, zero=None):
    """An argparse type: an integer in [lo, hi], or 0 where zero says what 0 means."""
    allowed = f"an integer from {lo:,} to {hi:,}" + (f", or 0 ({zero})" if zero else "")

    def parse(value):
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer; expected {allowed}") from None
        if not (lo <= v <= hi or (zero and v == 0)):
            raise argparse.ArgumentTypeError(f"{v} is out of range; expected {allowed}")
        return v
    return parse


def _float_in(lo, hi):
    """An argparse type: a finite number in [lo, hi]."""
    def parse(value):
        try:
            v = float(value)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:  # NaN fails both comparisons, inf the upper one
            raise argparse.ArgumentTypeError(f"{value!r} is not a number from {lo:g} to {hi:g}")
        return v
    return parse


def _lang_flag(value):
    if value not in LANGS:
        raise argparse.ArgumentTypeError(
            f"unknown language {value!r}; known: {', '.join(sorted(LANGS))} (their alphabets and digit names "
            "are in LANGS in prepare_data.py)")
    return value


def _name_flag(value):
    """An argparse type: one folder name (the dataset's, under --out-dir)."""
    if value in ("", ".", "..") or "/" in value or "\0" in value:
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder name (no '/', not '.' or '..')")
    if len(os.fsencode(value)) > 255:
        raise argparse.ArgumentTypeError(f"{value[:40]!r}... is longer than 255 bytes")
    return value


def _path_problem(path):
    """Why a path cannot name a file at all (a name over 255 bytes, too long, a file used as a
    folder, no permission to look inside a folder), or None."""
    try:
        name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    s = os.fsencode(path)
    long = next((c for c in s.split(b"/") if len(c) > name_max), None)
    if long is not None:
        return f"a name in it is longer than {name_max} bytes ({os.fsdecode(long[:40])}...)"
    if len(s) >= path_max:
        return f"it is longer than {path_max - 1} bytes"
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "a part of it is a file, not a folder"
    except OSError as e:
        return e.strerror or _why(e)
    return None


def _short(path):
    s = str(path)
    return s if len(s) <= 200 else f"{s[:100]}...{s[-60:]}"


def _input_file(value):
    """An argparse type: an existing, readable regular file (a FIFO would block the read)."""
    import stat
    p = Path(value)
    why = _path_problem(p)
    if why is None:
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            why = "no such file"
        else:
            if stat.S_ISDIR(mode):
                why = "a folder, not a file"
            elif not stat.S_ISREG(mode):
                why = "not a regular file (a pipe or device?)"
            elif not os.access(p, os.R_OK):
                why = "not readable (permission denied)"
    if why:
        raise argparse.ArgumentTypeError(f"input file {_short(value)}: {why}")
    return p


def _dir_flag(value):
    """An argparse type: a folder that exists or can be made (checked for writing later)."""
    p = Path(value)
    why = _path_problem(p)
    if why is None and p.exists() and not p.is_dir():
        why = "a file, not a folder"
    if why:
        raise argparse.ArgumentTypeError(f"{_short(value)}: {why}")
    return p


DEFAULTS = dict(max_train_chars=400_000_000, max_eval_chars=2_000_000, fold_accents=False)


def _parser():
    p = _Parser(description="Download, clean, split and encode data for dynpool. Flags shown with a default "
                            "that says 'as recorded' take the value recorded by the dataset already in "
                            "--out-dir/--name when not given (so adding labels needs only --name and --unigram).")
    p.add_argument("--dataset", choices=["text8", "wiki40b", "cc100", "input"], default=None,
                   help="source (default: the existing dataset's, else text8 without --lang, wiki40b with it, "
                        "input with --input and --lang)")
    p.add_argument("--lang", type=_lang_flag, default=None,
                   help=f"language, one of {', '.join(sorted(LANGS))} (default: as recorded, else en for text8; "
                        "needed for the others)")
    p.add_argument("--input", nargs="+", type=_input_file, default=None, metavar="FILE",
                   help="local .txt/.zip/.xz/.gz/.parquet file(s) instead of downloading; one file is cut "
                        "90/5/5, several named *train*/*valid*/*test* keep their splits (default: as recorded, "
                        "else download)")
    p.add_argument("--name", type=_name_flag, default=None,
                   help="output folder name under --out-dir (default text8, wiki40b-<lang>, cc100-<lang>, "
                        "input-<lang>)")
    p.add_argument("--out-dir", type=_dir_flag, default=Path("data"), help="parent of the output folder (default data)")
    p.add_argument("--fold-accents", action="store_true", default=None,
                   help="fold letters outside the alphabet to its letters (é -> e, ß -> ss, niqqud dropped) "
                        "instead of the paper's space (default: as recorded, else off)")
    p.add_argument("--max-train-chars", type=_int_in(1, 10 ** 12), default=None,
                   help="cap on cleaned train characters (default: as recorded, else 400M)")
    p.add_argument("--max-eval-chars", type=_int_in(1, 10 ** 12), default=None,
                   help="cap on cleaned valid and test characters each (default: as recorded, else 2M)")
    p.add_argument("--unigram", type=_int_in(2, 1_000_000, zero="make no Unigram labels"), default=None,
                   help="SentencePiece Unigram vocabulary size of the boundary labels (default per language: "
                        + ", ".join(f"{k} {v['unigram']}" for k, v in sorted(LANGS.items())) + ", text8 10000). "
                        "Labels of other sizes already in the dataset are kept (meta.json lists them all); "
                        "the same size made with other settings is replaced. 0 makes none and keeps those "
                        "present; --force rebuilds the dataset without them")
    p.add_argument("--unigram-max-words", type=_int_in(1, 10 ** 9, zero="every distinct word"), default=0,
                   help="fit Unigram on the counts of this many most frequent distinct train words "
                        "(default 0: every distinct word of the train split, i.e. the whole split)")
    p.add_argument("--force", action="store_true", help="redo finished steps (completed downloads are kept; default off)")
    p.add_argument("--hf-base", type=_url, default=None,
                   help="Hugging Face hub endpoint (default: huggingface_hub's, i.e. HF_ENDPOINT or huggingface.co)")
    p.add_argument("--hf-cache", type=_dir_flag, default=None,
                   help="huggingface_hub cache dir for the wiki40b shards (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    p.add_argument("--text8-url", type=_url,
                   default=os.environ.get("DYNPOOL_TEXT8_URL", "http://mattmahoney.net/dc/text8.zip"),
                   help="text8.zip URL (default: env DYNPOOL_TEXT8_URL, else http://mattmahoney.net/dc/text8.zip)")
    p.add_argument("--cc100-base", type=_url, default=os.environ.get("DYNPOOL_CC100_BASE", "https://data.statmt.org/cc-100"),
                   help="cc-100 base URL holding <lang>.txt.xz (default: env DYNPOOL_CC100_BASE, else "
                        "https://data.statmt.org/cc-100)")
    p.add_argument("--retries", type=_int_in(0, 100), default=5,
                   help="download retries per request, 0 to 100 (default 5; a host that cannot be resolved "
                        "or refuses the connection fails at once)")
    p.add_argument("--backoff", type=_float_in(0, 3600), default=2.0,
                   help="first retry delay in seconds, doubled each retry, 0 to 3600 (default 2)")
    return p


def command(dataset=None, lang=None, inputs=None, name=None, out_dir=None, unigram=None, fold_accents=False,
            max_train_chars=None, max_eval_chars=None, unigram_max_words=0, force=False):
    """The prepare_data.py command line with these options, quoted for a POSIX shell; options at
    their defaults are left out."""
    import shlex
    argv = ["python", "prepare_data.py"]
    if dataset:
        argv += ["--dataset", dataset]
    if lang and dataset != "text8":
        argv += ["--lang", lang]
    if inputs:
        argv += ["--input", *map(str, inputs)]
    if name:
        argv += ["--name", str(name)]
    if out_dir is not None and Path(out_dir) != Path("data"):
        argv += ["--out-dir", str(out_dir)]
    if fold_accents:
        argv.append("--fold-accents")
    for flag, v in (("--max-train-chars", max_train_chars), ("--max-eval-chars", max_eval_chars)):
        if v is not None and v != DEFAULTS[flag[2:].replace("-", "_")]:
            argv += [flag, str(v)]
    if unigram is not None:
        argv += ["--unigram", str(unigram)]
    if unigram_max_words:
        argv += ["--unigram-max-words", str(unigram_max_words)]
    if force:
        argv.append("--force")
    return " ".join(shlex.quote(a) for a in argv)


def prepare_command(meta, unigram=None, data_dir=None):
    """The exact command that (re)makes the dataset `meta` describes (a meta.json dict), with
    Unigram-`unigram` labels when given; data_dir: where the dataset lies (default data/<name>).
    Run on an existing dataset, it keeps the splits and adds the labels. Without meta, the
    command for a dataset of that name, with FILE/LANG for what only the user knows."""
    d = Path(data_dir) if data_dir is not None else Path("data") / str((meta or {}).get("name", "text8"))
    if not isinstance(meta, dict) or not isinstance(meta.get("cleaning"), dict):
        kind, _, lang = d.name.partition("-")
        if d.name == "text8":
            return command(out_dir=d.parent, unigram=unigram)
        if kind in ("wiki40b", "cc100") and lang in LANGS:
            return command(kind, lang, out_dir=d.parent, unigram=unigram)
        return command("input", "LANG", ["FILE"], d.name, d.parent, unigram)
    c = meta["cleaning"]
    default_name = _default_name(meta.get("dataset"), meta.get("lang"))
    return command(meta.get("dataset"), meta.get("lang"), c.get("input"), None if d.name == default_name else d.name,
                   d.parent, unigram, c.get("fold_accents"), c.get("max_train_chars"), c.get("max_eval_chars"))


def _default_name(dataset, lang):
    return {"text8": "text8", "input": f"input-{lang}"}.get(dataset, f"{dataset}-{lang}")


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        die("interrupted; finished steps and completed downloads kept (a re-run continues), "
            "temp files removed", 130)
    except DownloadError as e:
        die(f"download failed: {e}. {_offline_howto(args)}")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            die(f"disk full while writing {getattr(e, 'filename', None) or args.out_dir}; free space or use --out-dir")
        die(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}")
    finally:
        _remove_temps()


def _offline_howto(args):
    """What to do without network, as a command that runs once the file is fetched by hand."""
    same = dict(name=args.name, out_dir=args.out_dir, unigram=args.unigram, fold_accents=args.fold_accents,
                max_train_chars=args.max_train_chars, max_eval_chars=args.max_eval_chars,
                unigram_max_words=args.unigram_max_words)
    if args.dataset == "wiki40b":
        shards = ["train-*.parquet", "validation-*.parquet", "test-*.parquet"]
        cmd = command("wiki40b", args.lang, shards, **same).replace(" ".join(f"'{g}'" for g in shards), " ".join(shards))
        what = f"the {args.lang}/*.parquet shards of {WIKI40B} (a dataset on the Hugging Face hub)"
        alt = "set HF_HUB_OFFLINE=1 to use the shards already cached, or "
    elif args.dataset == "cc100":
        what, alt = f"{args.cc100_base}/{args.lang}.txt.xz (or its head)", ""
        cmd = command("cc100", args.lang, [f"{args.lang}.txt.xz"], **same)
    else:
        what, alt = args.text8_url, ""
        cmd = command("text8", None, [Path(args.text8_url).name or "text8.zip"], **same)
    return f"Without network, {alt}fetch {what} by hand into the current folder and run: {cmd}"


def _existing(out):
    """The options recorded by the dataset already in `out` ({} if none or unreadable)."""
    try:
        stamp = json.loads((out / ".splits.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    key = stamp.get("key") if isinstance(stamp, dict) else None
    return key if isinstance(key, dict) and key.get("dataset") in ("text8", "wiki40b", "cc100", "input") else {}


def _resolve(args):
    """Fills in --dataset, --lang, --input and the cleaning flags (from the dataset already there
    when not given), checks them together; returns (out, name, Unigram size or None for default)."""
    dataset = args.dataset or (("input" if args.lang else "text8") if args.input else ("wiki40b" if args.lang else "text8"))
    name = args.name or _default_name(dataset, args.lang or "en")
    out = args.out_dir / name
    old = _existing(out)
    old_lang = old.get("lang") or ("en" if old.get("dataset") == "text8" else None)
    if old and args.dataset in (None, old["dataset"]) and args.lang in (None, old_lang):
        if args.dataset is None and dataset != old["dataset"]:
            print(f"{out} holds a {old['dataset']} dataset: preparing it as --dataset {old['dataset']} "
                  "(pass --dataset to choose another, with --force or another --name)", file=sys.stderr)
        dataset, args.lang = old["dataset"], old_lang
        if args.input is None and args.dataset is None and old.get("input"):  # --dataset alone: its download
            args.input = [Path(p) for p in old["input"]]
            gone = [p for p in args.input if not p.is_file()]
            if gone:
                die(f"input file {_short(gone[0])} recorded by {out} is gone; pass --input FILE")
        for k in DEFAULTS:
            if getattr(args, k) is None and k in old:
                setattr(args, k, old[k])
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dataset = dataset
    if dataset == "text8":
        if args.lang not in (None, "en"):
            die(f"text8 is English; got --lang {args.lang}", 2)
        args.lang = "en"
    elif args.lang is None:
        die(f"--dataset {dataset} needs --lang ({', '.join(sorted(LANGS))})", 2)
    if dataset == "input" and not args.input:
        die("--dataset input needs --input FILE...", 2)
    return out, name


@contextlib.contextmanager
def _lock(out):
    """An advisory lock on <out>/.lock for the whole run; the OS drops it when the process dies,
    and the run that holds it removes the file when it ends, however it ends."""
    import fcntl
    path = out / ".lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            die(f"{out} is being prepared by another run (pid {pid}); wait for it to finish or pass another --name")
        # a run that ended between our open and flock removed the file we locked: lock the new one
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # still locked: no other run can hold this file now
        os.close(fd)


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
    out, name = _resolve(args)
    lang = None if args.dataset == "text8" else args.lang  # text8 is already clean: kept as is
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        die(f"cannot write to output dir {_short(out)}: {e.strerror or e}")
    try:
        with _lock(out):
            return _prepare(args, out, name, lang)
    finally:
        if made:  # a run that failed before writing anything leaves no empty folders
            for d in (out / "download", out):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()


TEXT8_CHARS = 100_000_000
SPLITS = ("train", "valid", "test")


def _prepare(args, out, name, lang):
    alphabet = TEXT8_ALPHABET if lang is None else ["\n", " "] + list(LANGS[lang]["letters"])
    dtype = "uint8" if len(alphabet) <= 256 else "uint16"
    cleaning = cleaning_options(args, lang)
    resolved = [p.resolve() for p in args.input] if args.input else None  # one file, however it is named
    key = {"dataset": args.dataset, **cleaning, "max_train_chars": args.max_train_chars,
           "max_eval_chars": args.max_eval_chars, "input": [str(p) for p in resolved] if resolved else None}
    inputs = [fingerprint(p) for p in resolved] if resolved else None
    sizes, sources, rule, rate = _splits(args, out, alphabet, dtype, lang, key, inputs)
    space_id = alphabet.index(" ")
    n_space = count_id(out / "train.bin", dtype, space_id)
    mwl = sizes["train"] / n_space if n_space else None
    n = sum(sizes.values())
    part = {"of": "text8", "chars": n, "full_chars": TEXT8_CHARS} if args.dataset == "text8" and n < TEXT8_CHARS else None
    meta = {"name": name, "dataset": args.dataset, "lang": args.lang, "alphabet": alphabet,
            "vocab_size": len(alphabet), "space_id": space_id,
            "newline_id": alphabet.index("\n") if "\n" in alphabet else None, "dtype": dtype,
            "sizes": sizes, "source": sources, "slice": part, "cleaning": {**key, "split": rule}, "inputs": inputs,
            "mean_word_length": round(mwl, 4) if mwl else None,
            "defaults": {"unigram": LANGS[args.lang]["unigram"], "prior": LANGS[args.lang]["prior"]}}
    meta.update(_unigram(args, out, alphabet, dtype, sizes, meta))
    _write_meta(out, meta)

    print(f"\n== {out} ==")
    print(f"dataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} ({dtype}), split: {rule}")
    if part:
        print(f"note: a {n:,}-character slice of text8 ({', '.join(sources)}), not the full {TEXT8_CHARS:,}")
    print("chars: " + ", ".join(f"{s} {sizes[s]:,}" for s in SPLITS))
    print(f"mean word length (whitespace shortening factor, train): {mwl:.3f}" if mwl else "no spaces in train")
    for V, u in sorted(meta["unigram_sets"].items(), key=lambda kv: int(kv[0])):
        print(_unigram_line(u) + (" [default for train.py]" if meta["unigram"] is u else ""))
    if rate:
        print(f"cleaning rate: {rate / 1e6:.2f} M chars/s")
    return meta


def _unigram_line(u):
    sf = ", ".join(f"{s} {v}" for s, v in u["shortening_factor"].items())
    c = u.get("left_context_ceiling") or {}
    ceil = (f"; left-context ceiling on valid: SF {c['shortening_factor']}, in-word recall "
            f"{100 * c['in_word_recall']:.1f}%") if c.get("in_word_recall") is not None else ""
    return f"unigram-{u['vocab_size']} shortening factor: {sf}{ceil}"


def _write_meta(out, meta):
    tmp = _tmp(out / "meta.json")
    tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    _commit(tmp, out / "meta.json")


def _splits(args, out, alphabet, dtype, lang, key, inputs):
    """Builds train/valid/test.bin unless an earlier run with the same options and input did;
    returns (sizes, sources, split rule, cleaning rate)."""
    stamp_path, itemsize = out / ".splits.json", np.dtype(dtype).itemsize
    try:
        stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    except ValueError:
        stamp = None
    if not (isinstance(stamp, dict) and isinstance(stamp.get("key"), dict) and isinstance(stamp.get("sizes"), dict)):
        stamp = None
    if stamp and not args.force:
        old = dict(stamp["key"])
        if isinstance(old.get("input"), list):  # one file, however an older run named it
            old["input"] = [str(Path(p).resolve()) for p in old["input"]]
        if old != key:
            die(f"{out} holds data prepared with other options ({_differs(old, key)}); "
                f"to rebuild it run: {_rerun(args, force=True)}; or pass --name NEW for a separate dataset")
        old_inputs = [{**f, "path": str(Path(f["path"]).resolve())} for f in stamp.get("inputs") or []
                      if isinstance(f, dict) and "path" in f] or None
        if old_inputs != inputs:
            print(f"input changed since {out} was prepared (size, mtime or SHA-256): rebuilding", file=sys.stderr)
        elif all((out / f"{s}.bin").exists() and os.path.getsize(out / f"{s}.bin") == stamp["sizes"].get(s, -1) * itemsize
                 for s in SPLITS):
            print(f"splits done in {out}, skipping (--force redoes)")
            return stamp["sizes"], stamp.get("source"), stamp.get("rule"), stamp.get("rate")
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


def _rerun(args, **change):
    """This run's command line, as resolved, with some options changed."""
    opts = dict(dataset=args.dataset, lang=args.lang, inputs=[p.resolve() for p in args.input] if args.input else None,
                name=args.name, out_dir=args.out_dir, unigram=args.unigram, fold_accents=args.fold_accents,
                max_train_chars=args.max_train_chars, max_eval_chars=args.max_eval_chars,
                unigram_max_words=args.unigram_max_words, force=args.force)
    return command(**{**opts, **change})


def _bad_meta(path, args, what):
    die(f"{path}: {what}; fix it, or remove it and run again (splits kept, labels remade): {_rerun(args)}")


def _read_label_sets(out, args):
    """({V: entry}, default V) from the meta.json already in out, checked field by field;
    ({}, None) without one. An older meta.json's single "unigram" entry is read as one set."""
    path = out / "meta.json"
    if not path.exists():
        return {}, None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        _bad_meta(path, args, f"unreadable ({_why(e)})")
    if not isinstance(meta, dict):
        _bad_meta(path, args, f"holds a {type(meta).__name__}, expected an object")
    default, sets = meta.get("unigram"), meta.get("unigram_sets")
    if default is not None and not (isinstance(default, dict) and _is_size(default.get("vocab_size"))):
        _bad_meta(path, args, f"'unigram' is {_clip(default)}, expected null or an object with an integer vocab_size")
    if sets is None:
        sets = {str(default["vocab_size"]): {**default, "settings": default.get("settings")}} if default else {}
    if not isinstance(sets, dict):
        _bad_meta(path, args, f"'unigram_sets' is {_clip(sets)}, expected an object {{\"<V>\": {{...}}}}")
    out_sets = {}
    for k, u in sets.items():
        where = f"'unigram_sets'[{k!r}]"
        if not (isinstance(u, dict) and _is_size(u.get("vocab_size")) and str(u["vocab_size"]) == k):
            _bad_meta(path, args, f"{where} is {_clip(u)}, expected an object whose vocab_size is {k}")
        V = u["vocab_size"]
        if u.get("model") != f"unigram-{V}.model":
            _bad_meta(path, args, f"{where}['model'] is {_clip(u.get('model'))}, expected 'unigram-{V}.model'")
        if not isinstance(u.get("shortening_factor"), dict):
            _bad_meta(path, args, f"{where}['shortening_factor'] is {_clip(u.get('shortening_factor'))}, expected an object")
        if not isinstance(u.get("settings"), (dict, type(None))):
            _bad_meta(path, args, f"{where}['settings'] is {_clip(u.get('settings'))}, expected an object or null")
        out_sets[V] = u
    if default and default["vocab_size"] not in out_sets:
        _bad_meta(path, args, f"'unigram' names vocab_size {default['vocab_size']}, which 'unigram_sets' lacks")
    return out_sets, default["vocab_size"] if default else None


def _is_size(v):
    return type(v) is int and v > 0


def _clip(v):
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def _label_files(out, V):
    return [out / f"unigram-{V}.model"] + [out / f"{s}.unigram-{V}.bin" for s in SPLITS]


def _reconcile(out, sets, sizes):
    """Keeps the label sets whose files are all there at full length; removes label files no set
    describes, saying so: afterwards meta.json's sets and the files agree."""
    for V in sorted(sets):
        files = _label_files(out, V)
        if not all(f.exists() for f in files) or any(os.path.getsize(out / f"{s}.unigram-{V}.bin") != sizes[s]
                                                     for s in SPLITS):
            print(f"unigram-{V}: label files missing or cut short; dropped (re-run with --unigram {V} to remake)",
                  file=sys.stderr)
            del sets[V]
    for f in sorted([*out.glob("unigram-*.model"), *out.glob("*.unigram-*.bin")]):
        m = re.search(r"unigram-(\d+)\.(?:model|bin)$", f.name)
        if not (m and int(m[1]) in sets and f in _label_files(out, int(m[1]))):
            print(f"removed {f.name}: no label set in meta.json describes it", file=sys.stderr)
            f.unlink()


def _unigram(args, out, alphabet, dtype, sizes, meta):
    """Makes Unigram-V labels unless a set with the same settings is there; keeps the other sets.
    Returns meta.json's {"unigram": default set, "unigram_sets": {"<V>": set}}."""
    sets, default = _read_label_sets(out, args)
    _reconcile(out, sets, sizes)
    V = args.unigram if args.unigram is not None else LANGS[args.lang]["unigram"]
    settings = {**UNIGRAM_SETTINGS, "fit_on": "train word counts",
                "max_words": args.unigram_max_words or None, "label_rule": "piece ends; the space closes its word"}
    if V and V in sets and sets[V].get("settings") == settings:
        print(f"unigram-{V} done, skipping (--force redoes the whole dataset)")
    elif V:
        if V in sets:
            print(f"unigram-{V}: made with other settings; replacing it", file=sys.stderr)

        def drop_old():  # once the new model is fitted, the old set leaves meta.json before its files change
            if sets.pop(V, None) and (out / "meta.json").exists():
                _write_meta(out, {**meta, **_label_meta(sets, default)})
        sets[V] = _make_unigram(args, out, alphabet, dtype, sizes, V, settings, drop_old)
    elif sets:
        print(f"--unigram 0: keeping the labels already in {out} (unigram-{', unigram-'.join(map(str, sorted(sets)))}); "
              "--force rebuilds the dataset without them")
    return _label_meta(sets, V if V in sets else default)


def _label_meta(sets, default):
    if default not in sets:
        default = max(sets) if sets else None
    return {"unigram": sets[default] if default else None,
            "unigram_sets": {str(V): sets[V] for V in sorted(sets)}}


def _make_unigram(args, out, alphabet, dtype, sizes, V, settings, drop_old):
    """Fits Unigram-V on the train split's word counts, writes its labels; returns its set entry
    with the labels' shortening factors and their left-context ceiling."""
    spm = _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
    t0 = time.time()
    train_words = split_words(out / "train.bin", alphabet, dtype)
    used = min(len(train_words), args.unigram_max_words or len(train_words))
    print(f"unigram-{V}: training SentencePiece on the counts of {used:,} distinct train words",
          file=sys.stderr, flush=True)
    try:
        proto = train_unigram(train_words, alphabet, V, args.unigram_max_words)
    except UnigramSizeError as e:
        die(f"{e}; run: {_rerun(args, unigram=e.fit)}; or --unigram 0 to skip Unigram boundaries")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    drop_old()
    ones = {s: unigram_labels(sp, out / f"{s}.bin", out / f"{s}.unigram-{V}.bin", alphabet, dtype) for s in SPLITS}
    valid_words = split_words(out / "valid.bin", alphabet, dtype)
    c = left_context_ceiling(train_words, valid_words, word_labels(sp, set(train_words) | set(valid_words)))
    ceiling_ones = ones["valid"] - c["ends"] + c["predicted"]
    tmp = _tmp(out / f"unigram-{V}.model")  # the model last: labels without it are removed on re-run
    tmp.write_bytes(proto)
    _commit(tmp, out / f"unigram-{V}.model")
    print(f"unigram-{V}: trained and labelled in {time.time() - t0:.1f}s")
    return {"vocab_size": V, "model": f"unigram-{V}.model",
            "labels": {s: f"{s}.unigram-{V}.bin" for s in SPLITS}, "settings": settings,
            "fit_words": {"distinct_used": used, "distinct_in_train": len(train_words)},
            "shortening_factor": {s: round(sizes[s] / ones[s], 4) if ones[s] else None for s in SPLITS},
            "left_context_ceiling": {
                "split": "valid", "estimated_on": "train", "rule": "b_t = 1 iff P(b_t = 1 | word prefix up to t) > 0.5",
                "shortening_factor": round(sizes["valid"] / ceiling_ones, 4) if ceiling_ones else None,
                "in_word_recall": round(c["in_word_recall"], 4) if c["in_word_recall"] is not None else None,
                "in_word_ends": c["ends"], "in_word_predicted": c["predicted"], "in_word_hits": c["hits"]}}


if __name__ == "__main__":
    main()
