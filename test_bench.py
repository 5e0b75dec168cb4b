"""Tests of bench.py: its flags and errors, each configuration's tiny step (a registered
source's too), the FLOP formula, the child's measurement (peak memory after the warm-up), the
real child processes, the table, the generation benchmark, a fuzz test of the command line's
contract, and (with CUDA) the GPU path.

Run:   python -m pytest -q test_bench.py
"""
import contextlib
import copy
import dataclasses
import io
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import bench
import dynpool
from conftest import (HYPOTHESIS_FIXTURES, assert_cli_contract, no_hang, run_main,
                      write_dataset)

TINY = ['--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64', '--seq-len', '64',
        '--batch', '2', '--layers', '1,1,1', '--threads', '1']
ALL = ['vanilla', 'fixed2', 'ws4', 'unigram4', 'entropy', 'gumbel', 'hnet']


def _in_process_spawn(args, name):
    """bench.spawn without a process: the child's command line, parsed and run here."""
    child = bench.parse_args(args.argv + ['--one', name])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.run_one(child, name)
    return json.loads(out.getvalue().splitlines()[-1]), None


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
    (['--timeout', 'inf'], '--timeout'),
    (['--context', '1e3'], '--context'), (['--gen-batch', '-1'], '--gen-batch'),
    (['--layers', 'a,b,c'], '--layers'), (['--layers', '2,8'], 'layers'),
    (['--layers', '1,-1,1'], 'layers'), (['--configs', 'ws0.5'], 'ws0.5'),
    (['--configs', 'wsnan'], 'wsnan'), (['--configs', 'wsinf'], 'wsinf'),
    (['--configs', 'fixed2.5'], 'fixed2.5'), (['--configs', 'fixed65'], '--seq-len 64'),
    (['--configs', 'ws4+fast'], '+fast'), (['--configs', 'vanila'], 'vanila'),
    (['--configs', ','], "configuration ''"),
    (['--configs', 'entropy5.5'], 'entropy5.5'), (['--configs', 'hnet5.5'], 'hnet5.5'),
    (['--configs', 'ws'], "'ws'"), (['--configs', 'whitespace4'], 'whitespace4'),
    (['--configs', 'none'], "'none'"), (['--amp', 'fp16'], '--amp fp16'),
    (['--configs', 'ws4', '--layers', '1,0,1'], 'shortened'),
    (['--device', 'meta'], '--device'), (['--device', 'nonsense'], '--device'),
    (['--generate', '--configs', 'vanilla', '--layers', '0,0,0'], 'shortened layers'),
    (['--vocab', '0'], '--vocab'), (['--data', 'd', '--vocab', '3'], 'not allowed with')])
def test_bad_flags_are_one_line_exit_2(flags, words, capsys):
    rc, out, err = run_main(bench.main, TINY + flags, capsys)
    assert rc == 2 and out == ''
    assert err.count('\n') == 1 and err.startswith('error: ') and words in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available here')
def test_cuda_without_cuda_is_one_line(capsys):
    rc, _, err = run_main(bench.main, ['--device', 'cuda'], capsys)
    assert rc != 0 and err.count('\n') == 1 and 'CUDA' in err


def test_attention_suffix_sets_the_attention_path():
    """A +sdpa/+blocked suffix sets Config.attention; without one the model's default stays."""
    args = bench.parse_args(TINY)
    cfg, k, compiled = bench.model_config(args, 'ws4+compile+blocked')
    assert (cfg.boundary, cfg.attention, k, compiled) == ('whitespace', 'blocked', 4.0, True)
    cfg, k, compiled = bench.model_config(args, 'gumbel')
    assert (cfg.boundary, cfg.attention, k, compiled) == ('gumbel', 'auto', None, False)
    assert bench.model_config(args, 'vanilla+sdpa')[0].attention == 'sdpa'


# ---------------------------------------------------------------------------------------------
# Faults at run time: one line, exit 1 or 130, nothing written
# ---------------------------------------------------------------------------------------------
def test_failed_configurations_are_left_out_of_the_table(monkeypatch, capsys):
    """Real child processes (`python bench.py --one CONFIG`): vanilla is measured and tabled; ws4's
    child cannot allocate its batch and fixed2's outlives --timeout. One line names both and
    their causes, exit 1."""
    real = bench.spawn

    def spawn(args, name):   # the same parent, a different child for two of the configurations
        argv = args.argv + ['--batch', str(10 ** 10)] * (name == 'ws4')
        return real(SimpleNamespace(argv=argv, timeout=0.01 if name == 'fixed2' else 120), name)
    monkeypatch.setattr(bench, 'spawn', spawn)
    rc, out, err = run_main(bench.main, TINY + ['--configs', 'vanilla,ws4,fixed2', '--rounds', '1',
                                                '--steps', '1', '--peak-n', '32'], capsys)
    rows = [ln.split()[0] for ln in out.split('config')[-1].splitlines()[1:] if ln and ln[0] != ' ']
    assert rc == 1 and rows[:1] == ['vanilla'] and 'ws4' not in rows and 'fixed2' not in rows
    assert err.count('\n') == 1 and err.startswith('error: 2 of 3 configurations failed'), err
    assert 'ws4: out of memory' in err and 'fixed2: took over 0.01 s (--timeout)' in err, err


def test_ctrl_c_is_one_line_exit_130(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, 'spawn', interrupted)
    rc, _, err = run_main(bench.main, TINY + ['--configs', 'vanilla', '--peak-n', '32'], capsys)
    assert rc == 130 and err.count('\n') == 1 and 'Ctrl-C' in err
    assert os.listdir(tmp_path) == []


def test_out_of_memory_is_one_line(capsys):
    rc, _, err = run_main(bench.main, TINY + ['--configs', 'vanilla', '--peak-n', str(10 ** 7)],
                          capsys)
    assert rc == 1 and err.count('\n') == 1 and err.startswith('error: out of memory'), err


@pytest.mark.parametrize('flag', ['--gen-batch', '--context', '--new'])
def test_generation_sizes_are_priced_before_they_are_spent(capsys, monkeypatch, flag):
    """--generate's batch and lengths are refused before any tensor of their size is made: one
    line naming the flags to lower, exit 2."""
    monkeypatch.setattr(bench.torch, 'randint', None)   # nothing may be allocated
    rc, out, err = run_main(bench.main, TINY + ['--generate', flag, str(10 ** 8)], capsys)
    assert rc == 2 and out == '' and err.count('\n') == 1, err
    assert 'GiB' in err and 'lower --gen-batch, --context or --new' in err, err


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['vanilla', 'ws4', 'gumbel', 'hnet'])
def test_flop_formula_matches_counted_matmuls(name):
    """The printed formula against torch's own count of the matrix multiplies of one training step
    (forward + backward), with the attention computed in one block so that every n² term runs; one
    row, as the formula counts the mean row's segments and the model pads to the longest."""
    args = bench.parse_args(TINY + ['--dropout', '0', '--dropatt', '0', '--attn-chunk', '64',
                                    '--attention', 'blocked', '--batch', '1'])
    model, _, _, (x, y, b) = bench.prepared(args, name)
    with FlopCounterMode(display=False) as counter:
        out = model(x, targets=y, boundaries=b)
        out.loss.backward()
    sf = float(out.shortening_factor) if out.shortening_factor is not None else 1.0
    # r_net's input (the sinusoids) needs no gradient: its backward is 1×, not 2× — the only gap
    rec = dict(times=[1.0], peak=1, step_mem=1, sf=sf)
    flops = bench.summarise(args, {name: [rec]})[name]['flops']
    assert flops == pytest.approx(counter.get_total_flops(), rel=0.03)


class _Punctuation(dynpool.ExternalBoundaries):
    """A source from outside: a segment ends at token id 1 (a stand-in for punctuation)."""
    def derive(self, x, offset):
        return x == 1


@pytest.fixture
def punctuation_source(monkeypatch):
    """_Punctuation registered as 'punct', as an --import'ed file would, undone afterwards."""
    for name in ('SOURCES', 'BOUNDARY_MODES', 'PREDICTOR_MODES', 'EXTERNAL_MODES'):
        monkeypatch.setattr(dynpool, name, copy.copy(getattr(dynpool, name)))
    dynpool.register_source('punct', _Punctuation)


def test_a_registered_source_is_a_configuration(punctuation_source, capsys):
    """A source registered after bench.py was imported (--import) is a configuration by its
    name, listed in --configs' help; it takes no K; its child measures a pooled step."""
    args = bench.parse_args(TINY + ['--configs', 'vanilla,punct'])
    assert bench.model_config(args, 'punct')[0].boundary == 'punct' and 'punct' in bench.forms()
    rc, _, err = run_main(bench.main, TINY + ['--configs', 'punct4'], capsys)
    assert rc == 2 and "'punct4'" in err and 'punct,' in err, err
    bench.run_one(bench.parse_args(TINY + ['--one', 'punct', '--steps', '1']), 'punct')
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec['name'] == 'punct' and 1 < rec['sf'] < 64, rec


def test_an_imported_source_benchmarks(tmp_path, capsys, monkeypatch):
    """--import FILE: the file's source is a configuration (its step is timed in this process)."""
    for name in ('SOURCES', 'BOUNDARY_MODES', 'PREDICTOR_MODES', 'EXTERNAL_MODES'):
        monkeypatch.setattr(dynpool, name, copy.copy(getattr(dynpool, name)))
    source = tmp_path / 'punct_source.py'
    source.write_text('import dynpool\n\n\nclass Punct(dynpool.ExternalBoundaries):\n'
                      '    def derive(self, x, offset):\n        return x == 1\n\n\n'
                      "dynpool.register_source('punct', Punct)\n")
    monkeypatch.setattr(bench, 'spawn', _in_process_spawn)
    rc, out, err = run_main(bench.main, TINY + ['--import', source, '--configs', 'punct',
                                                '--rounds', '1', '--steps', '1', '--peak-n', '8'],
                            capsys)
    assert rc == 0 and any(ln.startswith('punct ') for ln in out.splitlines()), err


# A source a user keeps in a file of their own (README "Adding a boundary source") that pools
# byte-level text only
_BYTE_SOURCE = """import dynpool


class Punct(dynpool.ExternalBoundaries):
    @staticmethod
    def check_config(cfg):
        if cfg.vocab_size != 256:
            raise ValueError(f'punct needs a byte dataset (vocab 256), got {cfg.vocab_size}')

    def derive(self, x, offset):
        return x < ord('A')   # spaces, digits, punctuation


dynpool.register_source('punct', Punct)
"""


def test_an_imported_byte_source_benchmarks_on_a_byte_dataset(tmp_path, capsys, monkeypatch):
    """--data DIR: the dataset's vocabulary (a byte dataset: 256) is the model's, so a source
    that needs bytes, in a file outside the project (--import), is timed in its own child process
    and tabled with its SF; --vocab 256 builds it too; without either (text8's 27) it is refused
    in one line, exit 2."""
    for name in ('SOURCES', 'BOUNDARY_MODES', 'PREDICTOR_MODES', 'EXTERNAL_MODES'):
        monkeypatch.setattr(dynpool, name, copy.copy(getattr(dynpool, name)))
    source = tmp_path / 'plugins' / 'punct.py'
    source.parent.mkdir()
    source.write_text(_BYTE_SOURCE)
    data = write_dataset(tmp_path / 'he-bytes', 'שלום עולם, 42. ' * 50, encoding='bytes')
    argv = TINY + ['--import', str(source), '--configs', 'punct', '--rounds', '1', '--steps', '1',
                   '--warmup', '0', '--peak-n', '8']
    rc, out, err = run_main(bench.main, argv, capsys)
    assert rc == 2 and 'punct needs a byte dataset (vocab 256), got 27' in err, err
    args = bench.parse_args(argv + ['--vocab', '256'])
    assert bench.model_config(args, 'punct')[0].vocab_size == 256
    rc, out, err = run_main(bench.main, argv + ['--data', str(data)], capsys)   # a real child
    assert rc == 0 and 'vocab 256' in out, err
    row = next(ln.split() for ln in out.splitlines() if ln.startswith('punct '))
    assert 1 < float(row[1]) < 64, row


def test_the_paper_preset_is_config_s_model_and_times_every_source(punctuation_source):
    """--preset paper builds dynpool.Config()'s model (the paper's) where no size flag is given,
    and its configurations hold every registered source (one registered now too)."""
    args = bench.parse_args(['--preset', 'paper', '--device', 'cpu'])
    paper = dynpool.Config()
    for name in args.names:
        cfg = bench.model_config(args, name)[0]
        assert (cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.layers, cfg.dropout) == (
            paper.d_model, paper.n_head, paper.d_head, paper.d_inner, paper.layers, paper.dropout)
    modes = {bench.model_config(args, name)[0].boundary for name in args.names}
    assert modes == set(dynpool.BOUNDARY_MODES) and 'punct' in modes
    assert args.seq_len == 2048 and args.batch == 8


@pytest.mark.parametrize('name', ALL + ['ws4+blocked', 'ws4+sdpa'])
def test_child_measures_each_configuration(name, capsys):
    """`bench.py --one CONFIG`, for every family: the JSON line the parent reads, with one time per
    timed step, peak and step memory and the measured SF."""
    args = bench.parse_args(TINY + ['--one', name, '--steps', '2', '--warmup', '1'])
    bench.run_one(args, name)
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec['name'] == name and len(rec['times']) == 2 and all(t > 0 for t in rec['times'])
    assert rec['peak'] > 0 and rec['sf'] >= 1
    if name.startswith(('fixed', 'ws')):
        assert rec['sf'] == pytest.approx(64 / (32 if name == 'fixed2' else 16))


def test_peak_memory_counts_from_after_the_warm_up(monkeypatch, capsys):
    """The peak is reset after the warm-up steps (compilation and autotuning stay out of the rows),
    and step mem counts from before them (the gradients and Adam moments they make stay in). On
    CUDA, with torch.cuda's memory functions stood in for (no GPU is needed)."""
    calls = []
    args = bench.parse_args(TINY + ['--one', 'vanilla', '--steps', '2', '--warmup', '2'])
    args.device = 'cuda'   # after parsing: every CUDA call below is stood in for
    args.cuda = True
    out = SimpleNamespace(shortening_factor=None)
    monkeypatch.setattr(bench, 'prepared', lambda a, n: (
        None, lambda: calls.append('step'), [out], None))
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: None)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda *a: calls.append('base') or 100)
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda *a: calls.append('reset'))
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda *a: calls.append('peak') or 300)
    bench.run_one(args, 'vanilla')
    assert calls == ['base', 'step', 'step', 'reset', 'step', 'step', 'peak']
    rec = json.loads(capsys.readouterr().out)
    assert rec['peak'] == 300 and rec['step_mem'] == 200


def test_peak_resident_set_restarts_after_the_warm_up(monkeypatch, capsys):
    """On CPU the peak resident set restarts after the warm-up: 64 MiB resident in a warm-up step
    (then freed) stay out of the peak and the step memory of the timed steps."""
    if not os.access('/proc/self/clear_refs', os.W_OK):
        pytest.skip('this system cannot reset the peak resident set')
    args = bench.parse_args(TINY + ['--one', 'vanilla', '--steps', '2', '--warmup', '1'])
    steps = []

    def step():   # the warm-up step holds 64 MiB for a moment, the timed ones nothing
        steps.append(torch.ones(64 * 2 ** 20 // 4).add_(1).sum() if not steps else 0)
    monkeypatch.setattr(bench, 'prepared', lambda a, n: (
        None, step, [SimpleNamespace(shortening_factor=None)], None))
    bench.run_one(args, 'vanilla')
    rec = json.loads(capsys.readouterr().out)
    assert len(steps) == 3 and rec['step_mem'] < 32 * 2 ** 20, rec


def test_cuda_runs_with_tf32_matmuls_as_train_py(monkeypatch):
    """On a GPU every process of bench.py (the children too) sets TF32 matmuls before it measures,
    as train.py trains; torch.cuda stood in for, so that no GPU is needed."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: None)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d: 'a GPU')
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda **kw: True)
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


@pytest.mark.parametrize('amp, dtype', [('off', torch.float32), ('bf16', torch.bfloat16)])
def test_matmul_peak_runs_in_the_training_precision(amp, dtype, monkeypatch):
    """The peak's matmul is in the dtype that --amp trains in (runtime.setup_precision's)."""
    args = bench.parse_args(TINY + ['--amp', amp, '--peak-n', '8'])
    seen = set()
    mm = torch.mm
    monkeypatch.setattr(torch, 'mm', lambda a, b: (seen.add(a.dtype), mm(a, b))[1])
    assert bench.matmul_peak(args) > 0 and seen == {dtype}


def test_table_reads_the_runs(capsys):
    """From children's records to the printed table: speed-up and memory ratio against vanilla,
    chars/s from the median step, MFU against the peak."""
    args = bench.parse_args(TINY + ['--configs', 'vanilla,ws4'])

    def rec(ts, mem, sf):
        return [dict(times=ts, peak=mem + 100, step_mem=mem, sf=sf)]
    results = {'vanilla': rec([0.4, 0.2, 0.3], 1000, 1.0), 'ws4': rec([0.1, 0.1, 0.2], 250, 4.0)}
    table = bench.summarise(args, results)
    bench.print_table(args, table, peak=table['ws4']['flops'] / 0.1 / 0.4)   # MFU 40%
    out = capsys.readouterr().out
    cols = next(ln for ln in out.splitlines() if ln.startswith('ws4 ')).split()
    assert cols[1] == '4.00' and cols[2] == '100' and cols[3] == str(2 * 64 * 10)
    assert cols[4] == '3.00×' and cols[7] == '0.25' and cols[10] == '40%'


def test_paper_preset_records_its_flops_per_second(tmp_path, monkeypatch, capsys):
    """--preset paper (sizes overridden to run on CPU) merges into out/bench-paper.json, under this
    device's name, the median model FLOP/s of its table and what a study prices a run with: per
    configuration its table row (boundary mode, SF, step seconds, chars/s, FLOPs, FLOP/s,
    memory), the device, date, torch's version, precision, batch, L, vocabulary and model shape;
    other devices' entries are kept; other presets and --generate write nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, 'spawn', _in_process_spawn)
    argv = TINY + ['--configs', 'vanilla,ws4', '--rounds', '1', '--steps', '1', '--warmup', '0',
                   '--peak-n', '8']
    assert run_main(bench.main, argv, capsys)[0] == 0
    assert not (tmp_path / 'out').exists()
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'bench-paper.json').write_text('{"a GPU": {"flops_per_s": 1e15}}')
    tables = []
    printed = bench.print_table
    monkeypatch.setattr(bench, 'print_table', lambda args, table, peak: (
        tables.append(table), printed(args, table, peak)))
    rc, out, err = run_main(bench.main, argv + ['--preset', 'paper', '--device', 'cpu'], capsys)
    assert rc == 0, err
    entries = json.loads((tmp_path / 'out' / 'bench-paper.json').read_text())
    where = f'CPU, {torch.get_num_threads()} threads'
    mine = entries[where]
    assert mine['configs'] == tables[0] and list(mine['configs']) == ['vanilla', 'ws4']
    rates = [row['flops'] / row['step_s'] for row in tables[0].values()]
    assert mine['flops_per_s'] == pytest.approx(sum(rates) / 2)
    ws4 = mine['configs']['ws4']
    assert ws4['boundary'] == 'whitespace' and ws4['sf'] == pytest.approx(4, rel=0.05)
    assert ws4['chars_per_s'] == pytest.approx(2 * 64 / ws4['step_s'])
    assert ws4['flops_per_s'] == pytest.approx(ws4['flops'] / ws4['step_s'])
    assert mine['torch'] == torch.__version__ and len(mine['date']) == 10
    assert (mine['device'], mine['amp'], mine['batch'], mine['seq_len'], mine['vocab']) == (
        where, 'off', 2, 64, 27)
    assert mine['model'] == json.loads(json.dumps(dataclasses.asdict(bench.model_config(
        bench.parse_args(argv), 'vanilla')[0])))
    assert (mine['model']['d_model'], mine['model']['layers']) == (32, [1, 1, 1])
    assert entries['a GPU'] == {'flops_per_s': 1e15}
    assert os.listdir(tmp_path / 'out') == ['bench-paper.json']


def test_paper_file_that_is_not_json_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, 'spawn', _in_process_spawn)
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'bench-paper.json').write_text('[1, 2')
    rc, out, err = run_main(bench.main, TINY + ['--preset', 'paper', '--configs', 'vanilla',
                                                '--rounds', '1', '--steps', '1', '--peak-n', '8'],
                            capsys)
    assert rc == 1 and err.count('\n') == 1 and 'bench-paper.json is not' in err, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_step_timed_with_events_and_peak_memory(capsys):
    """On a GPU: bf16 autocast, synchronised times, max_memory_allocated, a matmul peak."""
    args = bench.parse_args(TINY + ['--device', 'cuda', '--one', 'gumbel', '--steps', '2'])
    assert args.amp == 'bf16' and args.warmup == 3
    bench.run_one(args, 'gumbel')
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(rec['times']) == 2 and all(t > 0 for t in rec['times']) and rec['step_mem'] > 0
    assert bench.matmul_peak(args) > 1e12


def test_generation_bench_runs_cached_and_full(capsys):
    """model.generate (cached) and full recomputation for vanilla and ws5.5, stages without layers
    included."""
    rc, out, err = run_main(bench.main, TINY + ['--generate', '--context', '16', '--new', '4',
                                                '--recompute-steps', '2', '--layers', '0,1,0'],
                            capsys)
    assert rc == 0 and err == '', err
    for name in ('vanilla', 'ws5.5'):
        for method in ('model.generate', 'full recomputation'):
            row = next(ln for ln in out.splitlines() if ln.split()[:1] == [name] and method in ln)
            assert float(row.split()[-2]) > 0, row


# ---------------------------------------------------------------------------------------------
# Fuzz: random flags keep the command line's contract
# ---------------------------------------------------------------------------------------------
# flag: (values that run, values that must be refused); an example takes a refused one in six
# times. Sizes are tiny or far beyond any memory (refused by the allocator at once): never in
# between, where an allocation could succeed and then take the machine's memory. No +compile.
_FLAG_VALUES = {
    '--configs': (['vanilla', 'ws2', 'fixed2', 'gumbel', 'hnet', 'unigram2', 'vanilla,ws2'],
                  ['', ',', 'ws0.5', 'wsnan', 'ws1e400', 'fixed2.5', 'vanila', 'ws2+fast',
                   'hnet2']),
    '--d-model': (['16'], ['0', '-4', '15', 'nan', str(10 ** 12)]),
    '--seq-len': (['16', '24'], ['0', '-5', str(10 ** 12)]),
    '--batch': (['1', '2'], ['0', str(10 ** 12)]),
    '--layers': (['1,1,1', '1,2,1', '0,1,0'], ['2,8', '1,-1,1', 'a,b,c', '0,0,0', '1,1,1,1', '']),
    '--dropout': (['0', '0.1'], ['1', '-0.1', 'nan', 'inf']),
    '--attention': (['sdpa', 'blocked', 'auto'], ['fast']),
    '--warmup': (['0', '1'], ['-1', 'x']),
    '--device': (['cpu'], ['cuda:7', 'nonsense', 'meta']),
    '--peak-n': (['8', '16'], ['0', str(10 ** 7)]),
    '--seed': (['0', '1'], ['-1', 'nan']),
    '--context': (['8'], ['0', str(10 ** 12)]),
    '--gen-batch': (['1', '2'], ['0', str(10 ** 12)]),
}
_MODES = {'table': [], 'no pieces': ['--no-pieces'], 'generate': ['--generate']}


@settings(max_examples=12, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_fuzz_keeps_the_contract(data, capsys, monkeypatch):
    """Random flags and values in every mode: the table, --no-pieces, --generate.
    bench.main ends with exit 0, 1, 2 or 130, never an uncaught exception; a failure is one
    `error:` line; no temporary file is left. The children run in this process."""
    with tempfile.TemporaryDirectory() as tmp, no_hang(120), monkeypatch.context() as m:
        root = Path(tmp)
        m.setattr(bench, 'spawn', _in_process_spawn)
        mode = data.draw(st.sampled_from(sorted(_MODES)), label='mode')
        argv = TINY + ['--configs', 'vanilla', '--peak-n', '8', '--rounds', '1', '--steps', '1',
                       '--warmup', '0', '--context', '8', '--new', '2', '--recompute-steps', '1']
        argv += _MODES[mode]
        for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True,
                                       max_size=3)):
            good, bad = _FLAG_VALUES[flag]
            refused = data.draw(st.integers(0, 5), label=f'{flag} refused') == 0
            argv += [flag, data.draw(st.sampled_from(bad if refused else good), label=flag)]
        rc, out, err = run_main(bench.main, argv, capsys)
        event(f'{mode}: exit {rc}')
        assert_cli_contract(rc, err, argv)
        left = [f for _, _, fs in os.walk(root) for f in fs]
        assert not left, (argv, left)
