"""Tests of bench.py: its flags and errors, each configuration's tiny step, the FLOP formula, the
child's measurement (peak memory after the warm-up, the parts of a pooled step), the table and the
plot, the generation benchmark, a fuzz test of the command line's contract, and (with CUDA) the
GPU path.

Run:   python -m pytest -q test_bench.py
"""
import contextlib
import io
import json
import os
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
ALL = ['vanilla', 'fixed2', 'ws4', 'unigram4', 'entropy4', 'gumbel4', 'hnet4']


def _cli(args, cwd):
    """`python bench.py ARGS` in cwd."""
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
    return subprocess.run([sys.executable, str(ROOT / 'bench.py')] + [str(a) for a in args],
                          cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def _in_process_spawn(args, name, pieces):
    """bench.spawn without a process: the child's command line, parsed and run here."""
    child = bench.parse_args(args.argv + ['--one', name] + ([] if pieces else ['--no-pieces']))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.run_one(child, name)
    return json.loads(out.getvalue().splitlines()[-1]), None


def _no_plotting(monkeypatch):
    """--plot without matplotlib (the optional extra): drawing it is writing a file."""
    monkeypatch.setattr(bench.common, 'import_pyplot', lambda flag: object())
    monkeypatch.setattr(bench, 'plot', lambda args, *rest: bench.common.write_atomic(
        args.plot, 'a plot'))


# ---------------------------------------------------------------------------------------------
# Flags: one line, exit 2, before anything runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('flags, words', [
    (['--batch', '0'], '--batch'), (['--seq-len', '-5'], '--seq-len'),
    (['--d-model', '31'], 'd_model even'), (['--dropout', '2'], '--dropout'),
    (['--dropatt', 'nan'], '--dropatt'), (['--peak-n', '0'], '--peak-n'),
    (['--threads', '0'], '--threads'), (['--threads', '100000'], '--threads'),
    (['--attn-chunk', '0'], '--attn-chunk'), (['--steps', '0'], '--steps'),
    (['--warmup', '-1'], '--warmup'), (['--seed', '-1'], '--seed'), (['--new', '0'], '--new'),
    (['--timeout', 'inf'], '--timeout'), (['--peak-flops', '0'], '--peak-flops'),
    (['--context', '1e3'], '--context'), (['--gen-batch', '-1'], '--gen-batch'),
    (['--layers', 'a,b,c'], '--layers'), (['--layers', '2,8'], 'layers'),
    (['--layers', '1,-1,1'], 'layers'), (['--configs', 'ws0.5'], 'ws0.5'),
    (['--configs', 'wsnan'], 'wsnan'), (['--configs', 'wsinf'], 'wsinf'),
    (['--configs', 'fixed2.5'], 'fixed2.5'), (['--configs', 'fixed65'], '--seq-len 64'),
    (['--configs', 'ws4+fast'], '+fast'), (['--configs', 'vanila'], 'vanila'),
    (['--configs', ','], '--configs'), (['--configs', 'ws4', '--layers', '1,0,1'], 'shortened'),
    (['--device', 'meta'], '--device'), (['--device', 'nonsense'], '--device'),
    (['--plot', 'p.png', '--generate'], '--plot'), (['--profile', 'vanila'], 'vanila'),
    (['--generate', '--configs', 'vanilla', '--layers', '0,0,0'], 'shortened layers')])
def test_bad_flags_are_one_line_exit_2(flags, words, capsys):
    rc, out, err = run_main(bench.main, TINY + flags, capsys)
    assert rc == 2 and out == ''
    assert err.count('\n') == 1 and err.startswith('error: ') and words in err, err


def test_bad_flag_through_the_command_line(tmp_path):
    """The real command: one line (no usage dump), exit 2, nothing written."""
    p = _cli(['--batch', '0', '--plot', 'p.png'], tmp_path)
    assert p.returncode == 2 and p.stdout == '' and os.listdir(tmp_path) == []
    assert p.stderr.count('\n') == 1 and p.stderr.startswith('error: argument --batch'), p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available here')
def test_cuda_without_cuda_is_one_line(capsys):
    rc, _, err = run_main(bench.main, ['--device', 'cuda'], capsys)
    assert rc != 0 and err.count('\n') == 1 and 'CUDA' in err


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
def test_failing_configuration_is_one_line(tmp_path, capsys, monkeypatch):
    """A real child that cannot allocate its batch: the parent names the configuration and the
    cause in one line, exit 1, and writes no plot."""
    _no_plotting(monkeypatch)
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(bench.main, TINY + ['--batch', str(10 ** 10), '--configs', 'vanilla',
                                              '--rounds', '1', '--steps', '1', '--peak-n', '64',
                                              '--plot', 'p.png'], capsys)
    assert rc == 1 and err.count('\n') == 1 and err.startswith('error: ') and 'vanilla' in err
    assert 'memory' in err and 'Traceback' not in err, err
    assert os.listdir(tmp_path) == []


def test_failed_configuration_is_left_out_of_the_table(monkeypatch, capsys):
    """One configuration fails (or outlives --timeout): the others are measured and tabled, then
    one line names the failed one, exit 1."""
    def spawn(args, name, pieces):
        return (None, 'took over 1 s (--timeout)') if name == 'ws4' else _in_process_spawn(
            args, name, pieces)
    monkeypatch.setattr(bench, 'spawn', spawn)
    rc, out, err = run_main(bench.main, TINY + ['--configs', 'vanilla,ws4,fixed2', '--rounds', '2',
                                                '--steps', '1', '--peak-n', '32'], capsys)
    rows = [ln.split()[0] for ln in out.splitlines() if ln.startswith(('vanilla ', 'fixed2 '))]
    assert rc == 1 and rows == ['vanilla', 'fixed2'] and 'ws4  ' not in out.split('config')[-1]
    assert err.count('\n') == 1 and 'ws4' in err and '--timeout' in err, err


def test_ctrl_c_is_one_line_exit_130(monkeypatch, capsys, tmp_path):
    _no_plotting(monkeypatch)
    monkeypatch.chdir(tmp_path)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, 'spawn', interrupted)
    rc, _, err = run_main(bench.main, TINY + ['--configs', 'vanilla', '--peak-n', '32',
                                              '--plot', 'p.png'], capsys)
    assert rc == 130 and err.count('\n') == 1 and 'Ctrl-C' in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('extra', [['--generate', '--gen-batch', str(10 ** 8)],
                                   ['--configs', 'vanilla', '--peak-n', str(10 ** 7)]])
def test_out_of_memory_is_one_line(capsys, extra):
    rc, _, err = run_main(bench.main, TINY + extra, capsys)
    assert rc == 1 and err.count('\n') == 1 and err.startswith('error: out of memory'), err


@pytest.mark.parametrize('case', ['too-deep', 'through-a-file', 'dir'])
def test_unwritable_plot_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, case):
    """The table is printed, then the plot's path fails as the operating system says: one line
    naming the path, exit 1, no temporary file."""
    pytest.importorskip('matplotlib')
    path = odd_paths(tmp_path, 'p.png')[case]
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(bench, 'spawn', _in_process_spawn)
    with no_hang(120):
        rc, out, err = run_main(bench.main, TINY + ['--configs', 'vanilla', '--rounds', '1',
                                                    '--steps', '1', '--peak-n', '32', '--plot',
                                                    path], capsys)
    assert rc == 1 and err.count('\n') == 1 and err.startswith('error: ') and 'vanilla ' in out
    assert str(tmp_path) in err, err
    assert sorted(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['unigram4', 'entropy4', 'gumbel8', 'hnet4', 'hnet8'])
def test_deciding_configurations_pool_at_about_their_factor(name):
    """unigramK/entropyK/gumbelK/hnetK: the source's scores, shifted once, end about 1/K of the
    segments, and keep doing so through the timed steps (their loss and gradients in each)."""
    args = bench.parse_args(TINY + ['--batch', '4', '--seq-len', '128', '--d-inner', '256'])
    model, step, outs, _ = bench.prepared(args, name)
    k = bench.parse_config(name, args)[1]
    for _ in range(6):
        step()
        sf = float(outs[0].shortening_factor)
        assert 0.7 * k < sf < 1.4 * k, sf
        assert all(p.grad is not None and p.grad.abs().sum() > 0
                   for p in model.source.parameters())


@pytest.mark.parametrize('name', ['vanilla', 'ws4', 'gumbel4', 'hnet4'])
def test_flop_formula_matches_counted_matmuls(name):
    """The printed formula against torch's own count of the matrix multiplies of one training step
    (forward + backward), with the attention computed in one block so that every n² term runs."""
    args = bench.parse_args(TINY + ['--dropout', '0', '--dropatt', '0', '--attn-chunk', '64',
                                    '--attention', 'blocked'])
    model, _, _, (x, y, b) = bench.prepared(args, name)
    with FlopCounterMode(display=False) as counter:
        out = model(x, targets=y, boundaries=b)
        out.loss.backward()
    sf = float(out.shortening_factor) if out.shortening_factor is not None else 1.0
    # r_net's input (the sinusoids) needs no gradient: its backward is 1×, not 2× — the only gap
    rec = dict(times=[1.0], peak=1, step_mem=1, sf=sf, parts={})
    flops = bench.summarise(args, {name: [rec]})[name]['flops']
    assert flops == pytest.approx(counter.get_total_flops(), rel=0.03)


@pytest.mark.parametrize('name', ALL + ['ws4+blocked', 'ws4+sdpa'])
def test_child_measures_each_configuration(name, capsys):
    """`bench.py --one CONFIG`, for every family: the JSON line the parent reads, with one time per
    timed step, peak and step memory, the measured SF and, for a pooled step, the time of each of
    its stages, of the pooling and of the boundary source."""
    args = bench.parse_args(TINY + ['--one', name, '--steps', '2', '--warmup', '1'])
    bench.run_one(args, name)
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec['name'] == name and len(rec['times']) == 2 and all(t > 0 for t in rec['times'])
    assert rec['peak'] > 0 and rec['sf'] >= 1
    if name.startswith(('fixed', 'ws')):
        assert rec['sf'] == pytest.approx(64 / (32 if name == 'fixed2' else 16))
    parts = [] if name == 'vanilla' else ['pre', 'shortened', 'post', 'pooling', 'boundary source']
    assert list(rec['parts']) == parts and all(t > 0 for t in rec['parts'].values())


@pytest.mark.parametrize('device', ['cuda', 'cpu'])
def test_peak_memory_counts_from_after_the_warm_up(monkeypatch, capsys, device):
    """The peak is reset after the warm-up steps (compilation and autotuning stay out of the rows),
    and step mem counts from before them (the gradients and Adam moments they make stay in). On
    CUDA with torch.cuda's memory functions stood in for, on CPU with the resident-set reset."""
    calls = []
    args = bench.parse_args(TINY + ['--one', 'vanilla', '--steps', '2', '--warmup', '2'])
    args.device = device   # after parsing: no GPU is needed, every CUDA call below is stood in for
    out = SimpleNamespace(shortening_factor=None)
    monkeypatch.setattr(bench, 'prepared', lambda a, n: (
        None, lambda: calls.append('step'), [out], None))
    monkeypatch.setattr(bench, 'time_calls', lambda fn, n, a: [fn() or 0.1 for _ in range(n)])
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: None)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda *a: calls.append('base') or 100)
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda *a: calls.append('reset'))
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda *a: calls.append('peak') or 300)
    monkeypatch.setattr(bench, 'resident', lambda f: calls.append(
        'base' if f == 'VmRSS' else 'peak') or (100 if f == 'VmRSS' else 300))
    monkeypatch.setattr(bench, 'reset_peak_rss', lambda: calls.append('reset'))
    bench.run_one(args, 'vanilla')
    assert calls == ['base', 'step', 'step', 'reset', 'step', 'step', 'peak']
    rec = json.loads(capsys.readouterr().out)
    assert rec['peak'] == 300 and rec['step_mem'] == 200


def test_peak_resident_set_resets_on_linux():
    """The CPU reset itself: after it the peak is the resident set of now, below an earlier peak."""
    if not os.access('/proc/self/clear_refs', os.W_OK):
        pytest.skip('this system cannot reset the peak resident set')
    block = torch.ones(64 * 2 ** 20 // 4)          # 64 MiB resident, then freed
    high = bench.resident('VmHWM')
    del block
    bench.reset_peak_rss()
    assert bench.resident('VmHWM') < high - 32 * 2 ** 20


def test_cuda_runs_with_tf32_matmuls_as_train_py(monkeypatch):
    """On a GPU every process of bench.py (the children too) sets TF32 matmuls before it measures,
    as train.py trains; torch.cuda stood in for, so that no GPU is needed."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: None)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d: 'a GPU')
    seen = {}
    monkeypatch.setattr(bench, 'run_one', lambda args, name: seen.update(
        device=args.device, matmul=torch.backends.cuda.matmul.allow_tf32,
        cudnn=torch.backends.cudnn.allow_tf32))
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:   # (monkeypatch cannot restore these: torch's flag objects have no such attributes)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert bench.main(TINY + ['--device', 'cuda', '--one', 'vanilla']) == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was
    assert seen == dict(device='cuda', matmul=True, cudnn=True)


def test_profile_prints_the_ops_of_a_step(capsys):
    rc, out, _ = run_main(bench.main, TINY + ['--profile', 'gumbel4', '--warmup', '1'], capsys)
    assert rc == 0 and 'aten::mm' in out and 'Self CPU' in out, out[-500:]


def test_table_reads_the_runs(capsys):
    """From children's records to the printed table: speed-up and memory ratio against vanilla,
    chars/s from the median step, MFU against the peak, the share of pooling + source."""
    args = bench.parse_args(TINY + ['--configs', 'vanilla,ws4'])
    parts = {'pre': 0.02, 'shortened': 0.01, 'post': 0.02, 'pooling': 0.005,
             'boundary source': 0.005}

    def rec(ts, mem, sf, parts):
        return [dict(times=ts, peak=mem + 100, step_mem=mem, sf=sf, parts=parts)]
    results = {'vanilla': rec([0.4, 0.2, 0.3], 1000, 1.0, {}), 'ws4': rec([0.1, 0.1, 0.2], 250,
                                                                          4.0, parts)}
    table = bench.summarise(args, results)
    bench.print_table(args, table, peak=table['ws4']['flops'] / 0.1 / 0.4)   # MFU 40%
    out = capsys.readouterr().out
    cols = next(ln for ln in out.splitlines() if ln.startswith('ws4 ')).split()
    assert cols[1] == '4.00' and cols[2] == '100' and cols[3] == str(2 * 64 * 10)
    assert cols[4] == '3.00×' and cols[7] == '0.25' and cols[10] == '40%'
    share = next(ln for ln in out.splitlines() if ln.strip().startswith('ws4 ') and 'rest' in ln)
    assert 'pooling + boundary source 10.0%' in share and 'rest 40%' in share, share


@pytest.mark.plots
def test_plot_is_written_whole(tmp_path):
    plt = bench.common.import_pyplot('--plot')
    args = bench.parse_args(TINY + ['--plot', str(tmp_path / 'p.png')])
    row = dict(time=0.1, mem=2 ** 20, sf=1.0)
    bench.plot(args, {'vanilla': row, 'ws4': dict(row, sf=4.0), 'fixed2': dict(row, sf=2.0)}, plt)
    assert (tmp_path / 'p.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert os.listdir(tmp_path) == ['p.png']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_step_timed_with_events_and_peak_memory(capsys):
    """On a GPU: bf16 autocast, synchronised times, max_memory_allocated, a matmul peak."""
    args = bench.parse_args(TINY + ['--device', 'cuda', '--one', 'gumbel4', '--steps', '2'])
    assert args.amp == 'bf16' and args.warmup == 3
    bench.run_one(args, 'gumbel4')
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(rec['times']) == 2 and all(t > 0 for t in rec['times']) and rec['step_mem'] > 0
    assert bench.matmul_peak(args) > 1e12


@pytest.mark.parametrize('layers', ['1,1,1', '0,1,0'])
def test_generation_bench_runs_cached_and_full(capsys, layers):
    """Cached decode, model.generate and full recomputation for vanilla and ws5.5, a stage without
    layers included."""
    rc, out, err = run_main(bench.main, TINY + ['--generate', '--context', '16', '--new', '4',
                                                '--recompute-steps', '2', '--layers', layers],
                            capsys)
    assert rc == 0 and err == '', err
    for name in ('vanilla', 'ws5.5'):
        for method in ('cached decode', 'model.generate', 'full recomputation'):
            row = next(ln for ln in out.splitlines() if ln.split()[:1] == [name] and method in ln)
            assert float(row.split()[-2]) > 0, row


# ---------------------------------------------------------------------------------------------
# Fuzz: random flags keep the command line's contract
# ---------------------------------------------------------------------------------------------
# flag: (values that run, values that must be refused); an example takes a refused one in six
# times. Sizes are tiny or far beyond any memory (refused by the allocator at once): never in
# between, where an allocation could succeed and then take the machine's memory. No +compile.
_FLAG_VALUES = {
    '--configs': (['vanilla', 'ws2', 'fixed2', 'gumbel2', 'hnet2', 'unigram2', 'vanilla,ws2'],
                  ['', ',', 'ws0.5', 'wsnan', 'ws1e400', 'fixed2.5', 'vanila', 'ws2+fast']),
    '--d-model': (['16'], ['0', '-4', '15', 'nan', str(10 ** 12)]),
    '--seq-len': (['16', '24'], ['0', '-5', str(10 ** 12)]),
    '--batch': (['1', '2'], ['0', str(10 ** 12)]),
    '--layers': (['1,1,1', '1,2,1', '0,1,0'], ['2,8', '1,-1,1', 'a,b,c', '0,0,0', '1,1,1,1', '']),
    '--dropout': (['0', '0.1'], ['1', '-0.1', 'nan', 'inf']),
    '--attention': (['sdpa', 'blocked', 'auto'], ['fast']),
    '--warmup': (['0', '1'], ['-1', 'x']),
    '--device': (['cpu'], ['cuda:7', 'nonsense', 'meta']),
    '--clock': (['wall', 'cpu'], ['gpu']),
    '--adam': (['fused', 'foreach', 'loop'], ['sgd']),
    '--peak-n': (['8', '16'], ['0', str(10 ** 7)]),
    '--seed': (['0', '1'], ['-1', 'nan']),
    '--context': (['8'], ['0', str(10 ** 12)]),
    '--gen-batch': (['1', '2'], ['0', str(10 ** 12)]),
}
_MODES = {'table': [], 'no pieces': ['--no-pieces'], 'profile': ['--profile'],
          'generate': ['--generate']}


@settings(max_examples=12, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_fuzz_keeps_the_contract(data, capsys, monkeypatch):
    """Random flags and values in every mode: the table (with --plot), --profile, --generate.
    bench.main ends with exit 0, 1, 2 or 130, never an uncaught exception; a failure is one
    `error:` line; no temporary file is left. The children run in this process."""
    with tempfile.TemporaryDirectory() as tmp, no_hang(120), monkeypatch.context() as m:
        root = Path(tmp)
        m.setattr(bench, 'spawn', _in_process_spawn)
        _no_plotting(m)
        mode = data.draw(st.sampled_from(sorted(_MODES)), label='mode')
        argv = TINY + ['--configs', 'vanilla', '--peak-n', '8', '--rounds', '1', '--steps', '1',
                       '--warmup', '0', '--context', '8', '--new', '2', '--recompute-steps', '1']
        argv += _MODES[mode]
        if mode == 'profile':
            argv.append(data.draw(st.sampled_from(['vanilla', 'ws2', 'hnet2', 'nope']), label='c'))
        for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True,
                                       max_size=3)):
            good, bad = _FLAG_VALUES[flag]
            refused = data.draw(st.integers(0, 5), label=f'{flag} refused') == 0
            argv += [flag, data.draw(st.sampled_from(bad if refused else good), label=flag)]
        if data.draw(st.booleans(), label='--plot'):
            argv += ['--plot', str(root / data.draw(st.sampled_from(['p.png', 'no/p.png'])))]
        rc, out, err = run_main(bench.main, argv, capsys)
        event(f'{mode}: exit {rc}')
        assert_cli_contract(rc, err, argv)
        left = [f for _, _, fs in os.walk(root) for f in fs if f != 'p.png']
        assert not left, (argv, left)
