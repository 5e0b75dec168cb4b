"""Tests of flags.py's plug-ins and shared flags, through the commands a user types:
`--import` runs a user's boundary source contained (its own sys.argv, a helper beside it, an
exit or an exception one error line), never under a built-in's name, its options' flags take
their defaults, and the checkpoint records the file's content: a changed or missing one is
named. The flags train.py, sample.py and bench.py share are one definition.
Run: python -m pytest -q test_flags.py
"""
import hashlib
import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
import checkpoint
import flags
import sample
from conftest import random_words, write_dataset

ROOT = Path(__file__).parent
TINY = ['--device', 'cpu', '--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64',
        '--layers', '1,1,1', '--seq-len', '32', '--batch-size', '4', '--eval-window', '32',
        '--eval-step', '8', '--eval-batch-size', '32', '--eval-subset-chars', '400',
        '--eval-max-chars', '400', '--log-interval', '1', '--warmup', '2', '--max-steps', '2']

# A user's source in a folder of its own: it imports a helper beside it, parses sys.argv when
# imported (as a script of its own would), and has options whose defaults are inf and an int
# for a float; it reads them from Config.options.
PLUGIN = """
import argparse
import dataclasses
import math

import torch

from dynpool import ExternalBoundaries, register_source
from every_helper import EVERY

argparse.ArgumentParser().parse_args()


@dataclasses.dataclass
class EveryOptions:
    limit: float = math.inf
    rate: float = 1


class EveryBoundaries(ExternalBoundaries):
    Options = EveryOptions

    def derive(self, x, offset):
        t = torch.arange(offset, offset + x.size(1), device=x.device)
        return ((t + 1) % EVERY == 0).expand_as(x)


register_source('every', EveryBoundaries)
"""


def run(script, *argv):
    """python script argv in the checkout → the finished process (stdout, stderr as text)."""
    return subprocess.run([sys.executable, script, *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True)


def one_error(done, code, *words):
    """done ended with exit `code` and one `error:` line holding words → that line."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1, done.stderr
    assert lines[0].startswith('error: ') and all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture(scope='module')
def plugin_run(tmp_path_factory):
    """A 2-step train.py run of the plugin's source with its option flags → (plugin file, run
    folder, the train.py process)."""
    base = tmp_path_factory.mktemp('plugin')
    data = write_dataset(base / 'data', random_words(20_000))
    folder = base / 'mine'
    folder.mkdir()
    (folder / 'every_helper.py').write_text('EVERY = 3\n')
    plugin = folder / 'every_k.py'
    plugin.write_text(PLUGIN)
    out = base / 'run'
    done = run('train.py', '--import', plugin, '--boundary', 'every', '--limit', 'inf',
               '--rate', '0.5', '--data', data, '--out', out, *TINY)
    return plugin, out, done


def test_a_plugin_trains_contained_and_the_checkpoint_records_its_content(plugin_run):
    """train.py imports the plugin with a sys.argv of its own and its folder importable; the
    option flags take inf (a default) and 0.5 (an int-defaulted float); the checkpoint records
    the file with its SHA-256 and the options in Config.options; sample.py reads it back."""
    plugin, out, done = plugin_run
    assert done.returncode == 0, done.stderr
    ckpt = torch.load(out / 'ckpt.pt', weights_only=False)
    sha = hashlib.sha256(plugin.read_bytes()).hexdigest()
    assert ckpt['imports'] == [{'import': str(plugin), 'sha256': sha}]
    assert ckpt['format'] == checkpoint.FORMAT
    assert ckpt['config']['options'] == {'limit': math.inf, 'rate': 0.5}
    again = run('sample.py', '--import', plugin, '--ckpt', out, '--chars', 8, '--device', 'cpu')
    assert again.returncode == 0 and again.stdout.strip(), again.stderr


def test_a_changed_or_missing_plugin_is_named(plugin_run, tmp_path):
    """The checkpoint's plug-in changed since the run (same path, other content): sample.py and
    train.py --resume say so in one line, though the --import is given; gone: one line says
    it is missing."""
    plugin, out, done = plugin_run
    assert done.returncode == 0, done.stderr
    original = plugin.read_text()
    try:
        plugin.write_text(original + '\n# edited\n')
        said = one_error(run('sample.py', '--import', plugin, '--ckpt', out, '--device', 'cpu'),
                         1, str(plugin), 'has changed since')
        assert 'needs' not in said
        one_error(run('train.py', '--import', plugin, '--out', out, '--resume', '--device',
                      'cpu'), 1, 'has changed since')
        plugin.unlink()
        one_error(run('sample.py', '--ckpt', out, '--device', 'cpu'), 1, str(plugin),
                  'is missing now')
    finally:
        plugin.write_text(original)


def test_an_earlier_checkpoint_is_refused_in_one_line_on_resume(plugin_run, tmp_path):
    """A sealed checkpoint of an earlier train.py (no format field, imports as bare names)
    is one line naming its format and what it lacks, not a KeyError."""
    plugin, out, done = plugin_run
    assert done.returncode == 0, done.stderr
    old = torch.load(out / 'ckpt.pt', weights_only=False)
    del old['format'], old['dataset']
    old['imports'] = [str(plugin)]
    (tmp_path / 'run').mkdir()
    buf = io.BytesIO()
    torch.save(old, buf)
    with open(tmp_path / 'run' / 'ckpt.pt', 'wb') as f:
        checkpoint.write_sealed(f, buf.getbuffer())
    one_error(run('train.py', '--import', plugin, '--out', tmp_path / 'run', '--resume',
                  '--device', 'cpu'), 1, 'earlier train.py (format 1', 'format, dataset')


@pytest.mark.parametrize('script, code, words', [
    ('train.py', "import sys\nsys.exit('it stops here')\n", ['exited', 'it stops here']),
    ('sample.py', "import argparse\nargparse.ArgumentParser().parse_args(['--what'])\n",
     ['exited', 'unrecognized arguments: --what']),
    ('bench.py', "raise RuntimeError('no GPU here')\n", ['no GPU here']),
    ('train.py', "import dynpool\n\n\nclass Mine(dynpool.FixedBoundaries):\n    pass\n\n\n"
     "dynpool.register_source('fixed', Mine)\n", ['fixed']),
])
def test_a_plugin_that_fails_exits_or_shadows_is_one_line(script, code, words, tmp_path):
    """A plug-in that exits, fails or registers a built-in's name while imported: one error
    line naming the --import, exit 2, from each script that takes --import."""
    plugin = tmp_path / 'bad.py'
    plugin.write_text(code)
    argv = ['--import', plugin, '--device', 'cpu']
    if script == 'sample.py':
        argv += ['--ckpt', tmp_path]
    one_error(run(script, *argv), 2, f'--import {plugin}', *words)


def test_shared_flags_are_one_definition(capsys):
    """--import, --device, --amp and the size flags read the same in train.py, sample.py and
    bench.py (the help train.py adds its defaults to aside)."""
    parsers = {'train.py': flags.parser(), 'bench.py': bench.parser()}
    # sample.py's parser is built inside parse_args: --help prints it
    shared = ['--import', '--device', '--amp', '--d-model', '--layers', '--dropout']
    for flag in shared:
        actions = [p._option_string_actions[flag] for p in parsers.values()]
        assert len({(a.dest, a.type, a.choices, a.help.split(' (default')[0])
                    for a in actions}) == 1, flag
    with pytest.raises(SystemExit):
        sample.parse_args(['--help'])
    helped = capsys.readouterr().out
    for flag in ('--import', '--device'):
        words = parsers['bench.py']._option_string_actions[flag].help.split()[:6]
        assert ' '.join(words) in ' '.join(helped.split()), flag
    assert sample.flags is flags


def test_the_gpu_preset_is_the_papers_model_that_config_defaults_to():
    """The paper's shape is written once, in Config's defaults: the GPU preset reads it."""
    paper = flags.Config()
    assert all(flags.GPU_PRESET[k] == getattr(paper, k) for k in flags.SHAPE)
    assert (paper.d_model, paper.layers) == (512, (2, 8, 2))
