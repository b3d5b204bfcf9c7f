"""Every script's entry point on bad input, in-process: exit code 2, exactly one stderr line
`error: ...` naming the bad key, and no file created or changed. Plus --help everywhere."""
import hashlib
import json
import os
import re
import runpy
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import configurator
import prepare_data
import sample
import server
import train
from lab import bench, bench_kernels, export_ouro, reproduce
from lab import eval as eval_py

TINY = ["--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=16", "--ffn_hidden=24", "--block_size=16",
        "--batch_size=4", "--eval_iters=1", "--max_iters=2", "--eval_interval=2", "--warmup_iters=1"]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A working folder with a dataset, a trained checkpoint (out/), one trained with Ouro's per-loop
    norm (ouro_ckpt/), an exported Ouro folder, a text file, an empty file and a plain file."""
    root = tmp_path_factory.mktemp("sandbox")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        prepare_data.prepare(dict(prepare_data.DEFAULTS, size=20000))
        train.main(TINY)
        train.main(TINY + ["--out_dir=ouro_ckpt", "--loop_norm"])
        export_ouro.main(["--ckpt=ouro_ckpt", "--out=exported"])
    finally:
        os.chdir(cwd)
    (root / "book.txt").write_text("to be or not to be\n" * 50)
    (root / "bad_syntax.py").write_text("batch_size = (\n")
    (root / "undefined_name.py").write_text("batch_size = some_name * 2\n")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    trunc = root / "data" / "trunc"
    trunc.mkdir(parents=True)
    (trunc / "train.bin").write_bytes(b"\x01" * 4001)        # an odd number of bytes: not uint16 ids
    (trunc / "val.bin").write_bytes(b"\x01" * 4000)
    (trunc / "meta.json").write_text('{"tokenizer": "char", "vocab_size": 44, "chars": "abc"}')
    wrong = root / "data" / "wrong_ids"                      # ids past the vocabulary its meta.json gives
    wrong.mkdir(parents=True)
    for split in ("train", "val"):
        (wrong / f"{split}.bin").write_bytes(bytes([1, 0] * 3000 + [0x60, 0xea]))
    (wrong / "meta.json").write_text((root / "data" / "synthetic" / "meta.json").read_text())
    (root / "empty.txt").write_text("")
    (root / "notes.txt").write_text("hello, not a checkpoint\n")
    malformed_files(root)
    return root


def malformed_files(root):
    """Files that are wrong in the ways a user's files are: a task file not in UTF-8 and one with a
    misspelled field; a dataset whose meta.json has fewer characters than its vocabulary and one whose
    val_labels.bin is cut short; an Ouro folder whose tensors are integers."""
    import shutil
    from safetensors.torch import load_file, save_file
    (root / "latin1.jsonl").write_bytes('{"type": "gen", "prompt": "café", "answer": "x"}\n'.encode("latin-1"))
    (root / "typo.jsonl").write_text('{"type": "gen", "prompt": "a", "answer": "b", "max_token": 3}\n')
    synthetic = root / "data" / "synthetic"
    for name in ("badmeta", "shortlabels"):
        shutil.copytree(synthetic, root / "data" / name)
    meta = json.loads((synthetic / "meta.json").read_text())
    (root / "data" / "badmeta" / "meta.json").write_text(json.dumps(dict(meta, chars=meta["chars"][:-3])))
    labels = root / "data" / "shortlabels" / "val_labels.bin"
    labels.write_bytes(labels.read_bytes()[:-100])
    shutil.copytree(root / "exported", root / "ckpt-int")
    weights = root / "ckpt-int" / "model.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(str(weights)).items()}, str(weights))


def snapshot(root):
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            p = os.path.join(folder, f)
            with open(p, "rb") as fh:
                out[p] = (os.stat(p).st_mtime_ns, hashlib.sha256(fh.read()).hexdigest())
    return out


CASES = [
    # (script, args, the key the message must name)
    (train, ["--batch_size=0"], "batch_size"), (train, ["--batch_size=-1"], "batch_size"),
    (train, ["--max_iters=0"], "max_iters"), (train, ["--eval_interval=0"], "eval_interval"),
    (train, ["--log_interval=0"], "log_interval"),
    (train, ["--gradient_accumulation_steps=0"], "gradient_accumulation_steps"),
    (train, ["--n_head=0"], "n_head"), (train, ["--block_size=0"], "block_size"),
    (train, ["--out_dir=notes.txt"], "out_dir"), (train, ["--prior=zipf"], "prior"),
    (train, ["--max_iters=ten"], "max_iters"), (train, ["--unknown"], "unknown"), (train, ["--beta=-1"], "beta"),
    (train, ["--dataset=missing"], "dataset"), (train, ["--init_from=resume", "--out_dir=fresh"], "init_from"),
    (train, ["--n_embd=130"], "n_embd"), (train, ["--n_kv_head=3"], "n_kv_head"),
    (train, ["--eval_thr=0.5,2"], "eval_thr"), (train, ["--device=cuda"], "device"),
    (train, ["--device=tpu"], "device"),
    (train, ["--prior=geometric", "--prior_lambda=1.5"], "prior_lambda"),
    (train, ["--learning_rate=0"], "learning_rate"),
    (train, ["--block_size=5000"], "block_size"), (train, ["--kl_scope=global"], "kl_scope"),
    (train, ["--stop_iter=0"], "stop_iter"), (train, ["--beta1=1"], "beta1"),
    (prepare_data, ["--size=0"], "size"), (prepare_data, ["--size=-5"], "size"),
    (prepare_data, ["--dataset=text", "--input=empty.txt"], "input"),
    (prepare_data, ["--val_fraction=1.5"], "val_fraction"),
    (prepare_data, ["--dataset=imagenet"], "dataset"), (prepare_data, ["--dataset=text"], "input"),
    (prepare_data, ["--dataset=text", "--input=missing.txt"], "input"),
    (prepare_data, ["--tokenizer=bpe"], "tokenizer"),
    (prepare_data, ["--name=../x"], "name"), (prepare_data, ["--data_dir=notes.txt"], "data_dir"),
    (bench, ["--thr=abc"], "thr"), (bench, ["--repeats=0"], "repeats"), (bench, ["--new_tokens=0"], "new_tokens"),
    (bench, ["--what=train", "--steps=0"], "steps"), (bench, ["--thr=1.5"], "thr"), (bench, ["--what=serve"], "what"),
    (export_ouro, ["--ckpt=ouro_ckpt", "--out=notes.txt"], "out"),
    (export_ouro, ["--ckpt=ouro_ckpt", "--out=exported"], "out"),
    (export_ouro, ["--ckpt=ouro_ckpt"], "out"), (export_ouro, ["--ckpt=ouro_ckpt", "--out=x", "--dtype=int8"], "dtype"),
    (export_ouro, ["--ckpt=nowhere", "--out=new_folder"], "ckpt"),
    (export_ouro, ["--ckpt=out", "--out=new_folder"], "loop_norm"),
    (sample, ["--ckpt=notes.txt"], "ckpt"), (sample, ["--ckpt=nowhere"], "ckpt"), (sample, ["--device=cuda"], "device"),
    (sample, ["--chat"], "chat"), (sample, ["--thr", "1.5"], "thr"), (sample, ["--thr=abc"], "thr"),
    (sample, ["--mode=warp"], "mode"), (sample, ["--depth=9"], "depth"), (sample, ["--top_p=0"], "top_p"),
    (sample, ["--prompt_ids=1,x"], "prompt_ids"), (sample, ["--prompt=" + "a" * 40], "prompt"),
    (sample, ["--prompt=ABC"], "prompt"), (sample, ["--kv_pages=-1"], "kv_pages"),
    (sample, ["--mode=ouro", "--thr=0.5", "--kv_pages=3", "--max_new_tokens=5"], "kv_pages"),
    (sample, ["--mode=ete_ragged", "--thr=0.5", "--prefill_schedule=linear"], "prefill_schedule"),
    (sample, ["--thr=0.5", "--prefix_full=2"], "prefix_full"), (sample, ["--mode=fixed", "--thr=0.3"], "thr"),
    (sample, ["--dtype=int8"], "dtype"), (sample, ["--max_new_tokens=0"], "max_new_tokens"),
    (sample, ["--prompt_ids=999"], "prompt_ids"),
    (server, ["--port=70000"], "port"), (server, ["--scheduler=fifo"], "scheduler"),
    (server, ["--attn=cuda_magic"], "attn"), (server, ["--max_batch=0"], "max_batch"),
    (server, ["--kv_pages=-1"], "kv_pages"), (bench, ["--what=engine", "--engine_thr=2"], "engine_thr"),
    (bench, ["--what=engine", "--full", "--quick"], "quick"), (bench, ["--what=engine", "--batches=a,b"], "batches"),
    (bench, ["--what=engine", "--batches=8", "--requests=4"], "requests"),
    (server, ["--ckpt=nowhere"], "ckpt"),
    (server, ["--ckpt=out", "--kv_pages=2"], "kv_pages"), (server, ["--device=cuda"], "device"),
    (reproduce, [], "quick"), (reproduce, ["--quick", "--full"], "full"),
    (reproduce, ["--quick", "--seeds=0"], "seeds"),
    (reproduce, ["--quick", "--input=missing.txt"], "input"),
    (reproduce, ["--quick", "--report", "--out=no_runs"], "report"), (reproduce, ["--quick", "--only=nope"], "only"),
    # numbers: finite, 64-bit, and bounded where a huge value would hang or crash
    (train, ["--seed=4294967296"], "seed"), (sample, ["--seed=99999999999"], "seed"),
    (train, ["--learning_rate=1e999"], "learning_rate"), (train, ["--prior_lambda=1e999"], "prior_lambda"),
    (train, ["--beta=1e999"], "beta"), (train, ["--max_iters=99999999999999999999999"], "max_iters"),
    (sample, ["--temperature=1e999"], "temperature"), (sample, ["--temperature=3"], "temperature"),
    (sample, ["--kv_pages=1000000000000", "--max_new_tokens=5"], "kv_pages"),
    (sample, ["--num_samples=100000000", "--max_new_tokens=5"], "num_samples"),
    (prepare_data, ["--size=99999999999999"], "size"), (bench, ["--threads=100000"], "threads"),
    (eval_py, ["--builtin=synthetic", "--builtin_items=99999999999"], "builtin_items"),
    # files: unreadable, undecodable, truncated, unwritable
    (train, ["bad_syntax.py"], "bad_syntax"), (train, ["undefined_name.py"], "undefined_name"),
    (sample, ["--prompt=FILE:latin1.txt", "--max_new_tokens=5"], "prompt"), (train, ["--dataset=trunc"], "dataset"),
    (train, ["--out_dir=/sys/looped-lm-out"], "out_dir"), (export_ouro, ["--ckpt=ouro_ckpt", "--out=/sys/x"], "out"),
    (eval_py, ["--builtin=synthetic", "--out=/sys/x"], "out"), (reproduce, ["--quick", "--out=/sys/x"], "out"),
    (prepare_data, ["--data_dir=/sys/x"], "data_dir"), (reproduce, ["--quick", "--out=notes.txt"], "out"),
    # a resumed run or a branch keeps its shape: a flag at another value is refused (at the default: as if left out)
    (train, ["--init_from=resume", "--n_embd=64"], "n_embd"),
    (train, ["--init_from=resume", "--batch_size=8"], "batch_size"),
    (train, ["--branch_from=out", "--out_dir=branch", "--n_layer=3"], "n_layer"),
    # one model per folder; names that say what is wrong
    (export_ouro, ["--ckpt=ouro_ckpt", "--out=out"], "out"), (train, ["--out_dir=exported"], "out_dir"),
    (sample, ["--prompt=FILE:data", "--max_new_tokens=5"], "prompt"), (sample, ["--runner=gpu"], "runner"),
    (train, ["--eval_thr=0.5,0.3,0.5"], "eval_thr"), (train, ["--dataset=wrong_ids"], "dataset"),
    (server, ["--ckpt=out", "--host=no-such-host.invalid", "--port=0"], "host"),
    # lab/eval.py, lab/bench_kernels.py
    (eval_py, ["--ckpt=nowhere", "--builtin=synthetic"], "ckpt"),
    (eval_py, ["--builtin=synthetic", "--modes=warp@0.5"], "modes"),
    (eval_py, ["--builtin=synthetic", "--modes=fixed@9"], "modes"), (eval_py, ["--builtin=synthetic", "--k=4"], "k"),
    (eval_py, ["--task=missing.jsonl"], "task"), (eval_py, [], "task"),
    (eval_py, ["--convert=gsm8k", "--out=tasks"], "convert"),
    (eval_py, ["--lm_eval=no_such_task"], "lm_eval"),
    (eval_py, ["--builtin=synthetic", "--temperature=1e999"], "temperature"),
    (bench_kernels, ["--batches=a,b"], "batches"), (bench_kernels, ["--iters=0"], "iters"),
    (bench_kernels, ["--seed=-1"], "seed"),
    # malformed files: one line at the first command that reads them
    (eval_py, ["--task=latin1.jsonl"], "task"), (eval_py, ["--task=typo.jsonl"], "max_token"),
    (train, ["--dataset=badmeta"], "dataset"), (train, ["--dataset=shortlabels"], "dataset"),
    (sample, ["--ckpt=ckpt-int"], "ckpt"),
    # a resume is the run it resumes; --eval_only evaluates a checkpoint or refuses
    (train, ["--init_from=resume", "--prior=geometric"], "prior"),
    (train, ["--init_from=resume", "--max_iters=1"], "max_iters"),
    (train, ["--eval_only", "--out_dir=fresh"], "eval_only"),
    # a flag that would do nothing
    (train, ["--ra_method=reinforce"], "ra_method"), (train, ["--cf_thr=0.3"], "cf_thr"),
    (train, ["--reinforce_k=4"], "reinforce_k"), (sample, ["--mode=ete_ragged", "--depth=2"], "depth"),
    (sample, ["--temperature=0", "--top_p=0.9"], "top_p"), (eval_py, ["--thresholds=0.3"], "thresholds"),
    (server, ["--kv_pages=100", "--kv_memory=1.0"], "kv_memory"), (bench, ["--gpu_shape=tiny"], "gpu_shape"),
    (sample, ["--runner=slots", "--head=shared", "--max_new_tokens=5"], "head"),
    # lists read strictly: an empty item, a stray comma or a non-number is named by its position
    (sample, ["--prompt_ids=1,,2"], "prompt_ids"), (sample, ["--prompt_ids=1,2,"], "prompt_ids"),
    (train, ["--eval_thr=0.5,"], "eval_thr"), (eval_py, ["--builtin=synthetic", "--k=1,x"], "k"),
    (eval_py, ["--builtin=synthetic", "--modes=fixed@1,,fixed@2"], "modes"),
    (bench, ["--what=engine", "--batches=1,,4"], "batches"), (bench_kernels, ["--contexts=64,"], "contexts"),
    # speculative decoding: k >= 1, a draft depth below U, its flags only in its mode
    (sample, ["--mode=speculative", "--draft_k=0"], "draft_k"),
    (sample, ["--mode=speculative", "--draft_depth=4", "--max_new_tokens=5"], "draft_depth"),
    (sample, ["--draft_k=3"], "draft_k"), (sample, ["--mode=speculative", "--thr=1.5"], "thr"),
    (eval_py, ["--builtin=synthetic", "--modes=speculative@4"], "modes"),
    (eval_py, ["--builtin=synthetic", "--modes=speculative@0"], "modes"),
    (bench, ["--what=speculative", "--draft_ks=0"], "draft_ks"),
]


@pytest.mark.parametrize("script,args,key", CASES, ids=[f"{m.__name__}:{' '.join(a)[:40]}" for m, a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(sandbox, monkeypatch, capsys, script, args, key):
    monkeypatch.chdir(sandbox)
    before = snapshot(sandbox)
    if script is sample:
        args = (["--ckpt=out"] if not any(a.startswith("--ckpt") for a in args) else []) + args
    with pytest.raises(SystemExit) as e:
        configurator.run_cli(script.main, args)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"--{key}" in lines[0] or re.search(rf"\b{key}\b", lines[0]), lines[0]
    assert snapshot(sandbox) == before, "a file was created or changed"


def test_every_script_has_cases():
    assert len(CASES) >= 100 and {m for m, _, _ in CASES} == {train, prepare_data, bench, bench_kernels, export_ouro,
                                                               sample, server, reproduce, eval_py}


@pytest.mark.parametrize("script", [train, sample, bench, bench_kernels, prepare_data, export_ouro, server, reproduce,
                                    eval_py])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_and_lists_every_key(script, flag, capsys):
    with pytest.raises(SystemExit) as e:
        configurator.run_cli(script.main, [flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key, default in script.DEFAULTS.items():
        assert f"--{key}={default!r}" in out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(f for f in os.listdir(ROOT) if f.endswith(".py") and not f.startswith("test_")) + sorted(
    "lab/" + f for f in os.listdir(os.path.join(ROOT, "lab")) if f.endswith(".py") and f != "__init__.py")


@pytest.mark.parametrize("name", FILES)
def test_every_file_run_as_a_script_answers_help_and_refuses_the_rest(name, monkeypatch, capsys):
    """Every file at the root, run as a script, and every lab script, run as a module from the root
    (python -m lab.X): --help says what it is (a library module: its concern and the command that
    uses it) and exits 0; an unknown flag is one `error:` line and exit 2. A lab script run by its path
    says in one line how to run it."""
    path = os.path.join(ROOT, name)
    lab = name.startswith("lab/")
    command = [sys.executable, "-m", "lab." + name[4:-3]] if lab else [sys.executable, path]
    with open(path) as f:   # a file that registers a torch operator runs in its own process: registering
        own_process = "torch.library" in f.read()   # it again here would free the one the tests call
    for argv, code in ((["--help"], 0), (["--bogus_flag"], 2)):
        if own_process:
            done = subprocess.run(command + argv, capture_output=True, text=True, cwd=ROOT)
            out, err, exit_code = done.stdout, done.stderr, done.returncode
        else:
            monkeypatch.setattr("sys.argv", [path] + argv)
            with pytest.raises(SystemExit) as e:
                if lab:    # the tests imported it already: runpy's warning of that says nothing here
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        runpy.run_module("lab." + name[4:-3], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(path, run_name="__main__")
            (out, err), exit_code = capsys.readouterr(), e.value.code
        assert exit_code == code, (name, argv, out, err)
        if code == 0:
            assert out.strip() and ((f"python -m lab.{name[4:-3]}" if lab else name) in out or "usage:" in out)
            assert not re.search(r"\((App|Eq|Fig)\)", out), out          # "(App. A.2)" cut short at its stop
        else:
            assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
    if lab:
        done = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"error: a lab script runs from the project root as a module: python -m lab.{name[4:-3]} ..."]


NEEDS_OF = {"train": train, "eval": eval_py, "server": server, "bench": bench, "sample": sample,
            "prepare_data": prepare_data}
UNSET = dict(prior_lambda=0.5, depth=2, prefill_thr=0.4, input="book.txt", tiktoken_file="x.tiktoken")   # for None/""


def flags_of(what):
    """The flags a NEEDS entry asks for, as written in it: '--a=1 --b (why)' or '--x=1 or --x=2' (the first)."""
    return [f for f in what.split(" or ")[0].split(" (")[0].split() if f.startswith("--")]


@pytest.mark.parametrize("name", sorted(NEEDS_OF))
def test_every_flag_that_needs_another_is_refused_without_it_and_accepted_with_it(name):
    """Each script's NEEDS table, walked: every key set alone to a value other than its default is one
    error naming it and what it needs; with what it needs, it is accepted. (At its default it is as if
    left out: test_every_key_at_its_default_is_the_same_run_as_leaving_it_out.)"""
    script = NEEDS_OF[name]
    assert script.NEEDS and set(script.NEEDS) <= set(script.DEFAULTS)

    def parse(argv):
        given = set()
        c = configurator.parse(argv, script.DEFAULTS, script.RULES, given=given,
                               needs=None if name == "sample" else script.NEEDS)
        if name == "sample":                          # its mode is resolved first, then NEEDS checked
            sample.check_args(c, 4, given)
    for key in script.NEEDS:
        flag = f"--{key}={other_value(script, key)}"
        with pytest.raises(configurator.UserError, match=f"--{key}=.* does nothing without"):
            parse(unmet(name, key) + [flag])
        parse(flags_of(script.NEEDS[key][0]) + [flag])


def other_value(script, key):
    """A value of a key that its rule allows, other than its default."""
    default, rule = script.DEFAULTS[key], script.RULES.get(key)
    if key in UNSET or default is None:
        return UNSET.get(key)
    if isinstance(rule, list):
        return next(v for v in rule if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):
        candidates = (default.split(",")[0], "cpu", default + "x", "1")
    elif isinstance(default, int):
        candidates = (default + 1, default - 1)
    else:
        candidates = (default / 2 or 0.5, default + 1)
    for value in candidates:
        if value == default:
            continue
        try:
            if rule is not None:
                configurator.check(key, value, rule)
            return value
        except configurator.UserError:
            pass


SCRIPTS = {"train": train, "sample": sample, "server": server, "prepare_data": prepare_data, "eval": eval_py,
           "bench": bench, "bench_kernels": bench_kernels, "reproduce": reproduce, "export_ouro": export_ouro}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_key_at_its_default_is_the_same_run_as_leaving_it_out(name):
    """Every key of every script given at the default --help shows: the same settings, nothing counted as
    given (so no script reads that it was written: no NEEDS refusal, sample.py's mode and train.py's
    resume and --eval_only as without it); and each key at another value is counted as given."""
    script = SCRIPTS[name]
    base = ["--out=folder"] if name == "export_ouro" else []             # its one required key
    settings = lambda argv, given: configurator.parse(base + argv, script.DEFAULTS, getattr(script, "RULES", None),
                                                      given=given, needs=getattr(script, "NEEDS", None))
    plain_given = set()
    plain = settings([], plain_given)
    for key, default in script.DEFAULTS.items():
        if base and key == "out":
            continue                       # required: refused at its empty default, as when left out
        given = set()
        c = settings([f"--{key}={default}"], given)
        assert c == plain and given == plain_given, (name, key)
        if name == "sample":
            assert sample.check_args(c, 4, given) == sample.check_args(dict(script.DEFAULTS), 4, set())
        if name == "train":
            train.check_config(SimpleNamespace(**c), given)
        value = other_value(script, key)
        if value is not None and value != default and not base:
            given = set()
            configurator.parse([f"--{key}={value}"], script.DEFAULTS, given=given)
            assert given == {key}, (name, key, value)
    out = sample.check_args(dict(sample.DEFAULTS), 4, set())
    assert out[:2] == ("dense_ragged", 0.5)                # --help's --mode and --thr are what runs


def unmet(name, key):
    """Flags under which a NEEDS key's condition fails where the defaults would meet it."""
    if name == "bench":
        return ["--what=" + next(w for w in ("decode", "engine", "train", "gpu") if w not in bench.FOR_WHAT[key])]
    return {"warmup_iters": ["--decay_lr=False"], "lr_decay_start": ["--decay_lr=False"],
            "lr_decay_iters": ["--decay_lr=False"], "min_lr": ["--decay_lr=False"], "depth": ["--mode=ete_ragged"],
            "thr": ["--mode=fixed"], "top_p": ["--temperature=0"], "top_k": ["--temperature=0"],
            "kv_memory": ["--kv_pages=10"], "input": ["--dataset=synthetic"], "tiktoken_file": ["--dataset=text"],
            "seed": ["--dataset=text"], "size": ["--dataset=text"], "max_k": ["--dataset=text"],
            "filler": ["--dataset=hops"], "overwrite": ["--init_from=resume"]}.get(key, [])


def test_torchrun_bad_flag_is_one_line_and_torchrun_names_it(tmp_path):
    """Under torchrun every rank fails alike: the line is printed once (rank 0), and torchrun's own
    failure report that follows names it as each rank's cause instead of "<N/A>"."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "train.py"), "--n_layer=abc"], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = "error: --n_layer='abc': expected int (default 2)"
    assert r.returncode != 0 and r.stderr.splitlines().count(line) == 1, r.stderr[-2000:]
    assert r.stderr.count(f"traceback : {line}") == 2 and "<N/A>" not in r.stderr, r.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_sample_says_when_the_context_cuts_max_new_tokens(sandbox, monkeypatch, capsys):
    """A prompt near the context length: sample.py makes what fits and says so on stderr."""
    monkeypatch.chdir(sandbox)
    samples = sample.main(["--ckpt=out", "--prompt=the cat sat", "--max_new_tokens=100", "--thr=0.5"])
    err = capsys.readouterr().err
    room = 16 - len("the cat sat")
    assert f"max_new_tokens=100 cut to {room} to fit the context length 16" in err, err
    assert len(samples[0]["text"]) == room


def test_the_slot_engine_runs_on_each_scripts_own_defaults(sandbox, monkeypatch, capsys):
    """--runner=slots with nothing else set (the LM head: the engine's own): sample.py and lab/eval.py run,
    and give the eager engine's greedy tokens."""
    monkeypatch.chdir(sandbox)
    out = {}
    for engine in ("slots", "eager"):
        records = sample.main(["--runner=" + engine, "--max_new_tokens=6", "--temperature=0", "--thr=0.5"])
        out[engine] = [r["tokens"] for r in records]
        with open("short.jsonl", "w") as f:
            f.write('{"type": "gen", "prompt": "a=3 b=a", "answer": "3", "extract": "prefix", "max_tokens": 3}\n')
        runs = eval_py.main(["--runner=" + engine, "--task=short.jsonl", "--temperature=0", "--plots=False",
                             f"--out=eval-{engine}"])
        out[engine].append([r["avg_depth"] for r in runs])
    assert out["slots"] == out["eager"]
    capsys.readouterr()


class Parsed(Exception):
    """Raised where a script has parsed its command line: the command is valid as written."""


def documented_commands():
    """Every command the README and docs/ give: lines of code blocks, and inline `...` code, that
    start with python or torchrun; a trailing comment and optional parts in [brackets] dropped."""
    out = []
    for name in ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs"))):
        text = open(os.path.join(ROOT, name), encoding="utf-8").read()
        blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
        lines = [line for b in blocks for line in b.splitlines()]
        lines += re.findall(r"(?<!`)`((?:python|torchrun) [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for line in lines:
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"\s*\[[^\]]*\]", "", line)
            if re.match(r"(python|torchrun) ", line) and " -m pytest" not in line:
                out.append((name, line))
    return out


def test_every_command_in_the_readme_and_docs_runs_as_written(monkeypatch):
    """Each command of README.md and docs/ names a script or a lab module that exists and gives it
    flags it takes, with values in their ranges: run up to the point where its command line is
    parsed (configurator.parse), nothing after. A library module's command ("python X.py ...")
    must be one (it answers with the command that uses it)."""
    import importlib
    import shlex
    commands = documented_commands()
    assert len(commands) > 40
    for doc, line in commands:
        words = shlex.split(line.replace("$OURO", "ouro-folder"))
        if words[0] == "torchrun":
            words = ["python"] + [w for w in words[1:] if not w.startswith("--nproc") and w != "--standalone"]
        module, args = (words[2], words[3:]) if words[1] == "-m" else (words[1][:-3], words[2:])
        assert words[1] == "-m" or os.path.isfile(os.path.join(ROOT, words[1])), (doc, line)
        mod = importlib.import_module(module)
        if args == ["..."]:
            assert not hasattr(mod, "main"), (doc, line)
            continue
        real = configurator.parse

        def parse_only(*a, **k):
            real(*a, **k)
            raise Parsed
        monkeypatch.setattr(mod, "parse", parse_only)
        with pytest.raises(SystemExit if "--help" in args else Parsed) as e:
            mod.main(args)
        assert e.type is Parsed or e.value.code == 0, (doc, line)
