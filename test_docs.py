"""Documentation that cannot go stale: every ```bash and ```python block of README.md and docs/*.md
runs as a test, and the links, the CI commands and the project-only references are checked.

    python -m pytest -q test_docs.py            # the quick blocks (seconds)
    python -m pytest -q test_docs.py --slow     # also the blocks that take minutes

A marker, an HTML comment on the line right before a fence, says how a block runs:

    <!-- doctest: skip (REASON) -->   never here (network, GPU-days, ...); the reason is required
    <!-- doctest: slow -->            only with --slow (minutes on a CPU)
    <!-- doctest: gpu -->             only where CUDA is (kinds combine: `gpu slow`)
    <!-- doctest: plots -->           only where matplotlib, the optional extra, is installed
    <!-- ci -->                       README's set-up and test commands: .ci/run runs these, in a
                                      fresh virtual environment, so they are not run here

Every fence names its language (```text for output). The blocks of one file run in order in one
temporary copy of the repository, next to a link to this checkout's ../shared (blocks that read
../shared skip, saying so, where it is absent); a block first runs the earlier runnable blocks of
its file that have not run, so `-k` can pick any one block.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent
SHARED = ROOT.parent / 'shared'
RUNNABLE = {'bash': 'bash', 'sh': 'bash', 'python': 'python'}
KINDS = {'skip', 'slow', 'gpu', 'plots'}
# Not copied into the sandbox: version control, caches, and what runs and data preparation write.
NOT_COPIED = {'.git', 'data', 'runs', 'out', '__pycache__', '.pytest_cache', '.hypothesis', '.venv',
              'venv', '.benchmarks', '.whl', '.gl'}
TIMEOUT = {'quick': 300, 'slow': 1800}    # seconds a block may run before it counts as failed

FENCE = re.compile(r'^(\s*)```\s*([\w+-]*)\s*$')
MARKER = re.compile(r'^\s*<!--\s*(doctest:|ci\b)(.*?)-->\s*$')


@dataclass
class Block:
    """One fenced code block of a Markdown file."""
    path: Path
    line: int                       # 1-based line of the opening fence
    lang: str
    code: str
    kinds: set = field(default_factory=set)   # skip / slow / gpu
    reason: str = ''                # skip's reason
    ci: bool = False

    @property
    def name(self):
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f'{Path(path).as_posix()}:{self.line}'

    @property
    def runnable(self):
        return self.lang in RUNNABLE and not self.ci and 'skip' not in self.kinds


def parse_marker(text, where):
    """(kinds, reason, ci) of a marker comment's text; ValueError for a marker the runner does not
    know, so a typo can never silently skip a block."""
    m = MARKER.match(text)
    head, rest = m.group(1), m.group(2).strip()
    if head == 'ci':
        if rest:
            raise ValueError(f"{where}: '<!-- ci -->' takes nothing after it, got {rest!r}")
        return set(), '', True
    reason = ''
    if '(' in rest:
        rest, reason = rest.split('(', 1)
        reason = reason.rstrip(') ').strip()
    kinds = set(rest.split())
    unknown = kinds - KINDS
    if unknown or not kinds:
        raise ValueError(f'{where}: unknown doctest marker {text.strip()!r}; '
                         f'use one or more of {sorted(KINDS)}')
    if 'skip' in kinds and not reason:
        raise ValueError(f"{where}: 'doctest: skip' needs a reason, e.g. (network)")
    return kinds, reason, False


def parse(path):
    """The fenced blocks of a Markdown file, with their markers → (blocks, errors)."""
    lines = Path(path).read_text(encoding='utf-8').splitlines()
    blocks, errors, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if MARKER.match(lines[i]) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                errors.append(f'{path}:{i + 1}: a doctest/ci marker must stand right before '
                              f'a fence')
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == '```'), None)
        if end is None:
            errors.append(f'{path}:{i + 1}: fence never closed')
            break
        # A fence indented under a list item: its lines lose that indentation, no more.
        code = '\n'.join(line[min(indent, len(line) - len(line.lstrip())):]
                         for line in lines[i + 1:end]) + '\n'
        block = Block(Path(path), start + 1, lang, code)
        if not lang:
            errors.append(f'{block.name}: a fence must name its language (```text for output)')
        if start > 0 and MARKER.match(lines[start - 1]):
            try:
                block.kinds, block.reason, block.ci = parse_marker(lines[start - 1], block.name)
            except ValueError as e:
                errors.append(str(e))
                block.kinds, block.reason = {'skip'}, 'bad marker'
        blocks.append(block)
        i = end + 1
    return blocks, errors


def doc_files():
    return [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))


def all_blocks():
    return [b for path in doc_files() for b in parse(path)[0]]


# ---------------------------------------------------------------------------------------------
# Running a block
# ---------------------------------------------------------------------------------------------
class BlockFailed(Exception):
    pass


def make_sandbox(base):
    """A copy of the repository in base/<repo name>, with base/shared a link to ../shared where
    that exists, and a bin/ whose `python` is this interpreter → (repo copy, env)."""
    repo = base / ROOT.name
    shutil.copytree(ROOT, repo, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in NOT_COPIED
                                             or n.endswith(('.pyc', '.png'))])
    if SHARED.is_dir():
        (base / 'shared').symlink_to(SHARED.resolve(), target_is_directory=True)
    bin_dir = base / 'bin'
    bin_dir.mkdir()
    # A wrapper, not a link: a linked interpreter would not find its virtual environment.
    for name in ('python', 'python3'):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    # Then the interpreter's own bin/, for the console scripts installed with it (torchrun).
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable),
                            os.environ.get('PATH', '')])
    env = dict(os.environ, PATH=path, PYTHONPATH=str(repo), PYTHONUNBUFFERED='1',
               PYTHONDONTWRITEBYTECODE='1')
    return repo, env


def run_block(block, repo, env, timeout):
    """Run one block in the repository copy; BlockFailed with its output when it fails."""
    ext = 'py' if RUNNABLE[block.lang] == 'python' else 'sh'
    script = repo.parent / f'block-{block.line}.{ext}'
    script.write_text(block.code, encoding='utf-8')
    # bash -e: every line must succeed, not only the last one; pipefail: every part of a pipe.
    cmd = [sys.executable, str(script)] if RUNNABLE[block.lang] == 'python' else \
        ['bash', '-e', '-o', 'pipefail', str(script)]
    try:
        p = subprocess.run(cmd, cwd=repo, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b'').decode(errors='replace')
        raise BlockFailed(f'{block.name} ({block.lang}) ran past {timeout} s\n{block.code}'
                          f'--- last output ---\n{out[-3000:]}') from None
    if p.returncode != 0:
        raise BlockFailed(f'{block.name} ({block.lang}) exited {p.returncode}\n{block.code}'
                          f'--- last output ---\n{p.stdout[-3000:]}')
    return p.stdout


def skip_reason(block, slow, cuda, shared, plots=True):
    """Why this block does not run under these options, or None."""
    if block.ci:
        return 'run by .ci/run in a fresh virtual environment'
    if 'skip' in block.kinds:
        return f'doctest: skip ({block.reason})'
    if 'gpu' in block.kinds and not cuda:
        return 'doctest: gpu (needs CUDA)'
    if 'plots' in block.kinds and not plots:
        return 'doctest: plots (needs matplotlib: pip install "matplotlib>=3.6")'
    if 'slow' in block.kinds and not slow:
        return 'doctest: slow (minutes): run with --slow'
    if '../shared' in block.code and not shared:
        return 'needs ../shared/data beside the checkout (absent here)'
    return None


class Sandboxes:
    """One repository copy per Markdown file; remembers which of its blocks ran and how."""

    def __init__(self, tmp_factory, slow):
        self.tmp_factory, self.slow = tmp_factory, slow
        self.cuda, self.shared = torch.cuda.is_available(), SHARED.is_dir()
        self.plots = importlib.util.find_spec('matplotlib') is not None
        self.state = {}

    def run(self, block):
        """Run the earlier runnable blocks of block's file that have not run, then block itself."""
        if block.path not in self.state:
            base = self.tmp_factory.mktemp(block.path.stem.replace('.', '-'))
            self.state[block.path] = (*make_sandbox(base), {})
        repo, env, outcome = self.state[block.path]
        blocks = [b for b in parse(block.path)[0] if b.runnable]
        lines = [b.line for b in blocks]
        if block.line not in lines or blocks[lines.index(block.line)].code != block.code:
            pytest.fail(f'{block.name} changed since the tests were collected: run them again',
                        pytrace=False)
        for b in blocks[:lines.index(block.line) + 1]:
            if b.line not in outcome:
                why = skip_reason(b, self.slow, self.cuda, self.shared, self.plots)
                if why is not None:
                    outcome[b.line] = ('skipped', why)
                    continue
                try:
                    run_block(b, repo, env, TIMEOUT['slow' if 'slow' in b.kinds else 'quick'])
                    outcome[b.line] = ('passed', '')
                except BlockFailed as e:
                    outcome[b.line] = ('failed', str(e))
            state, detail = outcome[b.line]
            if b.line != block.line and state == 'failed':
                pytest.fail(f'an earlier block of this file failed: {b.name}', pytrace=False)
            if b.line != block.line and state == 'skipped' and '../shared' in detail:
                pytest.skip(f'an earlier block of this file {detail}')
        state, detail = outcome[block.line]
        if state == 'skipped':
            pytest.skip(detail)
        if state == 'failed':
            pytest.fail(detail, pytrace=False)


@pytest.fixture(scope='session')
def sandboxes(tmp_path_factory, request):
    return Sandboxes(tmp_path_factory, request.config.getoption('--slow'))


def block_params():
    params = []
    for b in all_blocks():
        if b.lang not in RUNNABLE:
            continue
        marks = [getattr(pytest.mark, k) for k in sorted(b.kinds & {'slow', 'gpu', 'plots'})]
        params.append(pytest.param(b, id=b.name, marks=marks))
    return params


@pytest.mark.parametrize('block', block_params())
def test_block_runs(block, sandboxes):
    """Each bash/python block of the docs exits 0 (after the earlier blocks of its file)."""
    if not block.runnable:
        pytest.skip(skip_reason(block, True, True, True))
    sandboxes.run(block)


# ---------------------------------------------------------------------------------------------
# The docs as a whole
# ---------------------------------------------------------------------------------------------
def test_markers_and_fences_are_well_formed():
    errors = [e for path in doc_files() for e in parse(path)[1]]
    assert not errors, '\n'.join(errors)


def github_anchor(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces → '-'."""
    text = re.sub(r'[^\w\- ]', '', heading.strip().lower())
    return text.replace(' ', '-')


def anchors(path):
    text = re.sub(r'^```.*?^```', '', path.read_text(encoding='utf-8'), flags=re.S | re.M)
    return {github_anchor(m.group(1)) for m in re.finditer(r'^#+\s+(.*)$', text, re.M)}


def broken_links(path):
    """Relative links of a Markdown file whose file or #anchor does not exist."""
    text = re.sub(r'^```.*?^```', '', path.read_text(encoding='utf-8'), flags=re.S | re.M)
    bad = []
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+://|mailto:', target):
            continue
        file, _, anchor = target.partition('#')
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f'{path.name}: {target} (no such file)')
        elif anchor and dest.suffix == '.md' and anchor not in anchors(dest):
            bad.append(f'{path.name}: {target} (no such heading)')
    return bad


def test_links_resolve():
    bad = [b for path in doc_files() for b in broken_links(path)]
    assert not bad, '\n'.join(bad)


def outside_references(path):
    """Lines of a Markdown file that cite the contract file kept outside the repository, a commit
    hash or an issue number: the docs must stand on their own."""
    bad = []
    for n, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
        where = f'{path.name}:{n}'
        if 'DESIGN.md' in line:
            bad.append(f'{where}: cites DESIGN.md (the design notes are docs/design.md)')
        for word in re.findall(r'\b[0-9a-f]{7,40}\b', line):
            if re.search(r'[a-f]', word) and re.search(r'\d', word):
                bad.append(f'{where}: looks like a commit hash: {word}')
        if re.search(r'\bissue\s+#?\d+|(?<![\w&])(?<!UTS )#\d+\b', line, re.I):
            bad.append(f'{where}: an issue number')
    return bad


def test_docs_cite_nothing_outside_the_project():
    bad = [b for path in doc_files() for b in outside_references(path)]
    assert not bad, '\n'.join(bad)


def ci_commands_from_readme():
    """README's <!-- ci --> blocks as .ci/run reads them: a command a line, continuations joined."""
    commands = []
    for b in parse(ROOT / 'README.md')[0]:
        if b.ci:
            commands += [c.strip() for c in b.code.replace('\\\n', ' ').splitlines() if c.strip()]
    return commands


def test_ci_runs_exactly_readmes_marked_commands():
    ci = subprocess.run(['bash', str(ROOT / '.ci' / 'run'), '--print'], capture_output=True,
                        text=True, timeout=60)
    assert ci.returncode == 0, ci.stderr
    readme = ci_commands_from_readme()
    assert [' '.join(c.split()) for c in ci.stdout.splitlines()] == \
        [' '.join(c.split()) for c in readme]
    # The pin comes before requirements.txt (its bare `torch` would pull the CUDA build), and the
    # suite runs as README's Tests section says.
    first = [c.split('#')[0].split() for c in readme]
    assert first[0][:3] == ['pip', 'install', 'torch==2.13.0'], readme
    assert ['pip', 'install', '-r', 'requirements.txt'] in first
    suite = ['python', '-m', 'pytest', '-q']   # on every core: pyproject.toml's addopts
    assert suite in first
    assert first.index(['pip', 'install', '-r', 'requirements.txt']) < first.index(suite)
    # Then the floors: requirements.txt with constraints-floor.txt, and the suite again.
    floor = [i for i, c in enumerate(first)
             if c[:2] == ['pip', 'install'] and 'constraints-floor.txt' in c]
    assert len(floor) == 1
    assert first[floor[0]][:4] == ['pip', 'install', '-r', 'requirements.txt']
    assert first.index(suite) < floor[0] and suite in first[floor[0] + 1:], readme


def test_every_python_file_keeps_the_one_style():
    """pyproject.toml's ruff rules (100 columns, single quotes, pyflakes) hold for every file."""
    if importlib.util.find_spec('ruff') is None:
        pytest.skip('ruff is not installed (pip install -r requirements.txt)')
    run = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', '--output-format',
                          'concise', str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_matplotlib_stays_optional():
    """requirements.txt installs no plotting package: plots are an extra, and tests that need
    matplotlib skip without it."""
    lines = (ROOT / 'requirements.txt').read_text().splitlines()
    reqs = [line.split('#')[0].strip() for line in lines]
    assert not [r for r in reqs if r.lower().startswith('matplotlib')]
    assert any(r.lower().startswith('torch') for r in reqs)


# ---------------------------------------------------------------------------------------------
# Dependencies, the installed package, the commands a newcomer types first
# ---------------------------------------------------------------------------------------------
def lower_bounds():
    """{name: its lowest allowed version} of every range CI installs: requirements.txt,
    the plots extra README installs, pyproject.toml's build requirement (names
    lower-cased, '_' as '-')."""
    text = (ROOT / 'requirements.txt').read_text() + '\n'.join(
        re.findall(r'pip install "(matplotlib[^"]*)"', (ROOT / 'README.md').read_text()))
    text += '\n' + re.search(r'requires = \["([^"]+)"\]', (ROOT / 'pyproject.toml').read_text())[1]
    bounds = {}
    for line in text.splitlines():
        m = re.match(r'\s*([A-Za-z][\w.-]*)\s*(==|>=)\s*([\d.]+)', line.split('#')[0])
        if m:
            bounds[m[1].lower().replace('_', '-')] = m[3]
    return bounds


def version_key(version):
    """'1.24' and '1.24.0' as the same sortable tuple."""
    parts = [int(p) for p in version.split('.')]
    return tuple(parts + [0] * (4 - len(parts)))


def test_floor_constraints_pin_the_floor_of_every_range():
    """constraints-floor.txt, which CI's second run installs, pins each range's lower
    bound: no range claims a floor that CI has not run (torch, a single version, is
    pinned by CI itself)."""
    pins = {}
    for line in (ROOT / 'constraints-floor.txt').read_text().splitlines():
        name, sep, version = line.split('#')[0].strip().partition('==')
        if sep:
            pins[name.lower().replace('_', '-')] = version
    bounds = lower_bounds()
    assert 'matplotlib' in bounds and 'setuptools' in bounds and 'numpy' in bounds, bounds
    floors = {name: v for name, v in bounds.items() if name != 'torch'}
    assert set(pins) == set(floors), (pins, floors)
    wrong = {name: (pins[name], v) for name, v in floors.items()
             if version_key(pins[name]) != version_key(v)}
    assert not wrong, f"constraints-floor.txt pins other versions than the ranges' floors: {wrong}"


def venv_with_this_torch(path):
    """A fresh virtual environment that sees this one's packages (torch, numpy) through
    a .pth file, as --system-site-packages would from a system Python: no download of
    torch → its python."""
    subprocess.run([sys.executable, '-m', 'venv', str(path)], check=True, timeout=300)
    python = path / 'bin' / 'python'
    site = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, 'outer-packages.pth').write_text(sysconfig.get_path('purelib') + '\n')
    return python


def clean_env(**extra):
    """This environment less what would point Python at this checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(('VIRTUAL_ENV', 'PYTHON'))}
    return dict(env, **extra)


@pytest.mark.slow   # a virtual environment and a package build: a minute or more
def test_install_claims_only_the_library_names(tmp_path):
    """`pip install -e .` as README's install block runs it, in a fresh virtual
    environment; a user's script beside their own common.py and dataset.py then imports
    theirs and dynpool (with hnet), and elsewhere none of the checkout's helper modules
    or scripts can be imported."""
    repo, _ = make_sandbox(tmp_path / 'box')
    python = venv_with_this_torch(tmp_path / 'venv')
    install = subprocess.run([python, '-m', 'pip', 'install', '-e', '.'], cwd=repo,
                             capture_output=True, text=True, timeout=900, env=clean_env())
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    user = tmp_path / 'user'
    user.mkdir()
    for name in ('common', 'dataset'):
        (user / f'{name}.py').write_text(f'OWNER = "user"\nNAME = "{name}"\n')
    (user / 'script.py').write_text(
        'import common, dataset, dynpool, hnet\n'
        'assert (common.OWNER, dataset.NAME) == ("user", "dataset"), common.__file__\n'
        'assert "hnet" in dynpool.BOUNDARY_MODES\n'
        'print(dynpool.__file__)\n')
    run = subprocess.run([python, 'script.py'], cwd=user, capture_output=True, text=True,
                         timeout=300, env=clean_env())
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == repo / 'dynpool.py'   # editable: the checkout's own file
    project_only = ['common', 'dataset', 'runtime', 'checkpoint', 'cleaning', 'flags', 'train',
                    'sample', 'bench', 'report', 'prepare_data', 'conftest']
    probe = ('import importlib.util, sys\n'
             f'print([n for n in {project_only!r} if importlib.util.find_spec(n)])\n'
             f'print([p for p in sys.path if p.startswith({str(repo)!r})])\n')
    found = subprocess.run([python, '-c', probe], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=clean_env())
    assert found.returncode == 0, found.stderr
    assert found.stdout.split('\n')[:2] == ['[]', '[]'], found.stdout


SLOW_WRAPUP = """
import gc
import os
import time


def pytest_unconfigure(config):
    if hasattr(config, 'workerinput'):   # a worker's wrap-up, as slow as a busy machine makes it
        start = time.monotonic()
        try:
            while time.monotonic() - start < 8:
                gc.collect()
        except KeyboardInterrupt:
            open(os.environ['WRAPUP_OUTCOME'], 'w').write('interrupted')
            raise
        open(os.environ['WRAPUP_OUTCOME'], 'w').write('finished')
"""


@pytest.mark.slow   # a worker that takes 8 s to wrap up
def test_suite_worker_slow_to_wrap_up_is_not_interrupted(tmp_path):
    """A pytest-xdist worker still busy 5 s after sending its results gets a SIGINT from execnet,
    which once printed a KeyboardInterrupt traceback at the end of a passing suite: conftest.py
    has the worker ignore it, and the wrap-up finishes."""
    (tmp_path / 'slow_wrapup.py').write_text(SLOW_WRAPUP)
    outcome = tmp_path / 'outcome'
    env = clean_env(PYTHONPATH=str(tmp_path), WRAPUP_OUTCOME=str(outcome))
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-n', '1', '-p', 'slow_wrapup',
                          '-p', 'no:cacheprovider', 'test_docs.py', '-k',
                          'test_markers_and_fences_are_well_formed'],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert 'Traceback' not in run.stdout + run.stderr, run.stdout + run.stderr
    assert outcome.read_text() == 'finished'


# The first commands a newcomer types, as the docs give them (the design card's two, then
# README's quick start on the full text8), with no network and no prepared data: each must end
# in one line that names the way on.
FIRST_COMMANDS = {
    'python prepare_data.py --lang he': ['download failed', '--input FILE'],
    'python train.py --boundary entropy': ['python prepare_data.py', '--input FILE'],
    'python prepare_data.py': ['download failed', '--input FILE'],
    'python train.py --boundary whitespace': ['python prepare_data.py', '--input FILE'],
}


def why_no_offline_namespace():
    """None where `unshare -n` (a network namespace with no network: root) works here,
    else why not."""
    if shutil.which('unshare') is None:
        return 'unshare is not installed'
    probe = subprocess.run(['unshare', '-n', 'true'], capture_output=True, text=True)
    if probe.returncode != 0:
        return f'unshare -n is not allowed here: {probe.stderr.strip()}'
    return None


@pytest.mark.parametrize('command', list(FIRST_COMMANDS))
def test_first_commands_offline_end_in_one_line_naming_the_way_on(command, tmp_path):
    """In a copy of the checkout with no data/ and no network, the command exits
    non-zero with one `error:` line that names what to do (the download failed, or no
    data: prepare it; offline: --input FILE), no traceback, and no half-made dataset
    folder."""
    typed = {line.split('#')[0].strip() for b in all_blocks() for line in b.code.splitlines()}
    assert command in typed, f'{command!r} is no longer a line of README or docs/'
    why = why_no_offline_namespace()
    if why:
        pytest.skip(why)
    repo, env = make_sandbox(tmp_path)
    # An empty hub cache: an earlier download's would let prepare_data.py work offline.
    env = {k: v for k, v in env.items() if not k.startswith('HF_')}
    env['HF_HOME'] = str(tmp_path / 'hf-home')
    # A generous bound, not a timing claim: importing torch on a busy 2-core machine
    # takes tens of seconds; a loop retrying the network would take minutes.
    p = subprocess.run(['unshare', '-n', 'bash', '-c', command], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=240)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and 'Traceback' not in p.stdout + p.stderr, p.stderr
    assert lines and lines[-1].startswith('error: '), p.stderr
    assert [line.startswith('error') for line in lines].count(True) == 1, p.stderr
    missing = [way for way in FIRST_COMMANDS[command] if way not in lines[-1]]
    assert not missing, f'the error line names no {missing}: {lines[-1]}'
    data = repo / 'data'
    assert not data.exists() or not list(data.iterdir()), list(data.iterdir())


# ---------------------------------------------------------------------------------------------
# The runner itself, on small documents made to fail
# ---------------------------------------------------------------------------------------------
def write_doc(tmp_path, text):
    path = tmp_path / 'doc.md'
    path.write_text(text, encoding='utf-8')
    return path


def test_runner_reads_blocks_markers_and_line_numbers(tmp_path):
    doc = write_doc(tmp_path, '# t\n\n```bash\necho a\n```\n<!-- doctest: skip (network) -->\n'
                              '```python\nprint(1)\n```\n<!-- doctest: gpu slow -->\n'
                              '```sh\nx\n```\n'
                              '<!-- ci -->\n```bash\npip install x\n```\n```text\nout\n```\n')
    blocks, errors = parse(doc)
    assert errors == []
    assert [(b.line, b.lang, b.kinds, b.reason, b.ci) for b in blocks] == [
        (3, 'bash', set(), '', False), (7, 'python', {'skip'}, 'network', False),
        (11, 'sh', {'gpu', 'slow'}, '', False), (15, 'bash', set(), '', True),
        (18, 'text', set(), '', False)]
    assert [b.runnable for b in blocks] == [True, False, True, False, False]
    assert blocks[0].code == 'echo a\n'


@pytest.mark.parametrize('bad, message', [
    ('<!-- doctest: skp -->\n```bash\nx\n```\n', 'unknown doctest marker'),
    ('<!-- doctest: skip -->\n```bash\nx\n```\n', 'needs a reason'),
    ('<!-- ci now -->\n```bash\nx\n```\n', 'takes nothing'),
    ('<!-- doctest: slow -->\n\n```bash\nx\n```\n', 'right before a fence'),
    ('```\nx\n```\n', 'must name its language'),
    ('```bash\nx\n', 'never closed'),
])
def test_runner_rejects_malformed_markers_and_fences(tmp_path, bad, message):
    blocks, errors = parse(write_doc(tmp_path, bad))
    assert any(message in e for e in errors), errors
    assert not any(b.runnable and b.kinds for b in blocks)   # a bad marker never runs its block


@pytest.mark.parametrize('code, lang', [
    ('false\necho this line succeeds\n', 'bash'),        # bash -e: an early failure counts
    ('false | cat\n', 'bash'),                           # pipefail: so does one inside a pipe
    ("python -c 'raise SystemExit(3)'\n", 'bash'),       # `python` is this interpreter
    ("print('before')\nraise ValueError('broken snippet')\n", 'python'),
])
def test_runner_fails_a_broken_block_and_shows_its_output(tmp_path, code, lang):
    repo, env = make_sandbox(tmp_path)
    block = Block(tmp_path / 'doc.md', 7, lang, code)
    with pytest.raises(BlockFailed, match=r'doc.md:7 .* exited [1-9]') as failed:
        run_block(block, repo, env, timeout=120)
    assert code in str(failed.value)                     # the block itself ...
    if lang == 'python':                                 # ... and its output
        assert 'ValueError: broken snippet' in str(failed.value)


def test_runner_runs_in_a_copy_of_the_repo_beside_shared(tmp_path):
    repo, env = make_sandbox(tmp_path)
    code = ('test -f dynpool.py\ntest ! -e .git\ntouch written-here\n'
            "python -c 'import torch, dynpool'\n")
    if SHARED.is_dir():
        code += 'test -f ../shared/data/text8-head.txt\n'
    run_block(Block(tmp_path / 'doc.md', 1, 'bash', code), repo, env, timeout=60)
    assert (repo / 'written-here').exists() and not (ROOT / 'written-here').exists()


def test_runner_times_out(tmp_path):
    repo, env = make_sandbox(tmp_path)
    with pytest.raises(BlockFailed, match='ran past 1 s'):
        run_block(Block(tmp_path / 'doc.md', 1, 'bash', 'sleep 30\n'), repo, env, timeout=1)


def test_runner_skips_by_marker_and_without_shared():
    b = Block(ROOT / 'README.md', 1, 'bash', 'cat ../shared/data/text8-head.txt\n')
    assert skip_reason(b, slow=False, cuda=False, shared=True) is None
    assert 'absent' in skip_reason(b, slow=True, cuda=True, shared=False)
    b.kinds = {'slow'}
    assert '--slow' in skip_reason(b, slow=False, cuda=False, shared=True)
    assert skip_reason(b, slow=True, cuda=False, shared=True) is None
    b.kinds = {'gpu'}
    assert 'CUDA' in skip_reason(b, slow=True, cuda=False, shared=True)
    b.kinds = {'plots'}
    assert 'matplotlib' in skip_reason(b, slow=True, cuda=True, shared=True, plots=False)
    assert skip_reason(b, slow=True, cuda=True, shared=True, plots=True) is None


def test_runner_flags_links_and_outside_references(tmp_path):
    doc = write_doc(tmp_path, "# Title here\n[a](#title-here) [b](#nowhere) [c](missing.md)\n"
                              '[d](https://example.org/x)\n'
                              'see DESIGN.md, commit fb28fa8, issue 14, #7\n'
                              "2.93e13 FLOPs, 2,048,000 chars, step 1000, Unicode's UTS #39\n")
    assert broken_links(doc) == ['doc.md: #nowhere (no such heading)',
                                 'doc.md: missing.md (no such file)']
    anchor = github_anchor("H-Net's chunking (`--boundary hnet`)")
    assert anchor == 'h-nets-chunking---boundary-hnet'
    assert [b.split(': ', 1)[1] for b in outside_references(doc)] == [
        'cites DESIGN.md (the design notes are docs/design.md)',
        'looks like a commit hash: fb28fa8', 'an issue number']


def test_runner_runs_earlier_blocks_first_and_stops_after_a_failure(tmp_path, tmp_path_factory):
    doc = write_doc(tmp_path, '```bash\ntouch made-by-first\n```\n```bash\ntest -f made-by-first\n'
                              '```\n```bash\nfalse\n```\n```bash\necho after\n```\n')
    blocks, boxes = parse(doc)[0], Sandboxes(tmp_path_factory, slow=False)
    boxes.run(blocks[1])                       # runs the first block before it
    with pytest.raises(pytest.fail.Exception, match='exited 1'):
        boxes.run(blocks[2])
    with pytest.raises(pytest.fail.Exception, match='an earlier block of this file failed'):
        boxes.run(blocks[3])


@pytest.mark.slow   # makes two virtual environments
def test_ci_reports_failures_tolerates_empty_selections_and_stops_on_setup(tmp_path):
    def ci(commands):
        repo = tmp_path / f'repo{len(list(tmp_path.iterdir()))}'
        (repo / '.ci').mkdir(parents=True)
        shutil.copy(ROOT / '.ci' / 'run', repo / '.ci' / 'run')
        (repo / 'README.md').write_text('<!-- ci -->\n```bash\n' + '\n'.join(commands) + '\n```\n')
        return subprocess.run(['bash', str(repo / '.ci' / 'run')], capture_output=True, text=True,
                              timeout=600, env={k: v for k, v in os.environ.items()
                                                if not k.startswith(('VIRTUAL_ENV', 'PYTHON'))})
    p = ci(["python -c 'import sys; assert sys.prefix != sys.base_prefix'",   # a fresh venv
            "python -c 'raise SystemExit(5)' pytest -m plots",     # exit 5 of a -m selection
            "python -c 'raise SystemExit(5)' pytest",              # exit 5 without -m: a failure
            'echo still-runs',
            # exit 0, but a traceback printed (of an exception raised in a thread)
            "python -c 'import threading; threading.Thread(target=lambda: 1 / 0).start()'"])
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert '[1] ok' in out and '[2] no tests selected' in out and '[3] FAILED (exit 5)' in out
    assert 'still-runs' in out and "2 of README's CI commands failed" in out
    assert '[5] FAILED (exit 0, but a traceback in its output)' in out
    p = ci(['pip install ./no-such-package', 'echo never'])
    assert p.returncode == 1 and 'set-up command [1] failed; stopping' in p.stderr
    assert 'never' not in p.stdout
