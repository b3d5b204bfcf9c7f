"""
Benchmarks. Each prints a table, then one JSON line last, and compares against a baseline as a
ratio measured in the same run (absolute times only mean something on a GPU).

    python -m lab.bench                       # decode at batch 1: fixed@U and Ouro mode on dense lanes, the
                                          # engine's fixed@U and Dense-/ETE-Ragged at τ 0.3, 0.5
    python -m lab.bench --ckpt out/           # ... on a trained checkpoint instead of the random bench model
    python -m lab.bench --what=engine         # depth batching (lab/bench_engine.py): schedulers x modes x batch sizes
    python -m lab.bench --what=engine --quick # the same on short requests: checks the code, measures nothing
    python -m lab.bench --what=train          # time per optimizer step of each training objective vs dense
    python -m lab.bench --what=gpu --device=cuda   # graphed against eager at Ouro-1.4B's shape (lab/bench_gpu.py)
    python -m lab.bench --what=speculative --ckpt out/   # self-speculative decoding (lab/bench_speculative.py)

Decode targets: KV rows and block evaluations exactly Σ e_i, and tokens/s of a ragged mode >= 0.8 x
U/Ē times fixed@U's on the same engine. The engine's overhead shows as its fixed@U against
model.generate's dense lanes.

The engine benchmark's targets and methods: lab/bench_engine.py and docs/benchmarks.md.

Training target (App. C): direct RA, averaged over a dense + ragged pair, costs <= 1.0x a dense
step; counterfactual and REINFORCE cost more.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.bench ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from lab.bench_engine import bench_engine, bench_model
from lab.bench_gpu import bench_gpu
from lab.bench_speculative import bench_speculative
from checkpoint import load_checkpoint
from configurator import (SEED_RULE, THREADS_RULE, UserError, check, device_rule, parse, run_cli,
                         set_threads, split_list)
from kernels import IMPLS
from model import GPTConfig, LoopedLM, generate
from objectives import Objective, exit_prior, n_uniforms, train_step
from engine.request import Request
from engine.shared_head import HEADS
from serve_depthbatch import Engine

DEFAULTS = dict(
    what="decode",         # decode: tokens/s of the inference modes at batch 1; engine: depth
                           # batching (lab/bench_engine.py); train: objectives; gpu: graphed against
                           # eager at Ouro-1.4B's shape; memory: training's peak memory at start-up
                           # against the size of the data; speculative: self-speculative decoding
                           # against fixed@U (lab/bench_speculative.py)
    ckpt="",               # decode, engine, speculative: a checkpoint; empty: a random model of the bench shape
    prompt_len=32,         # decode: prompt tokens
    new_tokens=96,         # decode: tokens generated per run
    repeats=5,             # decode, train: timings per mode, interleaved across modes; the median is reported
    thr="0.3,0.5",         # decode: thresholds τ of the ragged modes (comma-separated)
    seed=0,                # seeds the model, the prompt, the workload and the batches
    threads=1,             # torch threads (1: steady timings, and room for other jobs; 0: torch's own, one per core)
    steps=1,               # train: even/odd step pairs per timed run (after a warm-up run)
    batch_size=8,          # train: sequences per micro-batch
    block_size=128,        # train: tokens per sequence
    shape="realistic",     # engine: the random model: realistic (vocabulary 32,000) or small_vocab (256 words)
    vocab=0,               # engine: the random model's vocabulary (0: the shape's)
    workload="both",       # engine: a server's queue, a fixed batch of exactly B requests, or both
    head="shared",         # engine: the LM-head policy of the capacity runs (the workloads run both)
    capacity=True,         # engine: also the capacity table (one small pool, every request at once)
    engine_thr=0.5,        # engine: the exit threshold of the ragged modes
    batches="",            # engine: batch sizes, comma-separated (default 1,4,8,32)
    sampling="greedy,paper",  # engine, fixed batch: greedy (as lab/eval.py) and/or the paper's sampling (as sample.py)
    ouro_code="",          # engine, fixed batch: the public Ouro modeling_ouro.py (its configuration beside it), a row
    requests=0,            # engine: requests per batch size (0: 2 x batch + 8; 256 with --full)
    rounds=1,              # engine: rounds of every configuration, in turns; the fastest counts (all: ratio_rounds)
    full=False,            # engine: nano-vllm's size (prompts and outputs of 100-1024 tokens, 256 requests), for a GPU
    quick=False,           # engine: every configuration on short requests of a small model, batches 1 and 4, to
                           # check the code runs in about a minute (measures nothing); speculative: one
                           # draft setting at batch 1
    kv_pages=0,            # engine: KV pages of each pool (0: every token of the workload at every depth)
    max_rows=256,          # engine, queue: rows per pass prefill chunks may fill (a fixed batch prefills at once)
    attn="auto",           # engine: paged attention (kernels.py)
    device="auto",         # engine, gpu: where to run (auto: CUDA when there is one)
    gpu_shape="ouro1.4b",  # gpu: the random model (ouro1.4b; tiny: the same code in seconds on a CPU)
    draft_ks="1,2,4",      # speculative: the most drafts in flight (d = 1 fills its pipeline at U - 1)
    out="",                # gpu: also write the JSON to this file
)
RULES = dict(what=["decode", "engine", "train", "gpu", "memory", "speculative"], prompt_len=">= 1",
             new_tokens=">= 2", repeats=">= 1", thr="floats in [0, 1]", seed=SEED_RULE,
             threads=THREADS_RULE,
             steps=">= 1", batch_size=">= 1", block_size=">= 2", engine_thr="in [0, 1]",
             requests=">= 0", rounds=">= 1", kv_pages=">= 0", max_rows=">= 1", attn=IMPLS,
             device=device_rule, shape=["realistic", "small_vocab"], vocab="in [0, 1000000]",
             workload=["queue", "batch", "both"], head=HEADS,
             sampling=lambda v: None if v and set(split_list("sampling", v)) <= {"greedy", "paper"}
             else "expected greedy, paper or greedy,paper",
             batches=lambda v: check("batches", v, "ints >= 1") if v else None,
             gpu_shape=["ouro1.4b", "tiny"], draft_ks="ints >= 1")
# which --what each key is for (its comment says so too): set for another, it would do
# nothing, and so it is refused
FOR_WHAT = dict(ckpt="decode engine speculative", prompt_len="decode speculative",
                new_tokens="decode speculative", draft_ks="speculative",
                repeats="decode train", thr="decode",
                steps="train", batch_size="train", block_size="train", shape="engine",
                vocab="engine",
                workload="engine", head="engine", capacity="engine", engine_thr="engine speculative",
                batches="engine gpu speculative",
                sampling="engine", ouro_code="engine", requests="engine", rounds="engine gpu speculative",
                full="engine", quick="engine speculative", kv_pages="engine", max_rows="engine", attn="engine",
                device="engine gpu", gpu_shape="gpu", out="gpu")
NEEDS = {k: ("--what=" + " or --what=".join(w.split()), lambda c, w=w: c["what"] in w.split())
         for k, w in FOR_WHAT.items()}
# --quick: the engine benchmark on a small model and few requests, so that it checks the code in
# about a minute on 2 cores (the keys a user gives keep their values)
QUICK = dict(shape="small_vocab", batches="1,4", requests=8)


def timed(fns, repeats, desc="bench"):
    """Time every fn of {name: fn} `repeats` times, interleaved (name by name within each round, so
    that a slow spell of a loaded machine hits every mode alike), with a progress bar on stderr.
    Returns {name: (median seconds, (fastest, slowest)), last result}."""
    from tqdm import tqdm
    times, out = {name: [] for name in fns}, {}
    with tqdm(total=repeats * len(fns), desc=desc, unit="run", file=sys.stderr, leave=False,
              mininterval=1 if sys.stderr.isatty() else 10) as bar:
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                out[name] = fn()
                times[name].append(time.perf_counter() - t0)
                bar.update(1)
    return {name: (statistics.median(t), (min(t), max(t)), out[name]) for name, t in times.items()}


def bench_decode(c):
    model = load_checkpoint(c["ckpt"])[0] if c["ckpt"] else bench_model(c["seed"], "decode")
    U = model.config.n_loops
    g = torch.Generator().manual_seed(c["seed"])
    prompt = torch.randint(0, model.config.vocab_size, (c["prompt_len"],), generator=g).tolist()
    N = c["new_tokens"]
    if c["prompt_len"] + N > model.config.block_size:
        raise UserError(f"prompt_len + new_tokens = {c['prompt_len'] + N} exceeds block_size {model.config.block_size}")
    thrs = split_list("thr", c["thr"], float)

    def engine_run(mode, thr):
        r = Request(prompt, N, mode, thr, depth=U if mode == "fixed" else 0)
        Engine(model, (c["prompt_len"] + N) * U, max_batch=1).run([r])
        return r
    fns = {f"fixed@{U} lanes": lambda: generate(model, prompt, N, "fixed", U),
           f"fixed@{U}": lambda: engine_run("fixed", 0.5)}
    for thr in thrs:
        fns[f"ouro@{thr} lanes"] = lambda thr=thr: generate(model, prompt, N, "ouro", None, thr)
        for mode in ("dense_ragged", "ete_ragged"):
            fns[f"{mode}@{thr}"] = lambda mode=mode, thr=thr: engine_run(mode, thr)
    timing = timed(fns, c["repeats"])
    n_rows = (c["prompt_len"] + N - 1) * U
    rows = {}
    for name, (t, spread, r) in timing.items():
        row = dict(avg_depth=float(U), kv_physical=n_rows, kv_dense=n_rows, block_evals=n_rows)
        if "ragged" in name:
            s_e = sum(r.exits)
            if not r.kv["physical"] == r.kv["block_evals"] == s_e:
                raise AssertionError(f"{name}: accounting {r.kv} != Σe {s_e}")
            dec = r.decode_exits
            row = dict(avg_depth=sum(dec) / len(dec), kv_physical=r.kv["physical"], kv_dense=r.kv["dense"],
                       block_evals=r.kv["block_evals"], accounting_exact=True)
        rows[name] = dict(row, seconds=t, seconds_min=spread[0], seconds_max=spread[1])
    t_fixed, t_lanes = rows[f"fixed@{U}"]["seconds"], rows[f"fixed@{U} lanes"]["seconds"]
    for name, row in rows.items():
        row["kv_ratio"] = row["kv_physical"] / row["kv_dense"]
        row["block_eval_ratio"] = row["block_evals"] / row["kv_dense"]
        row["tok_s"] = N / row["seconds"]
        row["speedup_vs_fixed"] = t_fixed / row["seconds"]
        row["speedup_vs_lanes"] = t_lanes / row["seconds"]
        if "ragged" in name:  # the decode target: ≥ 0.8 × U / Ē (Ē over the decode tokens)
            row["target_speedup"] = 0.8 * U / row["avg_depth"]
            row["meets_target"] = row["speedup_vs_fixed"] >= row["target_speedup"]
    print(f"median of {c['repeats']} interleaved runs; spread = slowest/fastest run - 1; x fixed: against the "
          f"engine's fixed@{U}; x lanes: against model.generate's dense lanes", file=sys.stderr)
    print(f"{'mode':<18}{'Ē(decode)':>10}{'KV rows':>14}{'KV ratio':>10}{'evals/NU':>10}{'tok/s':>9}{'spread':>8}"
          f"{'x fixed':>9}{'target':>8}{'':>6}{'x lanes':>9}", file=sys.stderr)
    for name, r in rows.items():
        verdict = "" if "meets_target" not in r else ("pass" if r["meets_target"] else "FAIL")
        print(f"{name:<18}{r['avg_depth']:>10.2f}{r['kv_physical']:>7}/{r['kv_dense']:<6}{r['kv_ratio']:>10.3f}"
              f"{r['block_eval_ratio']:>10.3f}{r['tok_s']:>9.1f}{r['seconds_max'] / r['seconds_min'] - 1:>8.0%}"
              f"{r['speedup_vs_fixed']:>9.2f}{r.get('target_speedup', float('nan')):>8.2f}{verdict:>6}"
              f"{r['speedup_vs_lanes']:>9.2f}", file=sys.stderr)
    cfg = model.config
    return {"bench": "decode", "batch": 1, "prompt_len": c["prompt_len"], "new_tokens": N, "n_loops": U,
            "model": f"L={cfg.n_layer} d={cfg.n_embd} V={cfg.vocab_size}", "device": "cpu",
            "modes": {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                      for k, v in rows.items()}}


def bench_train(c):
    """Time per optimizer step of each objective (an even/odd pair of steps per timed run, so that
    the alternating objectives count one dense and one ragged step), interleaved, as a ratio to
    dense; and the cost of the step-scope global KL (one extra forward without gradient per
    micro-batch) against the per-micro-batch KL, both with 2 micro-batches per step."""
    from contextlib import nullcontext
    torch.manual_seed(c["seed"])
    cfg = GPTConfig(vocab_size=256, block_size=c["block_size"], n_layer=2, n_head=4, n_kv_head=4,
                    n_embd=256, ffn_hidden=704)
    model = LoopedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prior = exit_prior("poisson", cfg.n_loops)
    B, T, U = c["batch_size"], c["block_size"], cfg.n_loops
    g = torch.Generator().manual_seed(c["seed"])
    x = torch.randint(0, 256, (B, T), generator=g)
    y = torch.randint(0, 256, (B, T), generator=g)
    variants = {"dense": dict(ragged_aware=False),
                "direct_ra": dict(ragged_aware=True, ra_method="direct"),
                "counterfactual": dict(ragged_aware=True, ra_method="counterfactual"),
                "reinforce_k1": dict(ragged_aware=True, ra_method="reinforce", reinforce_k=1),
                "reinforce_k4": dict(ragged_aware=True, ra_method="reinforce", reinforce_k=4),
                "dense_2micro_kl_micro": dict(kl_scope="micro", micro=2),
                "dense_2micro_kl_step": dict(kl_scope="step", micro=2)}

    def run(v):
        obj = Objective(global_kl=True, **{k: w for k, w in v.items() if k != "micro"})
        n = v.get("micro", 1)
        for it in range(2 * c["steps"]):  # even and odd steps alike: a pair covers dense + ragged
            u = torch.rand(n_uniforms(obj), B, T, U, generator=g)
            parts = [(x[i::n], y[i::n], u[:, i::n]) for i in range(n)]
            train_step(model, parts, it, prior, obj, 0.01, nullcontext(), n, 1)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for v in variants.values():
        run(v)  # warm-up
    timing = timed({name: (lambda v=v: run(v)) for name, v in variants.items()}, c["repeats"])
    rows = {name: t / (2 * c["steps"]) for name, (t, _, _) in timing.items()}
    base = rows["dense"]
    scope_cost = rows["dense_2micro_kl_step"] / rows["dense_2micro_kl_micro"]
    print(f"median of {c['repeats']} interleaved runs of {2 * c['steps']} steps", file=sys.stderr)
    print(f"{'objective':<24}{'ms/step':>10}{'× dense':>9}", file=sys.stderr)
    for name, t in rows.items():
        print(f"{name:<24}{1000 * t:>10.1f}{t / base:>9.2f}", file=sys.stderr)
    print(f"--kl_scope=step costs {scope_cost:.2f}x --kl_scope=micro at 2 micro-batches per step",
          file=sys.stderr)
    return {"bench": "train", "model": f"L=2 d=256 U={U}", "batch": [B, T], "device": "cpu",
            "ms_per_step": {k: round(1000 * v, 2) for k, v in rows.items()},
            "ratio_to_dense": {k: round(v / base, 3) for k, v in rows.items()},
            "kl_scope_step_vs_micro": round(scope_cost, 3),
            "direct_ra_meets_target": rows["direct_ra"] / base <= 1.0}


PEAK = """
import resource, sys
import train
train.main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)     # KiB on Linux
"""


def bench_memory(c):
    """Training start-up's peak memory (RSS, KiB) against the size of the data: a train split of 1
    MB and one of 90 MB (random ids of one vocabulary, the same small val split), each through
    train.py's start-up, the unigram baseline and one step with its evaluation, in a process of its
    own. The target: the 90 MB split peaks within 100 MB of the 1 MB one (the splits are
    memory-mapped and read in chunks: metrics.CHUNK)."""
    import subprocess
    import tempfile
    from tokenizer import char_meta
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng = np.random.default_rng(c["seed"])
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mb in (1, 90):
            folder = os.path.join(tmp, f"mem{mb}")
            os.makedirs(folder)
            with open(os.path.join(folder, "meta.json"), "w") as f:
                json.dump(char_meta([chr(97 + i) for i in range(26)]), f)
            rng.integers(0, 26, mb * 2**19, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
            rng.integers(0, 26, 2**16, dtype=np.uint16).tofile(os.path.join(folder, "val.bin"))
            args = [f"--data_dir={tmp}", f"--dataset=mem{mb}", f"--out_dir={folder}/out",
                    "--max_iters=1",
                    "--eval_interval=1", "--eval_iters=1", "--n_layer=1", "--n_embd=32",
                    "--n_head=2", "--n_kv_head=2",
                    "--ffn_hidden=64", "--block_size=32", "--batch_size=4", "--threads=1",
                    "--device=cpu"]
            done = subprocess.run([sys.executable, "-c", PEAK] + args, capture_output=True,
                                  text=True, cwd=root, check=True)
            peaks[mb] = int(done.stdout.strip().splitlines()[-1])
    out = {"bench": "memory", "peak_kib_1mb": peaks[1], "peak_kib_90mb": peaks[90],
           "difference_mb": round((peaks[90] - peaks[1]) / 1024, 1)}
    out["target_met"] = out["difference_mb"] <= 100
    print(f"training start-up's peak memory: {peaks[1] / 1024:.0f} MB with a 1 MB train split, "
          f"{peaks[90] / 1024:.0f} MB with a 90 MB one: "
          f"{out['difference_mb']} MB more (target <= 100)",
          file=sys.stderr)
    return out


def main(argv):
    given = set()
    c = parse(argv, DEFAULTS, RULES, __file__, given, NEEDS)
    if c["quick"] and c["what"] == "engine":     # what --quick means, for the keys left at their defaults
        c.update({k: v for k, v in QUICK.items() if k not in given})
    set_threads(c["threads"])
    torch.manual_seed(c["seed"])
    run = {"decode": bench_decode, "engine": bench_engine, "train": bench_train, "gpu": bench_gpu,
           "memory": bench_memory, "speculative": bench_speculative}[c["what"]]
    print(json.dumps(run(c)))


if __name__ == "__main__":
    run_cli(main)
