"""Every script's entry point on bad input, in-process: exit code 2, exactly one stderr line
`error: ...` naming the bad key, and no file created or changed. Plus --help everywhere."""
import hashlib
import os
import re

import pytest

import bench
import bench_kernels
import configurator
import eval as eval_py
import export_ouro
import prepare_data
import reproduce
import sample
import server
import train

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
    return root


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
    (sample, ["--thr=0.5", "--prefix_full=2"], "prefix_full"), (sample, ["--mode=fixed", "--thr=0.5"], "thr"),
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
    # a resumed run keeps its shape, even when the flag gives the default (TINY's runs have batch_size 4)
    (train, ["--init_from=resume", "--n_embd=64"], "n_embd"),
    (train, ["--init_from=resume", "--batch_size=8"], "batch_size"),
    (train, ["--init_from=resume", "--batch_size=16"], "batch_size"),
    (train, ["--init_from=resume", "--n_embd=128"], "n_embd"),
    (train, ["--branch_from=out", "--out_dir=branch", "--n_layer=2"], "n_layer"),
    # one model per folder; names that say what is wrong
    (export_ouro, ["--ckpt=ouro_ckpt", "--out=out"], "out"), (train, ["--out_dir=exported"], "out_dir"),
    (sample, ["--prompt=FILE:data", "--max_new_tokens=5"], "prompt"), (sample, ["--engine=gpu"], "engine"),
    (train, ["--eval_thr=0.5,0.3,0.5"], "eval_thr"), (train, ["--dataset=wrong_ids"], "dataset"),
    (server, ["--ckpt=out", "--host=no-such-host.invalid", "--port=0"], "host"),
    # eval.py, bench_kernels.py
    (eval_py, ["--ckpt=nowhere", "--builtin=synthetic"], "ckpt"),
    (eval_py, ["--builtin=synthetic", "--modes=warp@0.5"], "modes"),
    (eval_py, ["--builtin=synthetic", "--modes=fixed@9"], "modes"), (eval_py, ["--builtin=synthetic", "--k=4"], "k"),
    (eval_py, ["--task=missing.jsonl"], "task"), (eval_py, [], "task"),
    (eval_py, ["--convert=gsm8k", "--out=tasks"], "convert"),
    (eval_py, ["--lm_eval=no_such_task"], "lm_eval"),
    (eval_py, ["--builtin=synthetic", "--temperature=1e999"], "temperature"),
    (bench_kernels, ["--batches=a,b"], "batches"), (bench_kernels, ["--iters=0"], "iters"),
    (bench_kernels, ["--seed=-1"], "seed"),
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


def test_the_engine_file_points_to_the_server_and_the_benchmark():
    """serve_depthbatch.py is a library now: run as a script it says where serving and its benchmark went."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "serve_depthbatch.py", "--ckpt", "out/"], cwd=here, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "python server.py" in r.stderr and "bench.py --what=engine" in r.stderr


def test_torchrun_bad_flag_is_one_line_and_torchrun_names_it(tmp_path):
    """Under torchrun every rank fails alike: the line is printed once (rank 0), and torchrun's own
    failure report that follows names it as each rank's cause instead of "<N/A>"."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(here, "train.py"), "--n_layer=abc"], capture_output=True, text=True,
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
