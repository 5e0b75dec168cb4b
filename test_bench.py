"""Tests of bench.py: its flags, paths and errors, the predictor configurations, the FLOP formula,
the child process's measurement (peak memory after the warm-up, TF32 on a GPU), the profile and its
trace, a fuzz test of the command line's contract, and (with CUDA) the GPU timing path.

Run:   python -m pytest -q test_bench.py
"""

import contextlib
import errno
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import bench
from conftest import HYPOTHESIS_FIXTURES, ROOT, assert_cli_contract, no_hang, odd_paths, run_main

TINY = ['--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64', '--seq-len', '64',
        '--batch', '2', '--layers', '1,1,1', '--threads', '1']


def _cli(args, cwd):
    """`python bench.py ARGS` in cwd."""
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
    return subprocess.run([sys.executable, str(ROOT / 'bench.py')] + [str(a) for a in args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)


# ---------------------------------------------------------------------------------------------
# Flags: one line, exit 2, before anything runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('flags, words', [
    (['--batch', '0'], '--batch'), (['--seq-len', '0'], '--seq-len'), (['--seq-len', '-5'], '--seq-len'),
    (['--d-model', '-4'], '--d-model'), (['--d-model', '31'], 'd_model even'), (['--dropout', '2'], '--dropout'),
    (['--dropatt', '-0.1'], '--dropatt'), (['--peak-n', '0'], '--peak-n'), (['--threads', '0'], '--threads'),
    (['--attn-chunk', '0'], '--attn-chunk'), (['--n-head', '0'], '--n-head'), (['--steps', '0'], '--steps'),
    (['--warmup', '-1'], '--warmup'), (['--threads', '100000'], '--threads'), (['--seed', '-1'], '--seed'), (['--new', '0'], '--new'), (['--configs', 'ws0.5'], 'ws0.5'),
    (['--dropout', 'nan'], '--dropout'), (['--dropatt', 'inf'], '--dropatt'), (['--timeout', 'nan'], '--timeout'),
    (['--timeout', 'inf'], '--timeout'), (['--timeout', '0'], '--timeout'), (['--timeout', '-3'], '--timeout'),
    (['--configs', 'wsnan'], 'wsnan'), (['--configs', 'wsinf'], 'wsinf'), (['--layers', '1,-1,1'], 'layers'),
    (['--layers', 'a,b,c'], '--layers'), (['--peak-n', 'nan'], '--peak-n'), (['--gen-batch', '-1'], '--gen-batch'),
    (['--context', '1e3'], '--context'), (['--device', 'meta'], '--device'),
    (['--configs', 'fixed2.5'], 'fixed2.5'), (['--configs', 'fixed65'], '--seq-len 64'), (['--configs', 'ws4+fast'], '+fast'), (['--configs', 'vanila'], 'vanila'),
    (['--layers', '2,8'], 'layers'), (['--device', 'nonsense'], '--device'), (['--trace', 't.json'], '--profile'),
    (['--plot', '/no/such/folder/p.png'], '/no/such/folder')])
def test_bad_flags_are_one_line_exit_2(flags, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(TINY + flags)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ''
    assert err.count('\n') == 1 and err.startswith('error: ') and words in err, err


def test_bad_flag_through_the_command_line(tmp_path):
    """The real command: one line (no usage dump), exit 2, nothing written."""
    p = _cli(['--batch', '0', '--plot', 'p.png'], tmp_path)
    assert p.returncode == 2 and p.stdout == '' and os.listdir(tmp_path) == []
    assert p.stderr.count('\n') == 1 and p.stderr.startswith('error: argument --batch'), p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available here')
def test_cuda_without_cuda_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(['--device', 'cuda'])
    assert e.value.code == 2 and 'CUDA' in capsys.readouterr().err


def test_attention_suffix_sets_the_attention_path():
    """A +sdpa/+blocked suffix sets Config.attention; without one the model's default stays."""
    args = bench.parse_args(TINY)
    assert bench.parse_config('ws4+compile+blocked', args) == ('whitespace', 4.0, True, 'blocked')
    assert bench.parse_config('gumbel5.5', args) == ('gumbel', 5.5, False, None)
    assert bench.model_config(args, 'vanilla+sdpa').attention == 'sdpa'
    assert bench.model_config(args, 'vanilla').attention == 'auto'


# ---------------------------------------------------------------------------------------------
# Faults at run time: one line, exit 1 or 130, nothing written
# ---------------------------------------------------------------------------------------------
def _no_plotting(monkeypatch):
    """--plot without matplotlib (the optional extra): its import stood in for, and drawing it a
    file, so that a test sees whether a plot would have been written."""
    monkeypatch.setattr(bench, 'import_pyplot', lambda: object())
    monkeypatch.setattr(bench, 'plot', lambda args, *rest: Path(args.plot).write_text('a plot'))


def test_failing_configuration_is_one_line(tmp_path, capsys, monkeypatch):
    """A real child that cannot allocate its batch: the parent names the configuration, in one line,
    exit 1, and writes no plot."""
    _no_plotting(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ['--batch', str(10 ** 10), '--configs', 'vanilla', '--rounds', '1', '--steps', '1',
                           '--peak-n', '64', '--plot', 'p.png'])
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert err.count('\n') == 1 and err.startswith('error: configuration vanilla failed: '), err
    assert 'memory' in err and 'Traceback' not in err and '--batch' in err
    assert os.listdir(tmp_path) == []


def test_failed_configuration_is_left_out_of_the_table(monkeypatch, capsys):
    """One configuration fails (or outlives --timeout): the others are measured and tabled, then one
    line names the failure, exit 1."""
    args = bench.parse_args(TINY + ['--timeout', '0.01'])
    record, why = bench.spawn(args, 'vanilla')          # a real child, killed at its time limit
    assert record is None and 'took over 0.01 s' in why

    def fake_spawn(args, name):
        if name == 'ws4':
            return None, 'out of memory: boom'
        return dict(name=name, times=[0.2, 0.2], peak=10, step_mem=5, sf=2.0 if name == 'fixed2' else 1.0), None
    monkeypatch.setattr(bench, 'spawn', fake_spawn)
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ['--configs', 'vanilla,ws4,fixed2', '--peak-n', '64', '--no-pieces', '--rounds', '1'])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err == 'error: configuration ws4 failed: out of memory: boom\n'
    rows = [ln.split()[0] for ln in out.splitlines() if re.match(r'(vanilla|ws4|fixed2) +\d', ln)]
    assert rows == ['vanilla', 'fixed2'] and 'round 1: ws4      failed: out of memory: boom' in out


def test_ctrl_c_exits_130_with_nothing_written(tmp_path, capsys, monkeypatch):
    """bench.py's command line on Ctrl-C while a configuration runs: one line, exit 130, no plot."""
    def ctrl_c(*args):
        raise KeyboardInterrupt
    _no_plotting(monkeypatch)
    monkeypatch.setattr(bench, 'spawn', ctrl_c)
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            bench.main(TINY + ['--configs', 'vanilla', '--peak-n', '64', '--plot', 'p.png'])
    except KeyboardInterrupt:
        pytest.fail('Ctrl-C escaped bench.main')
    err = capsys.readouterr().err
    assert e.value.code == 130 and err == 'error: interrupted (Ctrl-C); no file written\n'
    assert os.listdir(tmp_path) == []


def test_out_of_memory_names_the_flags_of_what_ran(capsys):
    """Generation that cannot allocate its sequences names --gen-batch (not the training step's
    --batch); the training table names --batch, --seq-len and --peak-n."""
    for extra, flags in ((['--generate', '--gen-batch', str(10 ** 8)], '--gen-batch, --context or --new'),
                         (['--configs', 'vanilla', '--peak-n', str(10 ** 7)], '--batch, --seq-len or --peak-n')):
        with pytest.raises(SystemExit) as e:
            bench.main(TINY + extra)
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.count('\n') == 1 and err.startswith('error: out of memory: '), err
        assert err.rstrip('\n').endswith(f'try a smaller {flags}'), err


@pytest.mark.parametrize('flag', ['--plot', '--trace'])
@pytest.mark.parametrize('case, words', [('too-long', '300 bytes'), ('too-deep', 'does not exist'),
                                         ('through-a-file', 'not a directory'), ('fifo', 'FIFO'),
                                         ('dir', 'a directory')])
def test_odd_output_paths_are_refused_at_parse_time(tmp_path, capsys, flag, case, words):
    path = odd_paths(tmp_path, 'p.png')[case]
    before = sorted(os.listdir(tmp_path))
    with no_hang(60), pytest.raises(SystemExit) as e:
        bench.main(TINY + ['--profile', 'vanilla', flag, str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and err.startswith(f'error: argument {flag}: ') and words in err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize('how', ['raises', 'silent', 'runtime'])
def test_trace_on_a_full_disk_names_the_reason_and_leaves_nothing(tmp_path, capsys, monkeypatch, how):
    """The disk fills while the trace is written: the write fails with ENOSPC (raises), or, as the
    profiler's own writer does, stops without a word (silent), or the writer fails in C++ (runtime):
    one line naming the reason, exit 1, no trace and no temporary file."""
    def full_disk(self, path, *args, **kwargs):
        with open(path, 'w') as f:
            f.write('{"traceEvents": [{"name": "aten::mm", ')
        if how == 'raises':
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if how == 'runtime':
            raise RuntimeError('Trace is already saved.')
    monkeypatch.setattr(torch.profiler.profile, 'export_chrome_trace', full_disk)
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, 'statvfs', lambda p: SimpleNamespace(f_bavail=0, f_frsize=real_statvfs(p).f_frsize))
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ['--profile', 'vanilla', '--warmup', '1', '--trace', str(tmp_path / 't.json')])
    err = capsys.readouterr().err
    reason = 'Trace is already saved.' if how == 'runtime' else 'No space left on device'
    assert e.value.code == 1 and err == f'error: cannot write --trace {tmp_path / "t.json"}: {reason}\n', err
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['unigram4', 'entropy4', 'gumbel8'])
def test_predictor_configurations_pool_at_about_their_factor(name):
    """unigramK/entropyK/gumbelK: the predictor, shifted once, closes about 1/K of the segments, and
    keeps doing so through the timed steps (its loss and gradients are in each of them)."""
    args = bench.parse_args(TINY + ['--batch', '4', '--seq-len', '128', '--d-inner', '256'])
    model, step, outs = bench.prepared(args, name)
    pred = bench.predictor_of(model)
    for _ in range(6):
        step()
        k = bench.parse_config(name, args)[1]
        assert 0.7 * k < float(outs[0].shortening_factor) < 1.4 * k, float(outs[0].shortening_factor)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pred.parameters())


@pytest.mark.parametrize('name', ['vanilla', 'ws4', 'gumbel4', 'hnet4'])
def test_flop_formula_matches_counted_matmuls(name):
    """The printed formula against torch's own count of the matrix multiplies of one training step
    (forward + backward), with the attention computed in one block so that every n² term runs."""
    args = bench.parse_args(TINY + ['--dropout', '0', '--dropatt', '0', '--attn-chunk', '64']
                            + ['--attention', 'blocked'])
    model, mode, k, (x, y, b) = bench.setup(args, name)
    with FlopCounterMode(display=False) as counter:
        out = model(x, targets=y, boundaries=b)
        out.loss.backward()
    sf = float(out.shortening_factor) if out.shortening_factor is not None else 1.0
    formula = bench.config_flops(args, name, sf)
    # r_net's input (the sinusoids) needs no gradient: its backward is 1×, not 2× — the only gap
    assert formula == pytest.approx(counter.get_total_flops(), rel=0.03)


@pytest.mark.parametrize('name', ['hnet4', 'hnet8'])
def test_hnet_configurations_pool_at_about_their_factor(name):
    """hnetK: the router's start probabilities, shifted once, start about 1/K of the chunks, and keep
    doing so through the timed steps (the router learns through the pooling and the ratio loss)."""
    args = bench.parse_args(TINY + ['--batch', '4', '--seq-len', '128', '--d-inner', '256'])
    model, step, outs = bench.prepared(args, name)
    k = bench.parse_config(name, args)[1]
    for _ in range(6):
        step()
        assert 0.7 * k < float(outs[0].shortening_factor) < 1.4 * k, float(outs[0].shortening_factor)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.source.parameters())


def test_child_measures_steps_memory_and_sf(capsys):
    """`bench.py --one CONFIG` prints the JSON line the parent reads: one time per timed step, the
    peak and step memory, the measured SF."""
    args = bench.parse_args(TINY + ['--one', 'ws4', '--steps', '2', '--warmup', '1'])
    bench.run_one(args, 'ws4')
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec['name'] == 'ws4' and len(rec['times']) == 2 and all(t > 0 for t in rec['times'])
    assert rec['peak'] > 0 and rec['sf'] == pytest.approx(64 / 16)


@pytest.mark.parametrize('device', ['cuda', 'cpu'])
def test_peak_memory_counts_from_after_the_warm_up(monkeypatch, capsys, device):
    """The peak is reset after the warm-up steps (compilation and autotuning stay out of the rows),
    and step mem counts from before them (the gradients and Adam moments they make stay in). On CUDA
    with torch.cuda's memory functions stood in for, on CPU with the resident-set reset."""
    calls = []
    args = bench.parse_args(TINY + ['--one', 'vanilla', '--steps', '2', '--warmup', '2'])
    args.device = device   # after parsing: no GPU is needed, every CUDA call below is stood in for
    out = SimpleNamespace(shortening_factor=None)
    monkeypatch.setattr(bench, 'prepared', lambda a, n: (torch.nn.Linear(2, 2), lambda: calls.append('step'), [out]))
    monkeypatch.setattr(bench, 'time_calls', lambda fn, n, dev: [fn() or 0.1 for _ in range(n)])
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: None)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda *a: calls.append('base') or 100)
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda *a: calls.append('reset'))
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda *a: calls.append('peak') or 300)
    monkeypatch.setattr(bench, 'rss_now', lambda: calls.append('base') or 100)
    monkeypatch.setattr(bench, 'reset_peak_rss', lambda: calls.append('reset') or True)
    monkeypatch.setattr(bench, 'peak_rss', lambda since_reset=False: calls.append(f'peak {since_reset}') or 300)
    bench.run_one(args, 'vanilla')
    peak = 'peak' if device == 'cuda' else 'peak True'
    assert calls == ['base', 'step', 'step', 'reset', 'step', 'step', peak]
    rec = json.loads(capsys.readouterr().out)
    assert rec['peak'] == 300 and rec['step_mem'] == 200


def test_peak_resident_set_resets_on_linux():
    """The CPU reset itself: after it, the peak is the resident set of now, below an earlier peak."""
    if not bench.reset_peak_rss():
        pytest.skip('this system cannot reset the peak resident set')
    block = torch.ones(64 * 2 ** 20 // 4)          # 64 MiB resident, then freed
    high = bench.peak_rss(since_reset=True)
    del block
    assert bench.reset_peak_rss()
    assert bench.peak_rss(since_reset=True) < high - 32 * 2 ** 20


def test_cuda_runs_with_tf32_matmuls_as_train_py(monkeypatch):
    """On a GPU every process of bench.py (the children too) sets TF32 matmuls before it measures,
    as train.py trains; torch.cuda stood in for, so that no GPU is needed."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    seen = {}
    monkeypatch.setattr(bench, 'run_one', lambda args, name: seen.update(
        device=args.device, matmul=torch.backends.cuda.matmul.allow_tf32, cudnn=torch.backends.cudnn.allow_tf32))
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:   # (monkeypatch cannot restore these: torch's flag objects have no such attributes of their own)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        bench.main(TINY + ['--device', 'cuda', '--one', 'vanilla'])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was
    assert seen == dict(device='cuda', matmul=True, cudnn=True)
    assert 'fp32 (TF32 matmuls)' == bench.precision(bench.parse_args(TINY + ['--device', 'cuda', '--amp', 'off']))


def test_profile_prints_ops_and_writes_the_trace(tmp_path, capsys):
    trace = tmp_path / 't.json'
    args = bench.parse_args(TINY + ['--profile', 'gumbel4', '--trace', str(trace), '--warmup', '1'])
    bench.profile_step(args, 'gumbel4')
    out = capsys.readouterr().out
    ops = re.search(r'one gumbel4 step under the profiler: [\d.]+ ms, (\d+) aten ops dispatched', out)
    assert ops and int(ops.group(1)) > 50, out[-500:]
    assert json.loads(trace.read_text()) and os.listdir(tmp_path) == ['t.json']


@pytest.mark.plots
def test_table_reads_the_runs(capsys, tmp_path):
    """From children's records to the printed table: speed-up and memory ratio against vanilla,
    chars/s from the median step, the plot written whole."""
    pytest.importorskip('matplotlib')
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    args = bench.parse_args(TINY + ['--configs', 'vanilla,ws4', '--plot', str(tmp_path / 'p.png')])
    rec = lambda n, ts, mem, sf: [dict(name=n, times=ts, peak=mem + 100, step_mem=mem, sf=sf)]
    results = {'vanilla': rec('vanilla', [0.4, 0.2, 0.3], 1000, 1.0), 'ws4': rec('ws4', [0.1, 0.1, 0.2], 250, 4.0)}
    table = bench.summarise(args, ['vanilla', 'ws4'], results)
    bench.print_table(args, ['vanilla', 'ws4'], table, peak=1e12)
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('ws4 '))
    cols = row.split()
    assert cols[1] == '4.00' and cols[2] == '100' and cols[3] == str(2 * 64 * 10)
    assert cols[4] == '3.00×' and cols[7] == '0.25'
    bench.plot(args, ['vanilla', 'ws4'], table, plt)
    assert (tmp_path / 'p.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and os.listdir(tmp_path) == ['p.png']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_step_timed_with_events_and_peak_memory(capsys):
    """On a GPU: bf16 autocast, CUDA-event times, max_memory_allocated, host syncs counted."""
    args = bench.parse_args(TINY + ['--device', 'cuda', '--one', 'gumbel4', '--steps', '2'])
    assert args.amp == 'bf16' and args.warmup == 3
    bench.run_one(args, 'gumbel4')
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(rec['times']) == 2 and all(t > 0 for t in rec['times']) and rec['step_mem'] > 0
    assert bench.matmul_peak(args) > 1e12
    bench.profile_step(bench.parse_args(TINY + ['--device', 'cuda', '--profile', 'ws4']), 'ws4')
    assert 'host synchronisations in one ws4 step:' in capsys.readouterr().out


def test_pieces_and_their_share_of_a_pooled_step(capsys, monkeypatch):
    """The pieces of vanilla, ws, a predictor and an hnet configuration, timed alone; the share of
    pooling + upsampling + predictor (hnet: router) is taken of the predictor's and hnet's own steps,
    and of the ws step with a predictor added."""
    args = bench.parse_args(TINY + ['--seq-len', '32'])
    names = ['vanilla', 'ws4', 'gumbel4', 'hnet4']
    table = {n: dict(time=t) for n, t in zip(names, (0.03, 0.02, 0.025, 0.022))}
    timed = {}
    time_pieces = bench.time_pieces
    monkeypatch.setattr(bench, 'time_pieces', lambda a, n, t: timed.setdefault(n, time_pieces(a, n, t)))
    shares = bench.report_pieces(args, names, table)
    out = capsys.readouterr().out
    assert list(timed) == names and all(f'pieces of a {n} step' in out for n in names)
    pool, pred = timed['gumbel4'][bench.POOL], timed['gumbel4'][bench.PRED]
    assert pool > 0 and pred > 0
    assert shares['gumbel4'] == pytest.approx((pool + pred) / 0.025)
    pool, pred = timed['ws4'][bench.POOL], timed['ws4'][bench.PRED]
    assert shares['ws4'] == pytest.approx((pool + pred) / (0.02 + pred))
    assert f'{100 * shares["gumbel4"]:.1f}% of a gumbel4 step\n' in out
    # hnet: its own router and chunk pooling, in its own step
    pool, pred = timed['hnet4'][bench.POOL], timed['hnet4'][bench.PRED]
    assert pool > 0 and pred > 0 and shares['hnet4'] == pytest.approx((pool + pred) / 0.022)
    assert bench.HNET_POOL in out and bench.HNET_PRED in out
    assert out.count('(unigram/entropy/gumbel only; not in ws)') == 1   # gumbel4 times its own predictor


def test_generation_bench_runs_cached_and_full(capsys):
    args = bench.parse_args(TINY + ['--generate', '--context', '16', '--new', '4', '--recompute-steps', '2'])
    bench.bench_generate(args)
    out = capsys.readouterr().out
    for name in ('vanilla', 'ws5.5'):
        rates = re.findall(rf'{re.escape(name)} +(?:cached decode|model.generate|full recomputation)\D+([\d.]+) ', out)
        assert len(rates) == 3 and all(float(r) > 0 for r in rates), out
    assert 'all layers' in out and 'pre stack' in out


# ---------------------------------------------------------------------------------------------
# Fuzz: random flags keep the command line's contract
# ---------------------------------------------------------------------------------------------
# flag: (values that run, values that must be refused); an example takes a refused one in six times.
# Sizes are tiny or far beyond any memory (refused by the allocator at once): never in between, where
# an allocation could succeed and then take the machine's memory. No +compile: minutes per example.
_FLAG_VALUES = {
    '--configs': (['vanilla', 'ws2', 'fixed2', 'gumbel2', 'hnet2', 'unigram2', 'entropy2', 'vanilla,ws2'],
                  ['', ',', 'ws0.5', 'wsnan', 'wsinf', 'ws1e400', 'fixed2.5', 'vanila', 'ws2+fast', 'ws2,ws2']),
    '--d-model': (['16'], ['0', '-4', '15', 'nan', str(10 ** 12)]),
    '--n-head': (['2'], ['0', 'x']),
    '--seq-len': (['16', '24'], ['0', '-5', str(10 ** 12)]),
    '--batch': (['1', '2'], ['0', str(10 ** 12)]),
    '--layers': (['1,1,1', '1,2,1'], ['2,8', '1,-1,1', 'a,b,c', '0,0,0', '1,1,1,1', '']),
    '--dropout': (['0', '0.1'], ['1', '-0.1', 'nan', 'inf']),
    '--attn-chunk': (['8'], ['0', '-1']),
    '--attention': (['sdpa', 'blocked', 'auto'], ['fast']),
    '--warmup': (['0', '1'], ['-1', 'x']),
    '--device': (['cpu'], ['cuda:7', 'nonsense', 'meta']),
    '--amp': (['auto', 'off'], ['fp8']),
    '--clock': (['wall', 'cpu'], ['gpu']),
    '--adam': (['fused', 'foreach', 'loop'], ['sgd']),
    '--peak-n': (['8', '16'], ['0', str(10 ** 7)]),
    '--timeout': (['30', '1e9'], ['nan', 'inf', '-1', '0']),
    '--seed': (['0', '1'], ['-1', 'nan']),
    '--context': (['8'], ['0', str(10 ** 12)]),
    '--gen-batch': (['1', '2'], ['0', str(10 ** 12)]),
}
_MODES = {'table': [], 'no pieces': ['--no-pieces'], 'profile': ['--profile'], 'generate': ['--generate']}


def _in_process_spawn(args, name):
    """bench.spawn without a process: the child's own command line, parsed and run here."""
    child = bench.parse_args(bench.child_cmd(args, name)[2:])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.run_one(child, name)
    return json.loads(out.getvalue().splitlines()[-1]), None


@settings(max_examples=15, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_fuzz_keeps_the_contract(data, capsys, monkeypatch):
    """Random flags and values (non-finite, huge, negative, odd strings and paths) in every mode: the
    table, --profile (with --trace), --generate. bench.main ends with exit 0, 1, 2 or 130, never an
    uncaught exception; a failure is one `error:` line; no temporary file is left, and a trace or plot
    that exists is whole. The children run in this process (bench.spawn stood in for: a process each
    would take seconds) and the plot is stood in for (matplotlib is optional)."""
    with tempfile.TemporaryDirectory() as tmp, no_hang(120), monkeypatch.context() as m:
        root = Path(tmp)
        odd = odd_paths(root, 'p.png')
        m.setattr(bench, 'spawn', _in_process_spawn)
        m.setattr(bench, 'clock', bench.clock)          # --clock cpu changes it for the process
        _no_plotting(m)
        mode = data.draw(st.sampled_from(sorted(_MODES)), label='mode')
        argv = TINY + ['--configs', 'vanilla', '--peak-n', '8', '--rounds', '1', '--steps', '1', '--warmup', '0',
                       '--context', '8', '--new', '2', '--recompute-steps', '1'] + _MODES[mode]
        if mode == 'profile':
            argv.append(data.draw(st.sampled_from(['vanilla', 'ws2', 'gumbel2', 'nope', 'ws0.5']), label='config'))
        for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True, max_size=3)):
            good, bad = _FLAG_VALUES[flag]
            refused = data.draw(st.integers(0, 5), label=f'{flag} refused') == 0
            argv += [flag, data.draw(st.sampled_from(bad if refused else good), label=flag)]
        for flag, name, fits in (('--trace', 't.json', mode == 'profile'), ('--plot', 'p.png', 'table' in mode
                                                                                  or mode == 'no pieces')):
            if data.draw(st.integers(0, 3), label=f'use {flag}') < (2 if fits else 1):
                refused = data.draw(st.integers(0, 3), label=f'{flag} refused') == 0
                pick = data.draw(st.sampled_from(sorted(odd) if refused else [name]), label=flag)
                argv += [flag, str(odd.get(pick, root / pick))]
        rc, out, err = run_main(bench.main, argv, capsys)
        event(f'{mode}: exit {rc}')   # --hypothesis-show-statistics: how many examples got how far
        assert_cli_contract(rc, err, argv)
        left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if '.tmp' in f]
        assert not left, (argv, left)
        if os.path.isfile(root / 't.json'):
            assert rc == 0 and json.loads((root / 't.json').read_text()), argv
