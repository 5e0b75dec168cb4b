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
- Cleaning follows the paper (Nawrot et al. 2023, Sec. 4.1): wiki40b markers removed, homoglyphs
  folded to basic letters, lower case, digits spelled out one word per digit, only the language's
  alphabet + space + newline kept, Hebrew niqqud dropped, Vietnamese kept precomposed (NFC).
  `clean(text, lang)` is the public entry point; everything streams in ~4 MB chunks.
- Splits: text8 the standard first 90M / next 5M / last 5M chars. wiki40b keeps the official
  train/validation/test splits, train capped at --max-train-chars, the others at --max-eval-chars.
  cc-100 (one stream, never fully downloaded): first --max-eval-chars cleaned chars -> valid, next
  ones -> test, the rest -> train up to its cap. A single --input file: first 90% train, 5% valid,
  5% test (cut on characters, like text8), read up to max-train-chars / 0.9 characters.
- Downloads: urllib only, progress on stderr, retry with exponential back-off, resume with HTTP
  Range after a dropped connection, written to *.part and renamed only when the size matches (a
  .part of the wrong size is deleted, so the next run starts over rather than trusting it).
- Every output is written to *.tmp and renamed when complete; meta.json is written last, so a
  directory without meta.json is never a finished one. Re-runs skip finished steps (--force).
- Unigram boundaries (the paper's subword supervision): SentencePiece is trained on whole words (one per sentence,
  no dummy prefix), so a piece never spans a space; the labels mark the end of every piece, with
  each space/newline attached to the word before it. Words are encoded once (cached), not per use.
  A --unigram too large for the text stops with a message giving the largest size that works.
"""

import argparse
import codecs
import errno
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

_VI_VOWELS = "aăâeêioôơuưy"
_VI_TONES = "\u0300\u0301\u0303\u0309\u0323"  # grave, acute, tilde, hook, dot below
_AZ = "abcdefghijklmnopqrstuvwxyz"

LANGS = {
    "en": dict(letters=_AZ, unigram=10000,
               digits="zero one two three four five six seven eight nine"),
    "fi": dict(letters=_AZ + "åäö", unigram=200,
               digits="nolla yksi kaksi kolme neljä viisi kuusi seitsemän kahdeksan yhdeksän"),
    "he": dict(letters="".join(chr(c) for c in range(0x5D0, 0x5EB)), unigram=200,  # incl. finals
               digits="אפס אחד שתיים שלוש ארבע חמש שש שבע שמונה תשע"),
    "vi": dict(letters=_AZ + "đăâêôơư" + "".join(unicodedata.normalize("NFC", v + t)
                                                 for v in _VI_VOWELS for t in _VI_TONES),
               unigram=10000, digits="không một hai ba bốn năm sáu bảy tám chín"),
}
TEXT8_ALPHABET = [" "] + list(_AZ)

# look-alike letters of other scripts, folded only inside words that also hold Latin letters
# (so "pаypal" with a Cyrillic а becomes "paypal", but a Russian word does not become junk)
_HOMOGLYPHS = dict(zip("аеорсухіјѕԁһӏԛԝАВЕКМНОРСТХІЈЅԜαονικρτυχεΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
                       "aeopcyxijsdhlqwabekmhopctxijswaovikptuxeabezhikmnoptyx"))
# Latin letters that no Unicode decomposition reduces to a basic letter
_LATIN_EXTRA = {"ß": "ss", "æ": "ae", "œ": "oe", "þ": "th", "ð": "d", "đ": "d", "ı": "i",
                "ł": "l", "ø": "o", "ŀ": "l", "ĸ": "k"}
_HEBREW_EXTRA = {"װ": "וו", "ױ": "וי", "ײ": "יי"}  # Yiddish ligatures
_MARKERS = re.compile(r"_START_(?:ARTICLE|SECTION|PARAGRAPH)_|_NEWLINE_")
_HOMO_RE = re.compile("[" + "".join(_HOMOGLYPHS) + "]")
_WORD_RE = re.compile(r"\w+")
_LATIN_RE = re.compile("[A-Za-z]")
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def die(msg, code=1):
    """A user-facing failure: one line on stderr, temp outputs removed, no traceback."""
    _remove_temps()
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def _why(e):
    """An exception's message, or its type's name where it has none."""
    return str(e) or type(e).__name__


def _lang(lang):
    if lang not in LANGS:
        raise ValueError(f"unsupported language {lang!r}; supported: {', '.join(sorted(LANGS))}")
    return LANGS[lang]


class _FoldTable(dict):
    """str.translate table filled lazily: every code point is decided once, then cached."""

    def __init__(self, lang):
        L = _lang(lang)
        self.letters = set(L["letters"])
        self.digits = L["digits"].split()
        self.extra = _HEBREW_EXTRA if lang == "he" else _LATIN_EXTRA

    def __missing__(self, cp):
        out = self[cp] = self._fold(chr(cp))
        return out

    def _ok(self, s):
        return s != "" and all(ch in self.letters for ch in s)

    def _fold(self, c):
        if c in self.letters:
            return c
        if c in _LINE_BREAKS:
            return "\n"
        d = unicodedata.decimal(c, None)
        if d is not None:  # "each digit its own word" (Sec. 4.1)
            return " " + self.digits[d] + " "
        for t in (c, c.lower()):
            if self._ok(t):
                return t
            t = "".join(self.extra.get(ch, ch) for ch in t)
            if self._ok(t):
                return t
            base = "".join(ch for ch in unicodedata.normalize("NFD", t) if not unicodedata.combining(ch))
            base = unicodedata.normalize("NFC", base)
            if self._ok(base):  # é -> e where é is not a letter of the language
                return base
        if unicodedata.category(c).startswith("M"):
            return ""  # niqqud and stray accents vanish without splitting the word
        return " "


_TABLES = {}


def clean(text: str, lang: str) -> str:
    """The paper's cleaning of raw text (Sec. 4.1). Output: alphabet letters, single spaces and
    single newlines only, no empty lines, no spaces at line ends; clean(clean(x)) == clean(x)."""
    table = _TABLES.get(lang)
    if table is None:
        table = _TABLES[lang] = _FoldTable(lang)
    text = _MARKERS.sub("\n", text)
    # NFKC folds compatibility forms (ligatures, full-width, superscripts, Hebrew presentation
    # forms) and composes Vietnamese letters; lower-casing and everything else is in the table
    if not text.isascii():  # ASCII is already NFKC
        text = unicodedata.normalize("NFKC", text)
    if lang != "he" and _HOMO_RE.search(text):  # rare: fix only the lines that need it
        text = "\n".join(_WORD_RE.sub(_fold_mixed, line) if _HOMO_RE.search(line) else line
                         for line in text.split("\n"))
    text = text.translate(table)
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


_HOMO_MAP = {ord(k): v for k, v in _HOMOGLYPHS.items()}


def _fold_mixed(m):
    return m[0].translate(_HOMO_MAP) if _LATIN_RE.search(m[0]) else m[0]

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


def _range_total(headers):
    """The full size from a Content-Range header ("bytes a-b/total" or "bytes */total"), else None."""
    total = (headers.get("Content-Range") or "*/*").rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


class HTTPStream(io.RawIOBase):
    """A read-only file over HTTP. A dropped connection is retried with back-off and resumed
    with a Range request from the byte reached, so a caller never sees the interruption."""

    def __init__(self, url, pos=0, retries=5, backoff=2.0, timeout=60):
        self.url, self.pos, self.retries, self.backoff, self.timeout = url, pos, retries, backoff, timeout
        self.total, self.resp = None, None
        self._retry(lambda: None)  # connects

    def readable(self):
        return True

    def _connect(self):
        headers = {"User-Agent": "dynpool-prepare-data"}
        if self.pos:
            headers["Range"] = f"bytes={self.pos}-"
        try:
            resp = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416:  # nothing left after pos: the previous attempt had it all, unless the
                # server's size says the .part is longer than the file (download() then rejects it)
                self.total, self.resp = _range_total(e.headers) or self.pos, io.BytesIO()
                return
            raise
        if resp.status == 206:
            self.total = _range_total(resp.headers)
        else:
            length = resp.headers.get("Content-Length")
            self.total = int(length) if length else None
            skip = self.pos  # server ignored Range: throw away what we already have
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
    """Fetch url to dest via dest.part (resumed if present); rename only once the size checks."""
    dest = Path(dest)
    if dest.exists():
        print(f"have {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    progress = _Progress(f"download {url}")
    with HTTPStream(url, pos=have, retries=retries, backoff=backoff) as stream, \
            open(part, "ab" if stream.pos else "wb") as f:
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
        raise DownloadError(f"{url}: got {size} bytes, expected {stream.total}")
    os.replace(part, dest)
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


def file_pieces(path):
    """(text, separator) pieces of a raw .txt / .zip / .xz / .gz / .bz2 / .parquet file."""
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
        die(f"{path}: corrupt or unreadable ({_why(e)})")
    except Exception as e:
        if type(e).__module__.startswith("pyarrow"):
            die(f"{path}: cannot read parquet ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        raise

# -----------------------------------------------------------------------------
# encoding: cleaned text -> token ids, streamed into a .bin under a character cap


class BinWriter:
    """Cleans (text, separator) pieces and appends their ids to path.tmp, stopping at cap."""

    def __init__(self, path, alphabet, dtype, lang, cap=None):
        self.path, self.tmp, self.lang, self.cap = Path(path), _tmp(path), lang, cap
        self.lut = np.full(0x110000, -1, dtype=np.int32)
        self.lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
        self.dtype, self.f = dtype, open(self.tmp, "wb")
        self.n = self.raw_chars = self.letters = 0
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
            from_digits = sum(text.count(d) * k for d, k in self.digit_cost)
            text = clean(text, self.lang)
            # letters that did not come from spelling out digits: none at all means wrong --lang
            self.letters += len(text) - text.count(" ") - text.count("\n") - from_digits
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
    spm = _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
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
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            # each letter once more as a word of its own, so letters the sample lacks still get a piece
            sentence_iterator=iter(words + list(letters)), model_writer=model, model_type="unigram", vocab_size=V,
            # whole words in, identity normalisation, no dummy prefix: pieces are plain substrings
            normalization_rule_name="identity", add_dummy_prefix=False, split_by_whitespace=True,
            remove_extra_whitespaces=False, character_coverage=1.0, required_chars=letters,
            bos_id=-1, eos_id=-1, input_sentence_size=2_000_000, shuffle_input_sentence=True,
            max_sentence_length=1 << 16, num_threads=min(4, os.cpu_count() or 1), minloglevel=2)
    except RuntimeError as e:
        m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if m:
            die(f"--unigram {V} is too large for this text (SentencePiece allows at most {m[2]} here); "
                f"pass --unigram {m[2]} or less, or --unigram 0 to skip Unigram boundaries")
        die(f"SentencePiece failed: {str(e).splitlines()[0]}")
    return model.getvalue()


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


def list_wiki40b(lang, base, retries, backoff):
    """Shard paths per split from the hub's tree API (never guessed), following pagination."""
    url, paths = f"{base}/api/datasets/google/wiki40b/tree/main/{lang}", []
    while url:
        with HTTPStream(url, retries=retries, backoff=backoff) as stream:
            body = stream.read()
            link = getattr(stream.resp, "headers", {}).get("Link", "")
        try:
            entries = json.loads(body.decode("utf-8"))
            paths += [e["path"] for e in entries if e.get("type") == "file" and e["path"].endswith(".parquet")]
        except (ValueError, TypeError, AttributeError, KeyError):
            raise DownloadError(f"{url}: not a JSON file listing") from None
        m = re.search(r'<([^>]+)>;\s*rel="next"', link)
        url = m[1] if m else None
    shards = {s: sorted(p for p in paths if Path(p).name.startswith(s + "-")) for s in ("train", "validation", "test")}
    if not shards["train"]:
        raise DownloadError(f"{base}: no wiki40b parquet shards for language {lang!r}")
    return shards


def _split_of(path):
    name = Path(path).name.lower()
    for key, split in (("train", "train"), ("valid", "valid"), ("dev", "valid"), ("test", "test")):
        if key in name:
            return split
    return None


def build_splits(args, out, alphabet, dtype, lang):
    """Writes train/valid/test.bin; returns (sources, split rule, cleaning stats)."""
    E, T = args.max_eval_chars, args.max_train_chars
    stats = {"clean_s": 0.0, "raw": 0, "letters": 0}

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
        return n

    def by_split(docs_for_split, names):
        for split, cap in (("train", T), ("valid", E), ("test", E)):
            w = BinWriter(out / f"{split}.bin", alphabet, dtype, lang, cap)
            run(w, docs_for_split(names[split]))
            _commit(w.tmp, out / f"{split}.bin")

    def one_stream(pieces, cap, head):
        w = BinWriter(out / "all.bin", alphabet, dtype, lang, cap)
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
        one_stream(file_pieces(zpath), None, head=False)
        return [args.text8_url], "first 90M train / next 5M valid / last 5M test", stats
    if args.dataset == "wiki40b":
        shards = list_wiki40b(lang, args.hf_base, args.retries, args.backoff)
        names = {"train": shards["train"], "valid": shards["validation"], "test": shards["test"]}
        urls = []

        def docs(paths):
            for p in paths:
                url = f"{args.hf_base}/datasets/google/wiki40b/resolve/main/{p}"
                urls.append(url)
                yield from parquet_docs(download(url, out / "download" / Path(p).name, args.retries, args.backoff))
        by_split(docs, names)
        return urls, "official wiki40b splits, capped", stats
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


def main(argv=None):
    p = argparse.ArgumentParser(description="Download, clean, split and encode data for dynpool.")
    p.add_argument("--dataset", choices=["text8", "wiki40b", "cc100", "input"], default=None,
                   help="source; default text8 without --lang, wiki40b with it, input with --input and --lang")
    p.add_argument("--lang", default=None, help=f"language code, one of {', '.join(sorted(LANGS))}")
    p.add_argument("--input", nargs="+", type=Path, default=None, metavar="FILE",
                   help="local .txt/.zip/.xz/.gz/.parquet file(s) instead of downloading; one file is cut "
                        "90/5/5, several named *train*/*valid*/*test* keep their splits")
    p.add_argument("--name", default=None, help="output dir name under --out-dir (default text8, wiki40b-<lang>, ...)")
    p.add_argument("--out-dir", type=Path, default=Path("data"), help="parent of the output directory (default data)")
    p.add_argument("--max-train-chars", type=int, default=400_000_000, help="cap on cleaned train characters (default 400M)")
    p.add_argument("--max-eval-chars", type=int, default=2_000_000, help="cap on cleaned valid and test characters each (default 2M)")
    p.add_argument("--unigram", type=int, default=None,
                   help="SentencePiece Unigram vocab size for boundary labels (default 10000 en/vi/text8, 200 fi/he; 0 = off)")
    p.add_argument("--unigram-sample-chars", type=int, default=4_000_000,
                   help="train characters sampled to fit the Unigram model (default 4M)")
    p.add_argument("--force", action="store_true", help="redo finished steps (completed downloads are kept)")
    p.add_argument("--hf-base", default=os.environ.get("DYNPOOL_HF_BASE", "https://huggingface.co"),
                   help="Hugging Face hub base URL (env DYNPOOL_HF_BASE; default https://huggingface.co)")
    p.add_argument("--text8-url", default=os.environ.get("DYNPOOL_TEXT8_URL", "http://mattmahoney.net/dc/text8.zip"),
                   help="text8.zip URL (env DYNPOOL_TEXT8_URL; default mattmahoney.net)")
    p.add_argument("--cc100-base", default=os.environ.get("DYNPOOL_CC100_BASE", "https://data.statmt.org/cc-100"),
                   help="cc-100 base URL holding <lang>.txt.xz (env DYNPOOL_CC100_BASE; default data.statmt.org)")
    p.add_argument("--retries", type=int, default=5, help="download retries per request (default 5)")
    p.add_argument("--backoff", type=float, default=2.0, help="first retry delay in seconds, doubled each retry (default 2)")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        die("interrupted", 130)
    except DownloadError as e:
        hint = {"wiki40b": f"the {args.lang}/*.parquet shards of {args.hf_base}/datasets/google/wiki40b by hand and "
                           f"pass --dataset wiki40b --lang {args.lang} --input <train-*, validation-*, test-* files>",
                "cc100": f"{args.cc100_base}/{args.lang}.txt.xz (or its head) by hand and pass --input FILE "
                         f"--lang {args.lang}"}.get(args.dataset, "the file by hand and pass --input FILE")
        die(f"download failed: {e}. Without network, fetch {hint}")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            die(f"disk full while writing {getattr(e, 'filename', None) or args.out_dir}; free space or use --out-dir")
        die(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}")
    finally:
        _remove_temps()


def _main(args):
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
    alphabet = TEXT8_ALPHABET if lang is None else ["\n", " "] + list(LANGS[lang]["letters"])
    dtype = "uint8" if len(alphabet) <= 256 else "uint16"
    cleaning = {"lang": lang, "wiki40b_markers": "removed", "homoglyphs": lang not in (None, "he"),
                "nfkc": lang is not None, "lowercase": lang is not None, "digits": "spelled" if lang else "kept",
                "diacritics": {"he": "removed", "vi": "kept (NFC)", None: "n/a"}.get(lang, "folded to alphabet"),
                "split": None, "max_train_chars": args.max_train_chars, "max_eval_chars": args.max_eval_chars,
                "input": [str(f) for f in args.input] if args.input else None}
    stamp_path, meta_path = out / ".splits.json", out / "meta.json"
    splits = ("train", "valid", "test")

    def n_tokens(path):
        return os.path.getsize(path) // np.dtype(dtype).itemsize

    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() and not args.force else None
    if stamp and stamp["key"] == [args.dataset, cleaning] and all(
            (out / f"{s}.bin").exists() and n_tokens(out / f"{s}.bin") == stamp["sizes"][s] for s in splits):
        print(f"splits done in {out}, skipping (--force redoes)")
        sources, rule, rate = stamp["source"], stamp["rule"], stamp["rate"]
    else:
        for f in [meta_path, stamp_path, *out.glob("unigram-*.model"), *out.glob("*.unigram-*.bin")]:
            f.unlink(missing_ok=True)  # stale outputs of an earlier run
        sources, rule, stats = build_splits(args, out, alphabet, dtype, lang)
        sizes = {s: n_tokens(out / f"{s}.bin") for s in splits}
        total, src = sum(sizes.values()), ", ".join(map(str, sources))
        raw, letters = (stats["raw"], stats["letters"]) if lang else (total, total)
        if raw == 0 or letters <= 0:
            for s in splits:
                (out / f"{s}.bin").unlink(missing_ok=True)
            if raw == 0:
                die(f"no text in {src} (empty input?)")
            die(f"none of the {stats['raw']} characters of {src} are {lang} letters "
                f"({''.join(LANGS[lang]['letters'][:3])}...) apart from digits; wrong --lang?")
        rate = stats["raw"] / stats["clean_s"] if stats["clean_s"] else None
        if sizes["train"] == 0 or sizes["valid"] == 0 or sizes["test"] == 0:
            print(f"warning: an empty split {sizes}; the input is very small", file=sys.stderr)
        tmp = _tmp(stamp_path)
        tmp.write_text(json.dumps({"key": [args.dataset, cleaning], "sizes": sizes, "source": sources,
                                   "rule": rule, "rate": rate}))
        _commit(tmp, stamp_path)
    sizes = {s: n_tokens(out / f"{s}.bin") for s in splits}
    space_id = alphabet.index(" ")
    n_space = count_id(out / "train.bin", dtype, space_id)
    mwl = sizes["train"] / n_space if n_space else None

    uni = None
    if V:
        model_path = out / f"unigram-{V}.model"
        label_paths = {s: out / f"{s}.unigram-{V}.bin" for s in splits}
        old = json.loads(meta_path.read_text()).get("unigram") if meta_path.exists() and not args.force else None
        if old and old.get("vocab_size") == V and model_path.exists() and all(
                label_paths[s].exists() and os.path.getsize(label_paths[s]) == sizes[s] for s in splits):
            print(f"unigram-{V} done, skipping (--force redoes)")
            uni = old
        else:
            meta_path.unlink(missing_ok=True)
            spm = _need("sentencepiece", "Unigram boundaries; --unigram 0 skips them")
            t0 = time.time()
            proto = train_unigram(out, alphabet, dtype, V, args.unigram_sample_chars)
            sp = spm.SentencePieceProcessor(model_proto=proto)
            sf = {}
            for s in splits:
                ones = unigram_labels(sp, out / f"{s}.bin", label_paths[s], alphabet, dtype)
                sf[s] = round(sizes[s] / ones, 4) if ones else None
            tmp = _tmp(model_path)
            tmp.write_bytes(proto)
            _commit(tmp, model_path)
            uni = {"vocab_size": V, "model": model_path.name, "shortening_factor": sf}
            print(f"unigram-{V}: trained and labelled in {time.time() - t0:.1f}s")

    meta = {"name": name, "dataset": args.dataset, "lang": args.lang, "alphabet": alphabet,
            "vocab_size": len(alphabet), "space_id": space_id,
            "newline_id": alphabet.index("\n") if "\n" in alphabet else None, "dtype": dtype,
            "sizes": sizes, "source": sources, "cleaning": {**cleaning, "split": rule},
            "mean_word_length": round(mwl, 4) if mwl else None, "unigram": uni}
    tmp = _tmp(meta_path)
    tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    _commit(tmp, meta_path)

    print(f"\n== {out} ==")
    print(f"dataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} ({dtype}), split: {rule}")
    print("chars: " + ", ".join(f"{s} {sizes[s]:,}" for s in splits))
    print(f"mean word length (whitespace shortening factor, train): {mwl:.3f}" if mwl else "no spaces in train")
    if uni:
        print(f"unigram-{V} shortening factor: " + ", ".join(f"{s} {v}" for s, v in uni["shortening_factor"].items()))
    if rate:
        print(f"cleaning rate: {rate / 1e6:.2f} M chars/s")
    return meta


if __name__ == "__main__":
    main()
