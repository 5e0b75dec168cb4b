"""
Download, clean, split and encode character-level LM data for dynpool.

    python prepare_data.py                          # text8 -> data/text8 (90M/5M/5M)
    python prepare_data.py --input text8-head.txt   # offline: a text8 file or slice -> data/text8
    python prepare_data.py --lang he                # wiki40b Hebrew -> data/wiki40b-he
    python prepare_data.py --lang fi --unigram 0    # wiki40b Finnish, no Unigram boundaries
    python prepare_data.py --dataset cc100 --lang en --max-train-chars 100000000
    python prepare_data.py --input he.txt --lang he --name he-small     # offline, own text
    python prepare_data.py --name he-small --unigram 1000               # more labels, same splits

Output: data/<name>/{train,valid,test}.bin (token ids, memmap), meta.json, and per Unigram size V:
unigram-V.model + {split}.unigram-V.bin boundary labels (meta.json "unigram_sets" lists every set
present; "unigram" is the one train.py uses, the last one made). docs/data.md tells the whole story.

- Cleaning: cleaning.clean, the paper's cleaner, streamed in ~4 MB pieces cut at line ends.
- Splits: text8 the first 90M / next 5M / last 5M chars; wiki40b its official splits, capped;
  cc-100 (streamed, never fully downloaded) valid first, then test, then train up to the caps; one
  --input file 90/5/5 in order; several named *train*/*valid*/*test* keep their splits.
- Downloads: wiki40b through huggingface_hub (its cache, resume, token, offline mode); text8 and
  cc-100 over urllib, resumed after a cut with a Range request guarded by If-Range (a server that
  ignores it, or has another version of the file, sends it whole and it starts from zero). A host
  that cannot be resolved or refuses the connection fails at once, with the offline command.
- Safety: every output is written under a temporary name and renamed when complete, meta.json
  last; re-runs skip finished steps, refuse other cleaning options, rebuild an input edited in
  place (size, mtime, SHA-256); one run per dataset (common.locked).
- Unigram boundaries: SentencePiece Unigram with the paper's settings, fitted on the train split's
  word counts in a child process (Ctrl-C stops it at once); labels mark the last character of
  every piece, and whitespace closes a word. Beside their shortening factor: the left-context
  ceiling, what a causal predictor that sees the word up to t can reach (left_context_ceiling).
"""

import argparse
import codecs
import hashlib
import http.client
import io
import json
import os
import re
import shlex
import socket
import stat
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

import common
from cleaning import LANGS, MARKERS, TEXT8_ALPHABET, clean
from common import UserError

SPLITS = ("train", "valid", "test")
TEXT8_CHARS = 100_000_000
CHUNK = 1 << 22          # characters of raw text cleaned at a time
WIKI40B = "google/wiki40b"
DEFAULTS = dict(max_train_chars=400_000_000, max_eval_chars=2_000_000, fold_accents=False)


def _progress(**kw):
    """tqdm (it comes with huggingface_hub) on stderr, shown on a terminal only."""
    from tqdm import tqdm
    return tqdm(file=sys.stderr, disable=None, unit_scale=True, mininterval=1, **kw)

# ----------------------------------------------------------------------------- downloads


class DownloadError(Exception):
    """A download that cannot succeed; run() adds the command that works without network."""


_HUB_MODULES = ("huggingface_hub", "httpx", "requests")   # huggingface_hub's and its clients'


def _why_not(url, e):
    """(message, worth retrying) for an exception of a download; None for one that is not about
    the network (a full disk): it goes on to common.main."""
    reason = getattr(e, "reason", e)
    if isinstance(reason, socket.gaierror):  # no network or no such host: waiting will not help
        return f"cannot resolve the host ({reason.strerror or reason})", False
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused", False
    status = getattr(e, "code", None) or getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(status, int) and status >= 400:   # 5xx, timeouts and rate limits pass; others not
        said = f"HTTP {status} {getattr(e, 'reason', '')}".strip()
        return said, status >= 500 or status in (408, 429)
    if type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        return common.error_line(e)[0], False
    if isinstance(e, (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                      TimeoutError)) or type(e).__module__.split(".")[0] in _HUB_MODULES:
        return (str(e).strip().splitlines() or [type(e).__name__])[0], True
    return None


def _retrying(url, fn, retries, backoff):
    """fn() with up to `retries` retries after network errors, waiting backoff * 2^attempt."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            said = _why_not(url, e)
            if said is None:
                raise
            if not said[1] or attempt == retries:
                raise DownloadError(f"{url}: {said[0]}") from None
        wait = backoff * 2 ** attempt
        print(f"{url}: {said[0]}; retry {attempt + 1}/{retries} in {wait:.1f}s", file=sys.stderr)
        time.sleep(wait)


def _request(url, start=0, validator=None):
    """GET url from byte `start` → (response, offset of its first byte, file size or None).
    If-Range: a server with another version of the file than `validator` sends it whole."""
    headers = {"User-Agent": "dynpool-prepare-data"}
    if start:
        headers["Range"] = f"bytes={start}-"
        if validator:
            headers["If-Range"] = validator
    resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)
    if resp.status == 206:
        total = resp.headers.get("Content-Range", "*/*").rsplit("/", 1)[1]
        return resp, start, int(total) if total.isdigit() else None
    length = resp.headers.get("Content-Length")
    return resp, 0, int(length) if length else None


def _fetch_once(url, part, info):
    """Appends to `part` what one request brings; True when it is complete. `info` keeps the
    file's version (strong ETag or Last-Modified) and size, so a later run resumes only the same
    file; a .part without it starts over."""
    try:
        version = json.loads(info.read_text()) if part.exists() else None
    except (OSError, ValueError):
        version = None
    have = part.stat().st_size if isinstance(version, dict) else 0
    try:
        resp, start, total = _request(url, have, have and version.get("validator"))
    except urllib.error.HTTPError as e:  # 416: nothing after `have`; whole if the sizes agree
        if e.code == 416 and e.headers.get("Content-Range", "").endswith(f"/{have}"):
            return True
        raise
    with resp:
        if start and total != version.get("total", total):  # a server without versions
            print(f"{url} changed on the server since the download began: starting over",
                  file=sys.stderr)
            part.unlink()
            return False
        if have and not start:
            print(f"{url}: the server sent the whole file (it ignores Range, or the file changed "
                  "on the server): starting from zero", file=sys.stderr)
        if not start:
            etag = resp.headers.get("ETag") or ""
            v = etag if etag and not etag.startswith("W/") else resp.headers.get("Last-Modified")
            common.write_atomic(info, json.dumps({"url": url, "validator": v, "total": total}))
        with open(part, "ab" if start else "wb") as f, _progress(
                desc=f"download {url}", total=total, initial=start, unit="B") as bar:
            while block := resp.read(1 << 20):
                f.write(block)
                bar.update(len(block))
    got = part.stat().st_size
    if total is not None and got > total:
        part.unlink()
        raise DownloadError(f"{url}: got {got} bytes, expected {total}")
    if total is not None and got < total:
        raise http.client.IncompleteRead(b"", total - got)  # a cut: retried from here
    return True


def download(url, dest, retries=5, backoff=2.0):
    """url → dest through dest.part, resumed after a cut (this run or an earlier one); dest
    appears only complete."""
    dest = Path(dest)
    if dest.exists():
        print(f"have {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part, info = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    print(f"download {url} -> {dest}")
    if not _retrying(url, lambda: _fetch_once(url, part, info), retries, backoff):
        if not _retrying(url, lambda: _fetch_once(url, part, info), retries, backoff):
            raise DownloadError(f"{url}: the file keeps changing on the server")
    os.replace(part, dest)
    info.unlink(missing_ok=True)
    return dest


def http_blocks(url, retries, backoff):
    """The bytes of url as a stream of blocks, never stored: a cut connection is resumed from the
    byte reached (a server that ignores Range resends the head, which is skipped)."""
    pos, state = 0, {}

    def connect():
        resp, start, total = _request(url, pos, state.get("validator"))
        if pos and total != state.get("total", total):
            raise DownloadError(f"{url} changed on the server while it was read")
        state.update(total=total, validator=resp.headers.get("ETag"))
        return resp, pos - start

    resp, skip = _retrying(url, connect, retries, backoff)
    while True:
        try:
            block = resp.read(1 << 20)
            if not block and state["total"] is not None and pos < state["total"]:
                raise http.client.IncompleteRead(b"", state["total"] - pos)
        except (OSError, http.client.HTTPException) as e:
            if _why_not(url, e) is None:
                raise
            resp.close()
            resp, skip = _retrying(url, connect, retries, backoff)
            continue
        if not block:
            resp.close()
            return
        block, skip = block[skip:], max(0, skip - len(block))
        pos += len(block)
        if block:
            yield block

# ----------------------------------------------------------------------------- reading raw text
# (text, separator) pieces, cut at line ends so that lines are cleaned whole


_BAD = {"n": 0, "first": None, "base": 0}   # invalid UTF-8 bytes of the file being read


def _count_bad(e):
    _BAD["n"] += e.end - e.start
    if _BAD["first"] is None:
        _BAD["first"] = _BAD["base"] + e.start
    return "", e.end


codecs.register_error("dynpool_count", _count_bad)


def text_pieces(blocks, label):
    """UTF-8 byte blocks → (text, separator) pieces of about CHUNK characters; invalid bytes are
    dropped and counted (a file mostly invalid is refused), a NUL byte means binary."""
    _BAD.update(n=0, first=None, base=0)
    dec, buf, total = codecs.getincrementaldecoder("utf-8")(errors="dynpool_count"), "", 0
    for raw in _then_empty(blocks):
        if raw.find(0) >= 0:
            raise UserError(f"{label} looks binary (NUL byte at offset {total + raw.find(0)}); "
                            "expected UTF-8 text (UTF-16 files must be converted first)")
        _BAD["base"], total = total, total + len(raw)
        buf += dec.decode(raw, final=not raw)
        if _BAD["n"] > 4096 and _BAD["n"] > total // 100 or not raw and _BAD["n"] > total // 100:
            raise UserError(f"{label} is not UTF-8 text: {_BAD['n']} of the first {total} bytes "
                            f"invalid (first at byte {_BAD['first']})")
        cut = buf.rfind("\n")
        if cut >= 0:
            yield buf[:cut], "\n"
            buf = buf[cut + 1:]
        elif len(buf) > CHUNK:  # a giant line: cut at a space, or anywhere as a last resort
            cut = buf.rfind(" ")
            yield (buf[:cut], " ") if cut >= 0 else (buf, "")
            buf = buf[cut + 1:] if cut >= 0 else ""
    if _BAD["n"]:
        print(f"warning: {label}: dropped {_BAD['n']} invalid UTF-8 bytes (first at byte "
              f"{_BAD['first']})", file=sys.stderr)
    if buf:
        yield buf, ""


def _then_empty(blocks):
    yield from blocks
    yield b""


def _file_blocks(fb):
    return iter(lambda: fb.read(CHUNK), b"")


def file_pieces(path, downloaded=False):
    """(text, separator) pieces of a raw .txt / .zip / .xz / .gz / .bz2 / .parquet file. A
    corrupt downloaded file is removed (its blob in the hub cache too), so a re-run fetches it."""
    import bz2
    import gzip
    import lzma
    import zipfile
    path, suffix = Path(path), Path(path).suffix.lower()
    try:
        if suffix == ".parquet":
            yield from _parquet_docs(path)
        elif suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                for m in sorted(n for n in z.namelist() if not n.endswith("/")):
                    with z.open(m) as fb:
                        yield from text_pieces(_file_blocks(fb), f"{path}:{m}")
        else:
            opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}.get(suffix, open)
            with opener(path, "rb") as fb:
                yield from text_pieces(_file_blocks(fb), str(path))
    except (zipfile.BadZipFile, lzma.LZMAError, EOFError, gzip.BadGzipFile, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:   # the OS's own error, not bad data
            raise
        _corrupt(path, common.error_line(e)[0] if isinstance(e, OSError) else str(e), downloaded)
    except Exception as e:
        if type(e).__module__.startswith("pyarrow"):
            _corrupt(path, (str(e).splitlines() or [type(e).__name__])[0], downloaded)
        raise


def _corrupt(path, why, downloaded):
    if downloaded:
        real = path.resolve()
        path.unlink(missing_ok=True)
        real.unlink(missing_ok=True)
        raise UserError(f"downloaded {path} is corrupt ({why}); it was removed: re-run to fetch "
                        "it again")
    raise UserError(f"{path}: corrupt or unreadable ({why})")


def _parquet_docs(path):
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    col = "text" if "text" in names else next((n for n in names if str(
        pf.schema_arrow.field(n).type) in ("string", "large_string", "binary")), None)
    if col is None:
        raise UserError(f"{path}: no text column (columns: {', '.join(names)})")
    for batch in pf.iter_batches(columns=[col], batch_size=256):
        for t in batch.column(0).to_pylist():
            if t:
                yield (t.decode("utf-8", "replace") if isinstance(t, bytes) else t), "\n"


def _xz_blocks(blocks, url):
    import lzma
    d = lzma.LZMADecompressor()
    try:
        for b in blocks:
            yield d.decompress(b)
            while d.eof and d.unused_data:   # the next stream of a multi-stream .xz
                b, d = d.unused_data, lzma.LZMADecompressor()
                yield d.decompress(b)
    except lzma.LZMAError as e:
        raise UserError(f"{url}: corrupt xz stream ({e})") from None
    if not d.eof:
        raise UserError(f"{url}: corrupt xz stream (it ends before its end marker)")

# ----------------------------------------------------------------------------- encoding


class Encoder:
    """Cleans (text, separator) pieces and appends their token ids to a binary file, up to `cap`
    characters. Counts what tells a wrong --lang: letters that did not come from digit names
    against the raw signs (non-space, non-digit, non-marker characters)."""

    def __init__(self, f, alphabet, dtype, lang, cap=None, fold_accents=False):
        self.f, self.lang, self.cap, self.dtype, self.fold = f, lang, cap, dtype, fold_accents
        self.lut = np.full(0x110000, -1, dtype=np.int32)
        self.lut[[ord(c) for c in alphabet]] = np.arange(len(alphabet))
        self.n = self.raw_chars = self.letters = self.signs = 0
        self.clean_s, self.pending, self.full = 0.0, "", False
        if lang:
            words = LANGS[lang]["digits"].split()
            self.digit_cost = [(str(d), len(w)) for d, w in enumerate(words)]

    def add(self, text, sep):
        """Appends one piece; False once the cap is reached."""
        if self.lang:
            t0 = time.perf_counter()
            self.raw_chars += len(text)
            n_digits = [text.count(d) for d, _ in self.digit_cost]
            self.signs += len(text) - text.count(" ") - text.count("\n") - sum(n_digits) - sum(
                map(len, MARKERS.findall(text)))
            text = clean(text, self.lang, self.fold)
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
            raise UserError(f"text8 input holds {bad!r}, not in a-z/space; use --lang en for other "
                            "English text")
        self.f.write(ids.astype(self.dtype).tobytes())
        self.n += len(text)

    def close(self):
        if self.lang and self.n and not self.full:
            self._put("\n")  # every line, the last one too, ends with a newline


def encode(path, pieces, stats, *args):
    """Writes the token ids of `pieces` to path (Encoder(*args) does the work); adds to stats."""
    with open(path, "wb") as f, _progress(desc=Path(path).name, unit="char") as bar:
        enc = Encoder(f, *args)
        for text, sep in pieces:
            n = enc.n
            if not enc.add(text, sep):
                break
            bar.update(enc.n - n)
        enc.close()
    for k in ("clean_s", "raw_chars", "letters", "signs"):
        stats[k] += getattr(enc, k)
    return enc


def _ids(path, dtype):
    """The token ids of a .bin, memory-mapped (numpy cannot map an empty file)."""
    return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def _decode_blocks(path, alphabet, dtype, block=1 << 21):
    data, chars = _ids(path, dtype), np.array([ord(c) for c in alphabet], dtype="<u4")
    for i in range(0, len(data), block):
        yield chars[data[i:i + block]].tobytes().decode("utf-32-le")


def count_id(path, dtype, value):
    data = _ids(path, dtype)
    return sum(int(np.count_nonzero(data[i:i + (1 << 24)] == value))
               for i in range(0, len(data), 1 << 24))

# ----------------------------------------------------------------------------- sources → splits


def _split_of(path):
    name = Path(path).name.lower()
    return next((s for key, s in (("train", "train"), ("valid", "valid"), ("dev", "valid"),
                                  ("test", "test")) if key in name), None)


def list_wiki40b(lang, args):
    """Shard paths per split, listed by huggingface_hub (never guessed); offline (HF_HUB_OFFLINE=1)
    the shards already in the local cache."""
    import huggingface_hub as hub
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        try:
            root = Path(hub.snapshot_download(WIKI40B, repo_type="dataset", cache_dir=args.hf_cache,
                                              allow_patterns=[f"{lang}/*.parquet"],
                                              local_files_only=True))
        except Exception:
            where = args.hf_cache or constants.HF_HUB_CACHE
            raise UserError(
                f"HF_HUB_OFFLINE is set and the hub cache {where} holds no {WIKI40B} shards for "
                f"{lang!r}; run once with network (unset HF_HUB_OFFLINE), pass the cache with "
                f"--hf-cache, or pass the shards with --dataset wiki40b --lang {lang} --input "
                "FILES") from None
        paths = [str(p.relative_to(root)) for p in sorted((root / lang).glob("*.parquet"))]
    else:
        api = hub.HfApi(endpoint=args.hf_base)
        paths = _retrying(f"{args.hf_base or 'the hub'}: {WIKI40B}/{lang}", lambda: [
            f.path for f in api.list_repo_tree(WIKI40B, path_in_repo=lang, repo_type="dataset")
            if f.path.endswith(".parquet")], args.retries, args.backoff)
    shards = {s: sorted(p for p in paths if Path(p).name.startswith(s + "-"))
              for s in ("train", "validation", "test")}
    if not shards["train"]:
        raise DownloadError(f"{WIKI40B}: no parquet shards for language {lang!r}")
    return [shards["train"], shards["validation"], shards["test"]]


def build_splits(args, out, alphabet, dtype, lang):
    """Writes train/valid/test.bin; returns (sources, split rule, cleaning stats)."""
    E, T = args.max_eval_chars, args.max_train_chars
    stats = dict.fromkeys(("clean_s", "raw_chars", "letters", "signs"), 0)
    kw = (alphabet, dtype, lang)

    def by_split(groups):  # one list of (text, separator) iterators per split
        for split, cap, group in zip(SPLITS, (T, E, E), groups):
            common.write_atomic(out / f"{split}.bin", lambda tmp: encode(
                tmp, (p for it in group for p in it), stats, *kw, cap, args.fold_accents))

    def one_stream(pieces, cap, head):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".all.", suffix=".bin")
        os.close(fd)
        try:
            N = encode(tmp, pieces, stats, *kw, cap, args.fold_accents).n
            if head:  # cc-100: valid and test first, so a capped stream fills them before train
                e = E if N >= T + 2 * E or N >= 20 * E else N // 20
                cuts = {"valid": (0, e), "test": (e, e), "train": (2 * e, N - 2 * e)}
            else:  # text8 / --input: 90% train, 5% valid, 5% test, in that order
                e = N // 20
                cuts = {"train": (0, N - 2 * e), "valid": (N - 2 * e, e), "test": (N - e, e)}
            data = _ids(tmp, dtype)
            for split, (a, n) in cuts.items():
                common.write_atomic(out / f"{split}.bin", data[a:a + n].tofile)
            del data
        finally:
            os.remove(tmp)

    if args.input:
        groups = [[p for p in args.input if _split_of(p) == s] for s in SPLITS]
        if len(args.input) > 1 and all(groups) and sum(map(len, groups)) == len(args.input):
            by_split([map(file_pieces, g) for g in groups])
            return [str(p) for p in args.input], "official (input files named train/valid/test)", \
                stats
        cap = None if args.dataset == "text8" else int(T / 0.9)
        one_stream((p for f in args.input for p in file_pieces(f)), cap, head=False)
        return [str(p) for p in args.input], "90% train / 5% valid / 5% test, in order", stats
    if args.dataset == "text8":
        zpath = download(args.text8_url, out / "download" / "text8.zip", args.retries, args.backoff)
        one_stream(file_pieces(zpath, downloaded=True), None, head=False)
        return [args.text8_url], "first 90M train / next 5M valid / last 5M test", stats
    if args.dataset == "wiki40b":
        import huggingface_hub as hub
        used = []

        def shard(p):  # through huggingface_hub's cache: resumed, token from HF_TOKEN or login
            used.append(f"hf://datasets/{WIKI40B}/{p}")
            return file_pieces(_retrying(p, lambda: hub.hf_hub_download(
                WIKI40B, p, repo_type="dataset", cache_dir=args.hf_cache, endpoint=args.hf_base),
                args.retries, args.backoff), downloaded=True)
        by_split([(shard(p) for p in g) for g in list_wiki40b(lang, args)])
        return used, "official wiki40b splits, capped", stats
    url = f"{args.cc100_base}/{lang}.txt.xz"   # cc-100: decompressed as it streams in
    blocks = _xz_blocks(http_blocks(url, args.retries, args.backoff), url)
    one_stream(text_pieces(blocks, url), T + 2 * E, head=True)
    return [url], f"first {E} chars valid, next {E} test, then train (cleaned chars)", stats


def _check_splits(sizes, stats, sources, lang):
    """Why the splits are no dataset (no text, a wrong --lang, an empty split), or None."""
    src = ", ".join(map(str, sources))
    letters, signs = (stats["letters"], stats["signs"]) if lang else (sum(sizes.values()),) * 2
    if stats["raw_chars"] == 0 and lang or sum(sizes.values()) == 0 and not lang:
        return f"no text in {src} (empty input?)"
    if letters <= 0 or letters < 0.5 * signs:
        return (f"only {max(letters, 0)} of the {signs} non-space, non-digit characters of {src} "
                f"are {lang} letters after cleaning ({''.join(LANGS[lang]['letters'][:3])}...); "
                "wrong --lang?")
    if min(sizes.values()) == 0:
        return (f"{src} is too small: it cleans to {sum(sizes.values())} characters, leaving an "
                f"empty split ({', '.join(f'{s} {n}' for s, n in sizes.items())}); give more text")
    return None


def splits(args, out, alphabet, dtype, lang, key, inputs):
    """Builds train/valid/test.bin unless an earlier run with the same options and input did
    (its record: .splits.json); returns that record."""
    stamp_path, item = out / ".splits.json", np.dtype(dtype).itemsize
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = None
    if not (isinstance(stamp, dict) and isinstance(stamp.get("key"), dict)
            and isinstance(stamp.get("sizes"), dict)):
        stamp = None
    if stamp and not args.force:
        old = dict(stamp["key"])
        if isinstance(old.get("input"), list):  # one file, however an older run named it
            old["input"] = [str(Path(p).resolve()) for p in old["input"]]
        if old != key:
            raise UserError(f"{out} holds data prepared with other options ({_differs(old, key)}); "
                            f"to rebuild it run: {_rerun(args, force=True)}; or pass --name NEW "
                            "for a separate dataset")
        old_inputs = [{**f, "path": str(Path(f["path"]).resolve())} for f in
                      stamp.get("inputs") or [] if isinstance(f, dict) and "path" in f] or None
        if old_inputs != inputs:
            print(f"input changed since {out} was prepared (size, mtime or SHA-256): rebuilding",
                  file=sys.stderr)
        elif all((out / f"{s}.bin").exists() and os.path.getsize(out / f"{s}.bin")
                 == stamp["sizes"].get(s, -1) * item for s in SPLITS):
            print(f"splits done in {out}, skipping (--force redoes)")
            return stamp
    for f in [out / "meta.json", stamp_path, *out.glob("unigram-*.model"),
              *out.glob("*.unigram-*.bin")]:
        f.unlink(missing_ok=True)  # outputs of an earlier run go before the new ones are made
    sources, rule, stats = build_splits(args, out, alphabet, dtype, lang)
    sizes = {s: os.path.getsize(out / f"{s}.bin") // item for s in SPLITS}
    why = _check_splits(sizes, stats, sources, lang)
    if why:
        for s in SPLITS:
            (out / f"{s}.bin").unlink(missing_ok=True)
        raise UserError(why)
    stamp = {"key": key, "inputs": inputs, "sizes": sizes, "source": sources, "rule": rule,
             "rate": stats["raw_chars"] / stats["clean_s"] if stats["clean_s"] else None}
    common.write_atomic(stamp_path, json.dumps(stamp, ensure_ascii=False))
    return stamp

# ----------------------------------------------------------------------------- Unigram boundaries

# The paper's released tokenizer settings; fitted on the word counts of the whole train split.
UNIGRAM_SETTINGS = dict(model_type="unigram", add_dummy_prefix=True, max_sentencepiece_length=16,
                        split_digits=True, split_by_whitespace=True, split_by_unicode_script=True,
                        remove_extra_whitespaces=True, normalization_rule_name="identity",
                        character_coverage=1.0)
_DUMMY = "\u2581"  # SentencePiece's word-start mark, added before every word (add_dummy_prefix)


class UnigramSizeError(UserError):
    """A Unigram size the text or alphabet cannot take; .fit is one that works."""

    def __init__(self, msg, fit):
        super().__init__(msg)
        self.fit = fit


def split_words(path, alphabet, dtype):
    """{word: count} of one split; words are cut at spaces and newlines."""
    counts, carry = Counter(), ""
    for text in _decode_blocks(path, alphabet, dtype):
        parts = (carry + text).replace("\n", " ").split(" ")
        carry = parts.pop()  # maybe a word cut by the block edge
        counts.update(parts)
    counts.update([carry])
    counts.pop("", None)
    return counts


def train_unigram(train_words, alphabet, V, max_words):
    """SentencePiece Unigram-V model proto fitted on {word: count} (the most frequent max_words
    words, all when 0), in a child process; UnigramSizeError when V does not fit."""
    if not train_words:
        raise UserError("the train split has no words: nothing to fit Unigram on "
                        "(pass --unigram 0)")
    letters = "".join(c for c in alphabet if c not in " \n")
    # each letter once more as a word of its own, so letters the text lacks still get a piece
    rows = [f"{w}\t{n}" for w, n in train_words.most_common(max_words or None)]
    ok, result = _in_child(_fit_unigram, rows + [f"{c}\t1" for c in letters], letters, V)
    if ok:
        return result
    m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", result)
    if m:
        raise UnigramSizeError(f"--unigram {V} is too large for this text (SentencePiece allows "
                               f"at most {m[2]} here)", int(m[2]))
    m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", result)
    if m:
        raise UnigramSizeError(f"--unigram {V} is too small for this alphabet (SentencePiece "
                               f"needs at least {m[2]} pieces here)", int(m[2]))
    raise UserError(f"SentencePiece failed: {result}")


def _fit_unigram(rows, letters, V):
    """(True, model proto) or (False, SentencePiece's message); run in a child process."""
    import sentencepiece as spm
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            # a "word<TAB>count" row per distinct word: the whole split, at its vocabulary's cost
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
    caught, child = [], None
    old = signal.signal(signal.SIGINT, lambda *_: caught.append(1))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        child = ctx.Process(target=_child_main, args=(send, fn, args), daemon=True)
        child.start()
        send.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, old)
        if caught:
            raise KeyboardInterrupt
        while not recv.poll(0.1) and child.is_alive():
            pass
        if recv.poll():
            return recv.recv()
        return False, f"the training process died (exit code {child.exitcode})"
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
    words, out = list(words), {}
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
    cache, ones = {"": b"\x01"}, [0]

    def fill(words):
        if len(cache) > 500_000:  # bound memory on 400M chars; hot words come straight back
            cache.clear()
            cache[""] = b"\x01"
        for w, lab in word_labels(sp, {w for w in words if w not in cache}).items():
            cache[w] = lab + b"\x01"

    def write(tmp):
        carry = ""
        with open(tmp, "wb") as f:
            for text in _decode_blocks(split_path, alphabet, dtype):
                parts = (carry + text).replace("\n", " ").split(" ")
                carry = parts.pop()  # maybe a word cut by the block edge: finish it next time
                fill(parts)
                chunk = b"".join([cache[w] for w in parts])
                ones[0] += chunk.count(1)
                f.write(chunk)
            if carry:
                fill([carry])
                chunk = cache[carry][:-2] + b"\x01"  # no separator after the split's last word
                ones[0] += chunk.count(1)
                f.write(chunk)
    common.write_atomic(out_path, write)
    return ones[0]


def left_context_ceiling(train_words, valid_words, labels):
    """The best a causal boundary predictor can do on these labels from the current word alone.
    At an in-word position t it has seen the word's characters up to t (its prefix), not the
    rest: the Bayes decision is b_t = 1 iff P(b_t = 1 | prefix) > 0.5, counted on train_words
    ({word: count}); a prefix train never shows gets 0. Applied to valid_words, it returns
    {"ends": in-word label ends, "predicted": in-word decisions of 1, "hits": both,
    "in_word_recall"}. labels: {word: in-word labels (one 0/1 per character)} for both."""
    wanted = {w[:k + 1] for w in valid_words for k in range(len(w))}
    total, ones = dict.fromkeys(wanted, 0), dict.fromkeys(wanted, 0)
    for w, n in train_words.items():
        for k in range(len(w)):
            p = w[:k + 1]
            if p not in total:  # its longer prefixes are not wanted either
                break
            total[p] += n
            ones[p] += n * labels[w][k]
    ends = predicted = hits = 0
    for w, n in valid_words.items():
        for k in range(len(w)):
            decide = 2 * ones[w[:k + 1]] > total[w[:k + 1]]
            ends += n * labels[w][k]
            predicted += n * decide
            hits += n * (decide and labels[w][k])
    return {"ends": ends, "predicted": predicted, "hits": hits,
            "in_word_recall": hits / ends if ends else None}


def make_unigram(args, out, meta, V, settings, drop_old):
    """Fits Unigram-V on the train split's word counts, writes its labels; returns its set entry
    with the labels' shortening factors and their left-context ceiling."""
    import sentencepiece as spm
    alphabet, dtype, sizes, t0 = meta["alphabet"], meta["dtype"], meta["sizes"], time.time()
    train_words = split_words(out / "train.bin", alphabet, dtype)
    used = min(len(train_words), args.unigram_max_words or len(train_words))
    print(f"unigram-{V}: training SentencePiece on the counts of {used:,} distinct train words",
          file=sys.stderr, flush=True)
    try:
        proto = train_unigram(train_words, alphabet, V, args.unigram_max_words)
    except UnigramSizeError as e:
        raise UserError(f"{e}; run: {_rerun(args, unigram=e.fit)}; or --unigram 0 to skip "
                        "Unigram boundaries") from None
    sp = spm.SentencePieceProcessor(model_proto=proto)
    drop_old()
    ones = {s: unigram_labels(sp, out / f"{s}.bin", out / f"{s}.unigram-{V}.bin", alphabet, dtype)
            for s in SPLITS}
    valid_words = split_words(out / "valid.bin", alphabet, dtype)
    c = left_context_ceiling(train_words, valid_words,
                             word_labels(sp, set(train_words) | set(valid_words)))
    ceiling_ones = ones["valid"] - c["ends"] + c["predicted"]
    # the model last: labels without it are removed on re-run
    common.write_atomic(out / f"unigram-{V}.model", proto)
    print(f"unigram-{V}: trained and labelled in {time.time() - t0:.1f}s")
    recall = c["in_word_recall"]
    return {"vocab_size": V, "model": f"unigram-{V}.model",
            "labels": {s: f"{s}.unigram-{V}.bin" for s in SPLITS}, "settings": settings,
            "fit_words": {"distinct_used": used, "distinct_in_train": len(train_words)},
            "shortening_factor": {s: round(sizes[s] / ones[s], 4) if ones[s] else None
                                  for s in SPLITS},
            "left_context_ceiling": {
                "split": "valid", "estimated_on": "train",
                "rule": "b_t = 1 iff P(b_t = 1 | word prefix up to t) > 0.5",
                "shortening_factor": round(sizes["valid"] / ceiling_ones, 4) if ceiling_ones
                else None,
                "in_word_recall": round(recall, 4) if recall is not None else None,
                "in_word_ends": c["ends"], "in_word_predicted": c["predicted"],
                "in_word_hits": c["hits"]}}

# ----------------------------------------------------------------------------- label sets


def _set_problem(k, u):
    """What is wrong with meta.json's 'unigram_sets'[k], or None."""
    where = f"'unigram_sets'[{k!r}]"
    if not (isinstance(u, dict) and type(u.get("vocab_size")) is int and str(u["vocab_size"]) == k
            and u["vocab_size"] > 0):
        return f"{where} is {_clip(u)}, expected an object whose vocab_size is {k}"
    model = f"unigram-{k}.model"
    for field, ok, want in (("model", u.get("model") == model, repr(model)),
                            ("shortening_factor", isinstance(u.get("shortening_factor"), dict),
                             "an object"),
                            ("settings", isinstance(u.get("settings"), (dict, type(None))),
                             "an object or null")):
        if not ok:
            return f"{where}['{field}'] is {_clip(u.get(field))}, expected {want}"
    return None


def _label_sets(out, args):
    """({V: entry}, default V) of the meta.json already in out, checked field by field; ({}, None)
    without one. An older meta.json's single "unigram" entry is read as one set."""
    path = out / "meta.json"
    if not path.exists():
        return {}, None

    def bad(what):
        return UserError(f"{path}: {what}; fix it, or remove it and run again (splits kept, "
                         f"labels remade): {_rerun(args)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise bad(f"unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise bad(f"holds a {type(meta).__name__}, expected an object")
    default, sets = meta.get("unigram"), meta.get("unigram_sets")
    if default is not None and not (isinstance(default, dict) and type(
            default.get("vocab_size")) is int and default["vocab_size"] > 0):
        raise bad(f"'unigram' is {_clip(default)}, expected null or an object with an integer "
                  "vocab_size")
    if sets is None:
        sets = {str(default["vocab_size"]): {"settings": None, **default}} if default else {}
    if not isinstance(sets, dict):
        raise bad(f"'unigram_sets' is {_clip(sets)}, expected an object {{\"<V>\": {{...}}}}")
    why = next(filter(None, (_set_problem(k, u) for k, u in sets.items())), None)
    if why:
        raise bad(why)
    sets = {u["vocab_size"]: u for u in sets.values()}
    if default and default["vocab_size"] not in sets:
        raise bad(f"'unigram' names vocab_size {default['vocab_size']}, which 'unigram_sets' lacks")
    return sets, default["vocab_size"] if default else None


def _clip(v):
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def _label_files(out, V):
    return [out / f"unigram-{V}.model"] + [out / f"{s}.unigram-{V}.bin" for s in SPLITS]


def _reconcile(out, sets, sizes):
    """Keeps the label sets whose files are all there at full length; removes label files no set
    describes, saying so: afterwards meta.json's sets and the files agree."""
    for V in sorted(sets):
        if not all(f.exists() for f in _label_files(out, V)) or any(
                os.path.getsize(out / f"{s}.unigram-{V}.bin") != sizes[s] for s in SPLITS):
            print(f"unigram-{V}: label files missing or cut short; dropped (re-run with --unigram "
                  f"{V} to remake)", file=sys.stderr)
            del sets[V]
    for f in sorted([*out.glob("unigram-*.model"), *out.glob("*.unigram-*.bin")]):
        m = re.search(r"unigram-(\d+)\.(?:model|bin)$", f.name)
        if not (m and int(m[1]) in sets and f in _label_files(out, int(m[1]))):
            print(f"removed {f.name}: no label set in meta.json describes it", file=sys.stderr)
            f.unlink()


def _label_meta(sets, default):
    if default not in sets:
        default = max(sets) if sets else None
    return {"unigram": sets[default] if default else None,
            "unigram_sets": {str(V): sets[V] for V in sorted(sets)}}


def unigram(args, out, meta):
    """Makes Unigram-V labels unless a set with the same settings is there; keeps the other sets.
    Returns meta.json's {"unigram": default set, "unigram_sets": {"<V>": set}}."""
    sets, default = _label_sets(out, args)
    _reconcile(out, sets, meta["sizes"])
    V = args.unigram if args.unigram is not None else LANGS[args.lang]["unigram"]
    settings = {**UNIGRAM_SETTINGS, "fit_on": "train word counts",
                "max_words": args.unigram_max_words or None,
                "label_rule": "piece ends; the space closes its word"}
    if V and V in sets and sets[V].get("settings") == settings:
        print(f"unigram-{V} done, skipping (--force redoes the whole dataset)")
    elif V:
        if V in sets:
            print(f"unigram-{V}: made with other settings; replacing it", file=sys.stderr)

        def drop_old():  # once the new model is fitted, the old set leaves meta.json first
            if sets.pop(V, None) and (out / "meta.json").exists():
                _write_meta(out, {**meta, **_label_meta(sets, default)})
        sets[V] = make_unigram(args, out, meta, V, settings, drop_old)
    elif sets:
        print(f"--unigram 0: keeping the labels already in {out} (unigram-"
              f"{', unigram-'.join(map(str, sorted(sets)))}); --force rebuilds the dataset "
              "without them")
    return _label_meta(sets, V if V in sets else default)


def _write_meta(out, meta):
    common.write_atomic(out / "meta.json", json.dumps(meta, ensure_ascii=False, indent=1))

# ----------------------------------------------------------------------------- the dataset


def fingerprint(path):
    """Size, mtime and SHA-256 of an input file: a file edited in place is noticed on re-run."""
    st = os.stat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a FIFO would block the read
        raise UserError(f"input file {path}: not a regular file (a pipe or device?)")
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}


def cleaning_options(args, lang):
    """Everything that decides the cleaned text; meta.json records it, re-runs compare it."""
    if lang is None:
        return {"lang": None, "pipeline": "text8 as is (a-z and space)", "fold_accents": False}
    import importlib.metadata as md
    homo = None if lang == "he" else (
        f"Unicode confusables via confusable-homoglyphs {md.version('confusable-homoglyphs')}")
    return {"lang": lang,
            "pipeline": "paper (wiki40b markers, homoglyphs, lower case, digits, alphabet)",
            "homoglyphs": homo, "fold_accents": args.fold_accents,
            "fixes": ["NFC first", "İ -> i"] + (["digit words without niqqud"] * (lang == "he")),
            "alphabet": LANGS[lang]["letters"]}


def _differs(old, new):
    """The options of an existing dataset that differ from this run's, as one short phrase."""
    keys = sorted(set(old) | set(new), key=str)
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys
                     if old.get(k) != new.get(k))


def prepare(args, out, name, lang, inputs):
    """The dataset in out: splits (kept when done), Unigram labels, meta.json last."""
    alphabet = TEXT8_ALPHABET if lang is None else ["\n", " "] + list(LANGS[lang]["letters"])
    dtype = "uint8" if len(alphabet) <= 256 else "uint16"
    key = {"dataset": args.dataset, **cleaning_options(args, lang),
           "max_train_chars": args.max_train_chars, "max_eval_chars": args.max_eval_chars,
           "input": [f["path"] for f in inputs] if inputs else None}
    stamp = splits(args, out, alphabet, dtype, lang, key, inputs)
    sizes, sources, n = stamp["sizes"], stamp.get("source"), sum(stamp["sizes"].values())
    n_space = count_id(out / "train.bin", dtype, alphabet.index(" "))
    mwl = sizes["train"] / n_space if n_space else None
    part = ({"of": "text8", "chars": n, "full_chars": TEXT8_CHARS}
            if args.dataset == "text8" and n < TEXT8_CHARS else None)
    meta = {"name": name, "dataset": args.dataset, "lang": args.lang, "alphabet": alphabet,
            "vocab_size": len(alphabet), "space_id": alphabet.index(" "),
            "newline_id": alphabet.index("\n") if "\n" in alphabet else None, "dtype": dtype,
            "sizes": sizes, "source": sources, "slice": part,
            "cleaning": {**key, "split": stamp.get("rule")}, "inputs": inputs,
            "mean_word_length": round(mwl, 4) if mwl else None,
            "defaults": {k: LANGS[args.lang][k] for k in ("unigram", "prior")}}
    meta.update(unigram(args, out, meta))
    _write_meta(out, meta)
    print(f"\n== {out} ==")
    print(f"dataset {args.dataset}, lang {args.lang}, vocab {len(alphabet)} ({dtype}), split: "
          f"{stamp.get('rule')}")
    if part:
        print(f"note: a {n:,}-character slice of text8 ({', '.join(sources)}), not the full "
              f"{TEXT8_CHARS:,}")
    print("chars: " + ", ".join(f"{s} {sizes[s]:,}" for s in SPLITS))
    print(f"mean word length (whitespace shortening factor, train): {mwl:.3f}" if mwl
          else "no spaces in train")
    for u in meta["unigram_sets"].values():
        sf = ", ".join(f"{s} {v}" for s, v in u["shortening_factor"].items())
        c = u.get("left_context_ceiling") or {}
        ceil = (f"; left-context ceiling on valid: SF {c['shortening_factor']}, in-word recall "
                f"{100 * c['in_word_recall']:.1f}%") if c.get("in_word_recall") is not None else ""
        default = " [default for train.py]" if meta["unigram"] is u else ""
        print(f"unigram-{u['vocab_size']} shortening factor: {sf}{ceil}{default}")
    if stamp.get("rate"):
        print(f"cleaning rate: {stamp['rate'] / 1e6:.2f} M chars/s")
    return meta

# ----------------------------------------------------------------------------- command line


def _url(value):
    """Argument type: an http(s) URL with a host."""
    from urllib.parse import urlsplit
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL")
    return value.rstrip("/")


def _unigram_size(value):
    """Argument type: a Unigram vocabulary size, 2 to 1,000,000, or 0 for none."""
    try:
        v = common.int_range(0, 1_000_000)(value)
    except argparse.ArgumentTypeError:
        v = 1
    if v == 1:
        raise argparse.ArgumentTypeError(f"must be 0 (no labels) or an integer in [2, 1000000], "
                                         f"got {value!r}")
    return v


def _folder_name(value):
    """Argument type: one folder name (the dataset's, under --out-dir)."""
    if value in ("", ".", "..") or "/" in value or "\0" in value:
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder name (no '/', not . or ..)")
    return value


def parser():
    p = common.Parser(prog="prepare_data.py", description=(
        "Download, clean, split and encode data for dynpool. Flags whose default says 'as "
        "recorded' take the value recorded by the dataset already in --out-dir/--name when not "
        "given (so adding labels needs only --name and --unigram)."))
    a = p.add_argument
    a("--dataset", choices=["text8", "wiki40b", "cc100", "input"], default=None,
      help="source (default: the existing dataset's, else text8 without --lang, wiki40b with it, "
           "input with --input and --lang)")
    a("--lang", choices=sorted(LANGS), default=None,
      help="language, its alphabet and digit names in cleaning.LANGS (default: as recorded, else "
           "en for text8; needed for the others)")
    a("--input", nargs="+", type=Path, default=None, metavar="FILE",
      help="local .txt/.zip/.xz/.gz/.bz2/.parquet file(s) instead of downloading; one file is cut "
           "90/5/5, several named *train*/*valid*/*test* keep their splits (default: as recorded, "
           "else download)")
    a("--name", type=_folder_name, default=None,
      help="output folder name under --out-dir (default text8, wiki40b-<lang>, cc100-<lang>, "
           "input-<lang>)")
    a("--out-dir", type=Path, default=Path("data"),
      help="parent of the output folder (default data)")
    a("--fold-accents", action="store_true", default=None,
      help="fold letters outside the alphabet to its letters (é -> e, ß -> ss, niqqud dropped) "
           "instead of the paper's space (default: as recorded, else off)")
    a("--max-train-chars", type=common.int_range(1, 10 ** 12), default=None,
      help="cap on cleaned train characters (default: as recorded, else 400M)")
    a("--max-eval-chars", type=common.int_range(1, 10 ** 12), default=None,
      help="cap on cleaned valid and test characters each (default: as recorded, else 2M)")
    a("--unigram", type=_unigram_size, default=None,
      help="SentencePiece Unigram vocabulary size of the boundary labels (default per language: "
           + ", ".join(f"{k} {v['unigram']}" for k, v in sorted(LANGS.items())) + ", text8 "
           "10000). Labels of other sizes already in the dataset are kept (meta.json lists them "
           "all); the same size made with other settings is replaced. 0 makes none and keeps "
           "those present; --force rebuilds the dataset without them")
    a("--unigram-max-words", type=common.int_range(0, 10 ** 9), default=0,
      help="fit Unigram on the counts of this many most frequent distinct train words "
           "(default 0: every distinct word of the train split, i.e. the whole split)")
    a("--force", action="store_true",
      help="redo finished steps (completed downloads are kept; default off)")
    a("--hf-base", type=_url, default=None,
      help="Hugging Face hub endpoint (default: huggingface_hub's, i.e. HF_ENDPOINT or "
           "huggingface.co)")
    a("--hf-cache", type=Path, default=None,
      help="huggingface_hub cache dir for the wiki40b shards (default: HF_HUB_CACHE or "
           "~/.cache/huggingface/hub)")
    a("--text8-url", type=_url,
      default=os.environ.get("DYNPOOL_TEXT8_URL", "http://mattmahoney.net/dc/text8.zip"),
      help="text8.zip URL (default: env DYNPOOL_TEXT8_URL, else http://mattmahoney.net/dc/text8.zip)")
    a("--cc100-base", type=_url,
      default=os.environ.get("DYNPOOL_CC100_BASE", "https://data.statmt.org/cc-100"),
      help="cc-100 base URL holding <lang>.txt.xz (default: env DYNPOOL_CC100_BASE, else "
           "https://data.statmt.org/cc-100)")
    a("--retries", type=common.int_range(0, 100), default=5,
      help="download retries per request, 0 to 100 (default 5; a host that cannot be resolved "
           "or refuses the connection fails at once)")
    a("--backoff", type=common.float_range(0, 3600), default=2.0,
      help="first retry delay in seconds, doubled each retry, 0 to 3600 (default 2)")
    return p


def command(dataset=None, lang=None, inputs=None, name=None, out_dir=None, unigram=None,
            fold_accents=False, max_train_chars=None, max_eval_chars=None, unigram_max_words=0,
            force=False):
    """The prepare_data.py command line with these options, quoted for a POSIX shell; options at
    their defaults are left out."""
    argv = ["python", "prepare_data.py"] + (["--dataset", dataset] if dataset else [])
    argv += ["--lang", lang] if lang and dataset != "text8" else []
    argv += ["--input", *map(str, inputs)] if inputs else []
    argv += ["--name", str(name)] if name else []
    argv += ["--out-dir", str(out_dir)] if out_dir not in (None, Path("data"), "data") else []
    argv += ["--fold-accents"] if fold_accents else []
    for flag, v in (("--max-train-chars", max_train_chars), ("--max-eval-chars", max_eval_chars)):
        argv += [flag, str(v)] if v not in (None, DEFAULTS[flag[2:].replace("-", "_")]) else []
    argv += ["--unigram", str(unigram)] if unigram is not None else []
    argv += ["--unigram-max-words", str(unigram_max_words)] if unigram_max_words else []
    return " ".join(shlex.quote(a) for a in argv + (["--force"] if force else []))


def _same(args):
    return dict(name=args.name, out_dir=args.out_dir, unigram=args.unigram,
                fold_accents=args.fold_accents, max_train_chars=args.max_train_chars,
                max_eval_chars=args.max_eval_chars, unigram_max_words=args.unigram_max_words)


def _rerun(args, **change):
    """This run's command line, as resolved, with some options changed."""
    return command(**{"dataset": args.dataset, "lang": args.lang, "force": args.force,
                      "inputs": [p.resolve() for p in args.input] if args.input else None,
                      **_same(args), **change})


def _offline_howto(args):
    """What to do without network, as a command that runs once the file is fetched by hand."""
    if args.dataset == "wiki40b":
        shards = ["train-*.parquet", "validation-*.parquet", "test-*.parquet"]
        cmd = command("wiki40b", args.lang, shards, **_same(args)).replace(
            " ".join(f"'{g}'" for g in shards), " ".join(shards))
        what = f"the {args.lang}/*.parquet shards of {WIKI40B} (a dataset on the Hugging Face hub)"
        alt = "set HF_HUB_OFFLINE=1 to use the shards already cached, or "
    elif args.dataset == "cc100":
        what, alt = f"{args.cc100_base}/{args.lang}.txt.xz (or its head)", ""
        cmd = command("cc100", args.lang, [f"{args.lang}.txt.xz"], **_same(args))
    else:
        what, alt = args.text8_url, ""
        cmd = command("text8", None, [Path(args.text8_url).name or "text8.zip"], **_same(args))
    return f"Without network, {alt}fetch {what} by hand into the current folder and run: {cmd}"


def _default_name(dataset, lang):
    return {"text8": "text8", "input": f"input-{lang}"}.get(dataset, f"{dataset}-{lang}")


def _existing(out):
    """The options recorded by the dataset already in `out` ({} if none or unreadable)."""
    try:
        key = json.loads((out / ".splits.json").read_text(encoding="utf-8"))["key"]
    except (OSError, ValueError, TypeError, KeyError):
        return {}
    return key if isinstance(key, dict) and key.get("dataset") in (
        "text8", "wiki40b", "cc100", "input") else {}


def resolve(args):
    """Fills in --dataset, --lang, --input and the cleaning flags (from the dataset already there
    when not given) and checks them together; returns (out, name)."""
    dataset = args.dataset or ("input" if args.input and args.lang else
                               "wiki40b" if args.lang and not args.input else "text8")
    name = args.name or _default_name(dataset, args.lang or "en")
    out = args.out_dir / name
    old = _existing(out)
    old_lang = old.get("lang") or ("en" if old.get("dataset") == "text8" else None)
    if old and args.dataset in (None, old["dataset"]) and args.lang in (None, old_lang):
        if args.dataset is None and dataset != old["dataset"]:
            print(f"{out} holds a {old['dataset']} dataset: preparing it as --dataset "
                  f"{old['dataset']} (pass --dataset to choose another, with --force or another "
                  "--name)", file=sys.stderr)
        dataset, args.lang = old["dataset"], old_lang
        if args.input is None and args.dataset is None and old.get("input"):
            args.input = [Path(p) for p in old["input"]]   # its input, not a download
        for k in DEFAULTS:
            if getattr(args, k) is None and k in old:
                setattr(args, k, old[k])
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dataset = dataset
    if dataset == "text8" and args.lang not in (None, "en"):
        raise UserError(f"text8 is English; got --lang {args.lang}", 2)
    if dataset == "text8":
        args.lang = "en"
    elif args.lang is None:
        raise UserError(f"--dataset {dataset} needs --lang ({', '.join(sorted(LANGS))})", 2)
    if dataset == "input" and not args.input:
        raise UserError("--dataset input needs --input FILE...", 2)
    return out, name


def run(argv=None):
    """prepare_data.py's work → the meta.json dict it wrote."""
    args = parser().parse_args(argv)
    out, name = resolve(args)
    lang = None if args.dataset == "text8" else args.lang  # text8 is already clean: kept as is
    inputs = [fingerprint(p.resolve()) for p in args.input] if args.input else None
    made = not out.exists()
    try:
        with common.locked(out, "the run preparing it"):
            return prepare(args, out, name, lang, inputs)
    except DownloadError as e:
        raise UserError(f"download failed: {e}. {_offline_howto(args)}") from None
    finally:
        if made:  # a run that failed before writing anything leaves no empty folders
            for d in (out / "download", out):
                if d.is_dir() and {p.name for p in d.iterdir()} <= {".lock"}:
                    (d / ".lock").unlink(missing_ok=True)
                    d.rmdir()


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
