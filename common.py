"""What every dynpool script shares, written once: the error type and the one error
boundary around `main`, the flag parser and its range types, the atomic file write, the
run-folder lock, the optional matplotlib import. A script is `common.main(lambda:
run(parser().parse_args(argv)))`."""
import argparse
import errno
import math
import os
import sys
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path


class UserError(Exception):
    """A mistake or fault the user can fix: `main` prints it as one `error: ...` line and
    exits with `code` (1; 2 for bad command-line flags)."""

    def __init__(self, msg, code=1):
        super().__init__(msg)
        self.code = code


def first_line(e):
    """An exception's message in one line: its first, or its type's name where it has
    none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def error_line(e):
    """The one line (without 'error: ') and exit code for an exception `main` catches, or
    None for one it lets through (a bug, whose traceback is the useful report)."""
    if isinstance(e, UserError):
        return str(e), e.code
    if isinstance(e, KeyboardInterrupt):
        return 'interrupted (Ctrl-C); finished files are kept, none is half-written', 130
    if isinstance(e, BrokenPipeError):
        return 'the output was closed before the end (broken pipe)', 1
    if isinstance(e, OSError):
        what = e.strerror or first_line(e)
        if e.errno == errno.EFBIG:
            what += ' (over the file-size limit, ulimit -f / RLIMIT_FSIZE)'
        if e.filename is not None:
            what = f'{e.filename}: {what}'
        return what, 1
    # a name (or text) in another encoding than the system's: a Latin-1 file name
    if isinstance(e, (UnicodeEncodeError, UnicodeDecodeError)):
        part = e.object[max(0, e.start - 30):e.end]
        return f'{part!r} is not {e.encoding} ({e.reason}): a name in another encoding?', 1
    # out of memory: Python's MemoryError, or an error saying so (torch's
    # OutOfMemoryError, a RuntimeError)
    said = "can't allocate" in str(e) or 'out of memory' in str(e)
    if said or isinstance(e, MemoryError):
        return f'out of memory ({first_line(e)}); try a smaller batch, length or model', 1
    return None


def main(run, rank=0):
    """The error boundary of every script: run() → its exit code, the int run() returns
    (0 for anything else). A UserError, an OSError (a full or closed stdout too), out of
    memory and Ctrl-C end as one `error: ...` line on stderr (only rank 0 of torchrun's
    processes prints) and exit code 1, 2 for flags, 130 for Ctrl-C."""
    try:
        code = run()
        try:   # a full or closed stdout fails here, inside the boundary
            sys.stdout.flush()
        except OSError as e:
            raise type(e)(e.errno, e.strerror, 'stdout') from None
        if type(code) is int:
            return code
        return 0
    except (Exception, KeyboardInterrupt) as e:
        said = error_line(e)
        if said is None:
            raise
        if isinstance(e, BrokenPipeError):   # Python's exit would flush into it again
            with suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if rank == 0:
            print(f'error: {said[0]}', file=sys.stderr, flush=True)
        return said[1]


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one UserError line (exit code 2), not the usage and a
    message."""

    def error(self, message):
        raise UserError(f'{message} (see python {self.prog} --help)', code=2)


def number_range(kind, rule, lo, hi, excluded=()):
    """Argument type: s → kind(s) in [lo, hi] and not one of excluded (nan, what kind()
    cannot read, is in no range); else ArgumentTypeError naming rule."""
    def parse(s):
        try:
            value = kind(s)
        except ValueError:
            value = math.nan
        if not lo <= value <= hi or value in excluded:
            raise argparse.ArgumentTypeError(f'must be {rule}, got {s!r}')
        return value
    return parse


def int_range(lo, hi=None):
    """Argument type: an integer in [lo, hi] (hi None: below 2**63, the most a torch size
    takes)."""
    rule = f'an integer in [{lo}, {hi}]'
    if hi is None:
        rule = f'an integer >= {lo} (below 2**63)'
        hi = 2 ** 63 - 1
    return number_range(int, rule, lo, hi)


def float_range(lo, hi=math.inf, lo_open=False, hi_open=False):
    """Argument type: a finite float between lo and hi (hi inf: no end; *_open: the end
    excluded)."""
    # a finite number: never inf, nor an open end
    excluded = {-math.inf, math.inf}
    rule = f'a finite number >= {lo:g}'
    if lo_open:
        rule = f'a finite number > {lo:g}'
        excluded.add(lo)
    if hi_open:
        rule += f' and < {hi:g}'
        excluded.add(hi)
    elif hi < math.inf:
        rule += f' and <= {hi:g}'
    return number_range(float, rule, lo, hi, excluded)


positive_int = int_range(1)                    # counts, sizes, steps
non_negative_int = int_range(0)                # counts where 0 means none
seed_int = int_range(0, 2 ** 32 - 1)           # seeds that also seed numpy's legacy RNG
positive_float = float_range(0, lo_open=True)  # learning rate, temperature, seconds, FLOPs
non_negative_float = float_range(0)            # gradient clip (0 = off), loss weights
fraction = float_range(0, 1, hi_open=True)     # dropout rates: [0, 1)
probability = float_range(0, 1, lo_open=True, hi_open=True)  # a rate whose log is taken


def nonblank(s):
    """Argument type: a string with something in it (a path, a name) and no NUL, which no
    path can hold (the OS call would raise ValueError, not OSError, past the error
    boundary)."""
    if not s.strip() or '\0' in s:
        raise argparse.ArgumentTypeError(f'must not be empty or hold a NUL character, got {s!r}')
    return s


def write_atomic(path, data):
    """Replace `path` by `data` (bytes, str, or a function that writes to the path it is
    given), never half of each: a uniquely named temporary file in the same folder (made
    as any new file, with the umask's mode), fsynced, then renamed over `path`. The
    temporary name keeps the extension (matplotlib reads the format from it)."""
    # through a link to its target: never the link replaced
    path = Path(os.path.realpath(path))
    # /dev/null, a FIFO, a folder: never replaced
    if path.exists() and not path.is_file():
        raise UserError(f'{path} is not a regular file: write to a file')
    # .<stem>.<8 random characters><suffix>: prepare_data.remove_leftovers knows the form
    tmp = path.parent / f'.{path.stem[:100]}.{uuid.uuid4().hex[:8]}{path.suffix}'
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        # on disk before the rename: a power cut leaves the old file
        with open(tmp, 'rb') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        # named by the file the caller asked for, not the temporary one
        raise OSError(e.errno, e.strerror or first_line(e), str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def make_folder(folder):
    """Make `folder` and its parents where missing → its Path. A link to a folder that does
    not exist (an unmounted disk) is an OSError naming the link and its target, not the
    "File exists" mkdir says: nothing is made through it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        # a link to a folder that does not exist (an unmounted disk)
        if not os.path.islink(e.filename):
            raise
        raise FileNotFoundError(2, f'a link to {os.readlink(e.filename)}, which does not exist',
                                e.filename) from None
    return folder


@contextmanager
def locked(folder, what):
    """Hold `folder`/.lock (filelock: released by the OS if the process dies) for the
    block; one UserError line naming `what` if another process holds it."""
    import filelock    # torch's own dependency, so no extra install
    folder = make_folder(folder)
    lock = filelock.FileLock(folder / '.lock', timeout=0)
    try:
        held = lock.acquire()
    except filelock.Timeout:
        raise UserError(f'another process is using {folder} (it holds {folder / ".lock"}): '
                        f'wait for {what} to end or choose another folder') from None
    with held:   # (released at the block's end, however it ends)
        yield


def import_pyplot(flag):
    """matplotlib's pyplot without a display; one UserError line where the optional extra
    is not installed."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f'{flag} needs matplotlib: pip install "matplotlib>=3.6" '
                        f'(or drop {flag})') from None
    return plt
