"""
Train a looped LM with an exit-prior objective (paper §4, App. B).

    python train.py                                   # small model on synthetic data, a few CPU minutes
    python train.py --prior=geometric --global_kl     # global prior enforcement (Eq. 10)
    python train.py config/shakespeare_char.py --max_iters=2000
    python train.py --init_from=resume                # continue out_dir/ckpt.pt exactly, with its own settings

    python train.py --global_kl --ragged_aware        # alternate dense and sampled-ragged steps (§5)
    torchrun --standalone --nproc_per_node=2 train.py # data parallel (gloo on CPU, nccl on CUDA)

A resume takes every setting from the checkpoint: --data_dir, --log_interval, --eval_interval, --eval_iters
and --eval_thr may be given anew, and --max_iters raised to train on past the run's end (a finished run
too: from there the schedules are those of a run of the new length, extend_run), --stop_iter, --device,
--compile and --backend are this process's own,
any other flag given with another value than the run's is refused. A flag that acts only with another
(NEEDS: --cf_thr without --ra_method=counterfactual, say) is refused without it.

The objectives themselves (Eq. 9-22) are objectives.py, what a run measures on held-out data is
metrics.py; this file is the loop around them. Read top to bottom: the settings, the loop
(train_loop), then what it stands on: the schedule, data, checkpoints, data-parallel processes.
"""
import json
import math
import os
import random
import sys
import time
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch

from checkpoint import is_ouro_folder, load_checkpoint
from configurator import (SEED_RULE, THREADS_RULE, UserError, check_writable, device_rule, parse,
                          resolve_device, run_cli, set_threads)
from metrics import chunks, draw_starts, eval_thresholds, evaluate, get_batch, unigram_loss
from model import GPTConfig, LoopedLM, check_shapes
from objectives import Objective, beta_schedule, exit_prior, n_uniforms, step_kind, train_step
from run_folder import lock_out_dir, log_target, save_run, trim_log, write_record
from tokenizer import check_meta

# ----------------------------------------------------------------------------- defaults
# I/O
out_dir = "out"              # where ckpt.pt and log.jsonl go
eval_interval = 100          # evaluate, log and checkpoint every this many iterations
log_interval = 10            # log a training record every this many iterations
eval_iters = 10              # val batches per evaluation
eval_only = False            # evaluate out_dir/ckpt.pt once, print the record as JSON on stdout, write nothing
init_from = "scratch"        # start a new model, or resume out_dir/ckpt.pt exactly: with its own settings
branch_from = ""             # a finished run (its out_dir or ckpt.pt): its weights, a fresh optimizer and schedule
stop_iter = -1               # stop (checkpoint written) at this iteration, to split a run into jobs
overwrite = False            # a fresh run replaces the earlier run in out_dir (default: moves it to out_dir/earlier-N)
# data
dataset = "synthetic"        # a folder under data_dir made by prepare_data.py
data_dir = "data"            # where prepare_data.py wrote the datasets
batch_size = 16              # sequences per micro-batch
block_size = 128             # tokens per sequence (the context length)
gradient_accumulation_steps = 1  # micro-batches per optimizer step, over all processes (at least one each)
# model (GPTConfig fields)
n_layer = 2                  # L: layers in the looped block
n_head = 4                   # attention heads
n_kv_head = 4                # key/value heads (< n_head: grouped-query attention)
n_embd = 128                 # model width
ffn_hidden = 352             # SwiGLU inner size
n_loops = 4                  # U: applications of the block, one exit gate after each
rope_theta = 1e6             # RoPE base
loop_norm = False            # pass norm(h) to the next loop (Ouro: True; App. B: False)
branch_norm_init = 0.02      # initial gain of the in-branch norms (App. B)
# objective
prior = "uniform"            # the exit-depth prior of the KL term (App. B)
prior_lambda = None          # prior parameter (default: geometric 0.3, poisson 2.1)
global_kl = False            # False: local KL per token (Eq. 9, Ouro); True: global KL (Eq. 10)
kl_scope = "step"            # global KL: π̄ over every token of the optimizer step, or over each micro-batch
beta = None                  # None: App. B cosine-rise schedule over the run; a number: flat β (Ouro: 0.1)
eval_thr = "0.5"             # τ list (comma-separated) for the ragged val loss; the first also gives the exit stats
# ragged-aware training (App. C)
ragged_aware = False         # alternate dense steps with ragged steps
ra_method = "direct"         # which ragged-aware objective (App. C)
cf_thr = 0.5                 # threshold of the committed rollout in counterfactual steps
reinforce_k = 1              # trajectories per step: 1 (baseline: dense final-depth path) or 4 (leave-one-out)
w_rag = 1.0                  # weight of the ragged terms in the REINFORCE loss (Eq. 22)
alpha = 0.01                 # weight of the score term (Eq. 22); the paper gives no value
# optimizer
learning_rate = 1e-3         # peak learning rate (AdamW)
max_iters = 500              # optimizer steps in the whole run
weight_decay = 0.1           # AdamW weight decay of matrices (not of norms and the gate bias)
beta1 = 0.9                  # AdamW β1
beta2 = 0.95                 # AdamW β2
grad_clip = 1.0              # clip the gradient norm to this (0: off)
decay_lr = True              # warmup then cosine decay (False: constant learning_rate)
warmup_iters = 50            # linear warmup steps
lr_decay_start = -1          # cosine decay starts here (-1: right after warmup); App. B: at 1B tokens
lr_decay_iters = -1          # cosine decay ends here (-1: max_iters)
min_lr = 1e-4                # learning rate at the end of the decay
# system
device = "auto"              # where to train (auto: CUDA when there is one)
dtype = "auto"               # auto: bf16 autocast on CUDA, fp32 on CPU
compile = False              # torch.compile the model
threads = 0                  # torch threads (0: torch's own, one per core; 1 beside other jobs)
backend = ""                 # torchrun process group ("": nccl on CUDA, gloo on CPU)
seed = 1337                  # seeds python, numpy and torch; the data order and sampled exits follow it

DEFAULTS = {k: v for k, v in dict(globals()).items()   # the settings above: lower-case, not imported constants
            if k.islower() and not k.startswith("_")
            and (v is None or isinstance(v, (bool, int, float, str)))}


RULES = dict(
    eval_interval=">= 1", log_interval=">= 1", eval_iters=">= 1", init_from=["scratch", "resume"],
    stop_iter=">= -1", batch_size=">= 1", block_size=">= 1", gradient_accumulation_steps=">= 1",
    n_layer=">= 1", n_head=">= 1", n_kv_head=">= 1", n_embd=">= 2", ffn_hidden=">= 1",
    n_loops=">= 1",
    rope_theta="> 0", prior=["uniform", "geometric", "poisson"], prior_lambda="> 0",
    kl_scope=["step", "micro"],
    beta=">= 0", eval_thr="floats in [0, 1]", ra_method=["direct", "counterfactual", "reinforce"],
    cf_thr="in [0, 1]", reinforce_k=[1, 4], w_rag=">= 0", alpha=">= 0", learning_rate="> 0",
    max_iters=">= 1", weight_decay=">= 0", beta1="in [0, 1)", beta2="in [0, 1)", grad_clip=">= 0",
    warmup_iters=">= 0", lr_decay_start=">= -1", lr_decay_iters=">= -1", min_lr=">= 0",
    device=device_rule,
    dtype=["auto", "float32", "bfloat16"], backend=["", "nccl", "gloo"], seed=SEED_RULE,
    threads=THREADS_RULE,
)
# the keys that act only with another setting: set without it they would do nothing, and are refused
ra_with = lambda method: lambda c: c["ragged_aware"] and c["ra_method"] == method
NEEDS = dict(
    overwrite=("--init_from=scratch (a fresh run)", lambda c: c["init_from"] == "scratch"
               and not c["eval_only"]),
    ra_method=("--ragged_aware", lambda c: c["ragged_aware"]),
    cf_thr=("--ragged_aware --ra_method=counterfactual", ra_with("counterfactual")),
    reinforce_k=("--ragged_aware --ra_method=reinforce", ra_with("reinforce")),
    w_rag=("--ragged_aware --ra_method=reinforce", ra_with("reinforce")),
    alpha=("--ragged_aware --ra_method=reinforce", ra_with("reinforce")),
    kl_scope=("--global_kl", lambda c: c["global_kl"]),
    prior_lambda=("--prior=geometric or --prior=poisson", lambda c: c["prior"] != "uniform"),
    **{k: ("--decay_lr=True", lambda c: c["decay_lr"]) for k in ("warmup_iters", "lr_decay_start",
                                                                 "lr_decay_iters", "min_lr")},
)
MODEL_KEYS = ["n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "n_loops", "block_size",
              "rope_theta", "loop_norm", "branch_norm_init"]
# --init_from=resume takes the run's settings from its checkpoint: those of this process are its own
# (RESUME_OWN), where the data lies and how the run reports may be given anew (RESUME_MAY_CHANGE),
# and every other key defines the run (given with another value: refused)
RESUME_OWN = ["init_from", "out_dir", "stop_iter", "eval_only", "device", "compile", "backend",
              "threads", "overwrite"]
RESUME_MAY_CHANGE = ["data_dir", "log_interval", "eval_interval", "eval_iters", "eval_thr", "max_iters"]


# ----------------------------------------------------------------------------- the loop

def train_loop(c, run, iter_num, resumed_at):
    """Evaluate, log and checkpoint every eval_interval steps (metrics.py); one optimizer step of the
    objective (objectives.py: Eq. 9-22) at a time between. Returns the last evaluation's metrics
    (None if there was nothing to do). `run` holds the model, the optimizer, the data and what the
    run logs to (main builds it)."""
    last = c.max_iters if c.stop_iter < 0 else min(c.stop_iter, c.max_iters)
    if iter_num >= last:
        if run.master:
            print(f"the checkpoint is at iter {iter_num} already (max_iters={c.max_iters}, stop_iter={c.stop_iter}): "
                  f"nothing to do; to train on, resume with a larger --max_iters (--init_from=resume "
                  f"--max_iters={2 * max(iter_num, 1)}), or branch a run of its own from it "
                  "(--branch_from=DIR --out_dir=NEW)", file=sys.stderr)
        return None
    from tqdm import tqdm
    bar = tqdm(total=last, initial=iter_num, desc="train", unit="it", file=sys.stderr, dynamic_ncols=True,
               mininterval=1.0, disable=not run.master)
    fwd = torch.compile(run.model) if c.compile else run.model
    metrics, run.saved_at = None, resumed_at
    while True:
        if (iter_num % c.eval_interval == 0 or iter_num == last) and iter_num != resumed_at:
            metrics = evaluate_and_save(c, run, iter_num, bar)
        if iter_num >= last:
            break
        record = optimizer_step(c, run, fwd, iter_num)
        iter_num += 1
        bar.update(1)
        if iter_num % c.log_interval == 0:
            write_record(c, run, {"iter": iter_num, **record})
            bar.set_postfix(loss=f"{record['train_loss']:.4f}", beta=f"{record['beta']:.4f}")
    bar.close()
    return metrics


def optimizer_step(c, run, fwd, iter_num):
    """One step: the learning rate and β of this step (lr_at, the App. B β schedule), the loss of
    this step's kind (dense, or an RA step: objectives.step_kind) over every micro-batch, the
    gradient clipped, the optimizer stepped. Returns what the log records of it."""
    lr, beta = lr_at(iter_num, c), beta_schedule(iter_num / c.max_iters, c.beta)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    t0 = time.time()
    kind = step_kind(iter_num, run.objective)
    mine = range(run.rank * run.n_micro // run.world, (run.rank + 1) * run.n_micro // run.world)
    train_loss, parts, kl_step = train_step(fwd, step_batches(c, run, kind, mine), iter_num, run.prior,
                                            run.objective, beta, run.ctx, run.n_micro, run.world)
    # the norm is taken after the gradient all-reduce: every process stops at the same step
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), c.grad_clip if c.grad_clip > 0 else math.inf)
    if not (math.isfinite(train_loss) and math.isfinite(float(norm))):
        kept = (f"the checkpoint of iter {run.saved_at} in {c.out_dir} is kept" if run.saved_at else
                "no checkpoint of this run was written")
        raise UserError(f"training diverged at iter {iter_num} (loss {train_loss}, gradient norm {float(norm)}); "
                        f"nothing was stepped and {kept}; try a lower --learning_rate or --grad_clip")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    extra = {} if kl_step is None else {"kl_global": kl_step}
    return {"step": kind, "train_loss": train_loss, **parts, **extra, "lr": lr, "beta": beta,
            "ms_per_iter": round(1000 * (time.time() - t0), 1)}


def evaluate_and_save(c, run, iter_num, bar):
    """The held-out metrics (metrics.evaluate), logged and printed, and a checkpoint (but at step 0)."""
    metrics = evaluate(run.model, run.val, run.labels, c, run.prior, run.ctx, run.device, run.item_labels)
    write_record(c, run, run.record_of(iter_num, metrics))
    if run.master:
        bar.write(f"iter {iter_num}: val loss fixed@1..{run.model.config.n_loops} {metrics['val_loss_fixed']}, "
                  f"ragged {metrics['val_loss_ragged']}; avg exit depth {metrics['avg_exit_depth']:.2f}, "
                  f"fractions {metrics['exit_fractions']}, large jumps {metrics['large_jump_rate']:.3f}")
    if iter_num > 0:
        save_run(c, run, iter_num)
        run.saved_at = iter_num
    return metrics


def step_batches(c, run, kind, mine):
    """This process's micro-batches of one step (`mine`), with the uniforms of a ragged step's
    sampled exits: the global batch is drawn identically on every rank, each runs its share."""
    B, T, U = c.batch_size, c.block_size, run.model.config.n_loops
    starts = draw_starts(run.train, c, B * run.n_micro, run.data_gen)
    uniforms = (torch.rand(n_uniforms(run.objective), B * run.n_micro, T, U, generator=run.exit_gen)
                if kind in ("ragged", "reinforce") else None)
    out = []
    for m in mine:
        x, y = get_batch(run.train, c, starts[m * B:(m + 1) * B], run.device)
        out.append((x, y, None if uniforms is None else uniforms[:, m * B:(m + 1) * B].to(run.device)))
    return out


# ----------------------------------------------------------------------------- schedule

def lr_at(it, c):
    """Linear warmup, then cosine decay to min_lr (nanoGPT)."""
    if not c.decay_lr:
        return c.learning_rate
    decay_iters = c.lr_decay_iters if c.lr_decay_iters > 0 else c.max_iters
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    start = c.lr_decay_start if c.lr_decay_start >= 0 else c.warmup_iters
    if it < start:
        return c.learning_rate
    if it >= decay_iters:
        return c.min_lr
    ratio = (it - start) / max(decay_iters - start, 1)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


# ----------------------------------------------------------------------------- data

def data_paths(c):
    folder = os.path.join(c.data_dir, c.dataset)
    return {s: os.path.join(folder, f"{s}.bin") for s in ("train", "val")}, os.path.join(folder, "meta.json")


def ensure_data(c):
    paths, meta_path = data_paths(c)
    if all(os.path.isfile(p) for p in paths.values()) and os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:        # not JSON, or not UTF-8
            raise UserError(f"--dataset={c.dataset}: cannot read {meta_path} ({type(e).__name__}); "
                            "prepare the dataset again with prepare_data.py")
        check_meta(meta, f"--dataset={c.dataset}: {meta_path}")
        return meta
    import prepare_data
    if c.dataset in prepare_data.KINDS:  # the generated datasets prepare themselves, offline
        print(f"preparing the {c.dataset} dataset (python prepare_data.py --dataset={c.dataset})", file=sys.stderr)
        prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=c.data_dir, dataset=c.dataset))
        return ensure_data(c)
    kinds = prepare_data.RULES["dataset"]
    kind = c.dataset if c.dataset in kinds else "<" + "|".join(kinds) + ">"
    raise UserError(f"--dataset={c.dataset}: not prepared in {os.path.dirname(meta_path)!r}: run "
                    f"python prepare_data.py --dataset={kind} --name={c.dataset} --data_dir={c.data_dir}")


def load_split(c, split):
    path = data_paths(c)[0][split]
    try:
        return np.memmap(path, dtype=np.uint16, mode="r")
    except ValueError as e:     # an odd number of bytes, or an empty file: not uint16 token ids
        raise UserError(f"--dataset={c.dataset}: {path} is not a file of uint16 token ids ({e}); "
                        "prepare the dataset again with prepare_data.py")


def load_data(c, vocab_size):
    """The dataset's train and val ids, and its val labels where it has them (the difficulty of
    each token, of each token's item: None otherwise), checked against the context and the
    vocabulary."""
    train, val = load_split(c, "train"), load_split(c, "val")
    labels = [os.path.join(c.data_dir, c.dataset, f) for f in ("val_labels.bin", "val_item_labels.bin")]
    labels = [np.memmap(p, dtype=np.uint8, mode="r") if os.path.isfile(p) else None for p in labels]
    for path, lab in zip(("val_labels.bin", "val_item_labels.bin"), labels):
        if lab is not None and len(lab) != len(val):       # a truncated side file: every label would shift
            raise UserError(f"--dataset={c.dataset}: {path} has {len(lab)} labels for {len(val)} val tokens (one a "
                            "token); prepare the dataset again with prepare_data.py")
    for name, split in (("train", train), ("val", val)):
        if len(split) <= c.block_size + 1:
            raise UserError(f"--block_size={c.block_size}: a split of --dataset={c.dataset} has only {len(split)} "
                            "tokens; it needs more than block_size + 1")
        top = max(int(part.max()) for part in chunks(split))   # a pass over the ids, memory not growing with them
        if top >= vocab_size:
            raise UserError(f"--dataset={c.dataset}: its {name} split holds token id {top}, outside the vocabulary of "
                            f"{vocab_size} (meta.json and the ids disagree); prepare it again")
    return train, val, *labels


# ----------------------------------------------------------------------------- main

def make_optimizer(model, c, device):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, gate bias
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=c.learning_rate, betas=(c.beta1, c.beta2), fused=fused or None)


def setup_distributed(c):
    """Under torchrun (RANK set) join the process group: nccl on CUDA, gloo on CPU.
    Returns (rank, world_size, device)."""
    device = resolve_device(c.device)
    if int(os.environ.get("RANK", -1)) == -1:
        return 0, 1, device
    import torch.distributed as dist
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend=c.backend or ("nccl" if device.startswith("cuda") else "gloo"))
    return dist.get_rank(), dist.get_world_size(), device


def check_config(c, given=()):
    """What the RULES table cannot say alone: keys that must fit together, and paths. Runs before
    anything is written. --eval_only evaluates the run in out_dir as it stands (a resume without
    steps), or refuses."""
    if c.eval_only:
        ckpt = os.path.join(c.out_dir, "ckpt.pt")
        if not os.path.isfile(ckpt):
            raise UserError(f"--eval_only evaluates {ckpt!r}, which does "
                            "not exist (check --out_dir)")
        c.init_from = "resume"
    if c.prior == "geometric" and c.prior_lambda is not None and not c.prior_lambda < 1:
        raise UserError(f"--prior_lambda={c.prior_lambda}: the geometric prior needs a value in (0, 1)")
    for key in ("out_dir", "data_dir"):
        path = getattr(c, key)
        if not path:
            raise UserError(f"--{key} is empty: give a directory")
        if os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"--{key}={path}: exists and is not a directory")
    if is_ouro_folder(c.out_dir):
        raise UserError(f"--out_dir={c.out_dir}: holds an Ouro folder (config.json + safetensors); "
                        "a run's ckpt.pt beside it would make --ckpt ambiguous. "
                        "Give a folder of its own")
    if not c.eval_only:
        check_writable(c.out_dir, "out_dir")
    if c.init_from == "resume":
        if not os.path.isfile(os.path.join(c.out_dir, "ckpt.pt")):
            raise UserError("--init_from=resume: no checkpoint "
                            f"{os.path.join(c.out_dir, 'ckpt.pt')!r} to resume (check --out_dir)")
        if c.branch_from:
            raise UserError(f"--branch_from={c.branch_from}: a branch starts a new run; it cannot "
                            "be resumed from --init_from=resume at the same time")
    elif c.branch_from:
        parent = c.branch_from if os.path.isdir(c.branch_from) else os.path.dirname(c.branch_from)
        if os.path.realpath(parent or ".") == os.path.realpath(c.out_dir):
            raise UserError(f"--branch_from={c.branch_from}: a branch writes its own --out_dir; "
                            "the parent stays untouched")
    else:
        check_shapes(GPTConfig(vocab_size=1, **{k: getattr(c, k) for k in MODEL_KEYS}))
    if c.stop_iter == 0:
        raise UserError("--stop_iter=0: stops before the first step; give a positive "
                        "iteration (or -1: no stop)")
    eval_thresholds(c)


def micro_batches(c, world):
    """Micro-batches per optimizer step over all processes: gradient_accumulation_steps, raised to
    one per process when there are more processes than that."""
    n = c.gradient_accumulation_steps
    if n < world:
        return world
    if n % world:
        raise UserError(f"--gradient_accumulation_steps={n}: must be a multiple of the {world} "
                        "processes (each runs an equal share of the global batch)")
    return n


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def dataset_meta(c, master, world):
    """meta.json of the dataset, prepared on rank 0 if it is the default synthetic one."""
    meta = ensure_data(c) if master else None
    if world > 1:
        import torch.distributed as dist
        box = [meta]
        dist.broadcast_object_list(box)  # rank 0 may have just prepared the data
        meta = box[0]
    return meta


def extend_run(c, saved, iter_num, master):
    """A resume may raise --max_iters and train on past the run's end (a finished run included),
    with its optimizer state and its data order. The rule of the schedules: from the resumed step on,
    the learning rate and β are those of a run of the new length (the cosine decay reaches min_lr at
    the new max_iters, App. B's β knots are fractions of it; a decay end given with --lr_decay_iters
    stays where it was), so the steps after the resume are those of a run trained at the new length
    from the start; the steps before followed the old length's schedules. Says so on stderr."""
    if c.max_iters == saved["max_iters"]:
        return
    if c.max_iters < iter_num:
        raise UserError(f"--max_iters={c.max_iters}: the checkpoint in {c.out_dir} is at iter "
                        f"{iter_num} already; a resume trains on to a larger --max_iters")
    if master:
        end = c.lr_decay_iters if c.lr_decay_iters > 0 else c.max_iters
        lr = f"cosine decay to iter {end}" if c.decay_lr else "a constant learning rate"
        beta = f"App. B's β schedule over {c.max_iters}" if c.beta is None else f"β {c.beta}"
        print(f"extending the run from {saved['max_iters']} to {c.max_iters} iterations: from iter "
              f"{iter_num} on, the schedules are a {c.max_iters}-iteration run's ({lr}; {beta})",
              file=sys.stderr)


def start_model(c, meta, device, master, data_gen, exit_gen, given=()):
    """A new model, a resumed run (weights, optimizer and random states exactly where they stopped)
    or a branch (a parent's weights, a fresh optimizer). Returns (model, optimizer, iter_num,
    resumed_at). given: the keys the user set (set to what a resumed run or a branch already has, or
    refused)."""
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    if c.init_from == "resume":
        model, ckpt = load_checkpoint(ckpt_path, device, flag="--out_dir")
        saved = ckpt["config"]
        for k in sorted((DEFAULTS.keys() - set(RESUME_OWN)) & saved.keys()):   # the run as it was started
            if k in given and getattr(c, k) != saved[k] and k not in RESUME_MAY_CHANGE:
                raise UserError(f"--{k}={getattr(c, k)}: --init_from=resume continues the run in {c.out_dir}, "
                                f"which has {k}={saved[k]}; a resume may change only "
                                + ", ".join(f"--{m}" for m in RESUME_MAY_CHANGE))
            if k not in given:
                setattr(c, k, saved[k])
        extend_run(c, saved, ckpt["iter_num"], master)
        optimizer = make_optimizer(model, c, device)
        optimizer.load_state_dict(ckpt["optimizer"])
        data_gen.set_state(ckpt["data_rng"])
        exit_gen.set_state(ckpt["exit_rng"])
        if master:
            print(f"resuming from {ckpt_path} at iter {ckpt['iter_num']}; log.jsonl continues", file=sys.stderr)
        return model.train(), optimizer, ckpt["iter_num"], ckpt["iter_num"]
    if c.branch_from:   # a branch-off (App. C): the parent's weights, then a run of its own
        model, ckpt = load_checkpoint(c.branch_from, device, flag="--branch_from")
        for k in MODEL_KEYS:
            if k in given and getattr(c, k) != ckpt["model_args"][k]:
                raise UserError(f"--{k}={getattr(c, k)!r}: --branch_from={c.branch_from} starts from its weights, "
                                f"which have {k}={ckpt['model_args'][k]!r}; a branch keeps its parent's shape")
            setattr(c, k, ckpt["model_args"][k])
        if model.config.vocab_size != meta["vocab_size"]:
            raise UserError(f"--branch_from={c.branch_from}: its vocabulary ({model.config.vocab_size}) is not that of "
                            f"--dataset={c.dataset} ({meta['vocab_size']})")
        if master:
            print(f"branching from {c.branch_from} (iter {ckpt.get('iter_num')})", file=sys.stderr)
        return model.train(), make_optimizer(model, c, device), 0, None
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], **{k: getattr(c, k) for k in MODEL_KEYS})).to(device)
    return model, make_optimizer(model, c, device), 0, None


def autocast(c, device):
    use_bf16 = c.dtype == "bfloat16" or (c.dtype == "auto" and device.startswith("cuda"))
    return (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16) if use_bf16
            else torch.autocast(device_type="cpu", enabled=False))


def describe_run(c, model, device, n_micro, world, baseline):
    """What the run trains and on what batches, and the loss to beat, on stderr."""
    objective = f"{'global' if c.global_kl else 'local'} KL to {c.prior} prior" + (
        f", ragged-aware ({c.ra_method})" if c.ragged_aware else "")
    print(f"model: {model.num_params():,} parameters, L={model.config.n_layer}, "
          f"U={model.config.n_loops}; objective: {objective}; device {device}", file=sys.stderr)
    print(f"global batch: {n_micro} micro-batch(es) of {c.batch_size}x{c.block_size} = "
          f"{c.batch_size * c.block_size * n_micro:,} tokens per step ({n_micro // world} per "
          f"process x {world} process(es))", file=sys.stderr)
    print(f"unigram baseline val loss: {baseline:.4f}", file=sys.stderr)


def main(argv):
    given = set()
    c = SimpleNamespace(**parse(argv, DEFAULTS, RULES, __file__, given, NEEDS))
    check_config(c, given)
    set_threads(c.threads)
    run = build_run(c, given)
    if c.eval_only:  # one evaluation, printed; nothing is written
        metrics = evaluate(run.model, run.val, run.labels, c, run.prior, run.ctx, run.device, run.item_labels)
        if run.master:
            print(json.dumps(run.record_of(run.iter_num, metrics)))
        return metrics
    lock = lock_out_dir(c) if run.master else None        # before the first write into out_dir
    try:
        run.log_file, run.pending = log_target(c, run.master)
        if run.resumed_at is not None and run.master:
            trim_log(os.path.join(c.out_dir, "log.jsonl"), run.resumed_at)
        try:
            metrics = train_loop(c, run, run.iter_num, run.resumed_at)
        finally:   # interrupted before this run's first checkpoint: its log has nothing to go with
            if run.master and run.pending and os.path.exists(run.log_file):
                os.remove(run.log_file)
    finally:
        if lock is not None:
            lock.close()
    if run.master and metrics is not None:
        print(f"val loss (best fixed depth) {min(metrics['val_loss_fixed']):.4f}, ragged "
              f"{metrics['val_loss_ragged']} vs unigram baseline {run.baseline:.4f}; checkpoint: "
              f"{os.path.join(c.out_dir, 'ckpt.pt')}", file=sys.stderr)
    if run.world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return metrics


def build_run(c, given):
    """Everything a run trains with: its processes, the model (new, resumed or branched) and its
    optimizer, the data and its random streams, the prior, the objective's flags, and how it records
    an evaluation."""
    rank, world, device = setup_distributed(c)
    master, n_micro = rank == 0, micro_batches(c, world)
    seed_everything(c.seed)
    meta = None if c.init_from == "resume" else dataset_meta(c, master, world)
    data_gen = torch.Generator().manual_seed(c.seed)       # batches: the same on every rank
    exit_gen = torch.Generator().manual_seed(c.seed + 2)   # sampled exits of ragged steps
    model, optimizer, iter_num, resumed_at = start_model(c, meta, device, master, data_gen, exit_gen, given)
    meta = meta or dataset_meta(c, master, world)          # a resumed run: the dataset it was trained on
    train, val, labels, item_labels = load_data(c, model.config.vocab_size)
    baseline = unigram_loss(train, val, model.config.vocab_size)
    tokens_per_iter = c.batch_size * c.block_size * n_micro
    if master:
        describe_run(c, model, device, n_micro, world, baseline)

    def record_of(it, metrics):
        return {"iter": it, "tokens": it * tokens_per_iter, **metrics,
                "beta": beta_schedule(it / c.max_iters, c.beta), "unigram_loss": round(baseline, 5)}
    return SimpleNamespace(model=model, optimizer=optimizer, meta=meta, data_gen=data_gen, exit_gen=exit_gen,
                           master=master, rank=rank, world=world, n_micro=n_micro, device=device,
                           ctx=autocast(c, device), prior=exit_prior(c.prior, model.config.n_loops,
                                                                     c.prior_lambda).to(device),
                           objective=Objective(**{f.name: getattr(c, f.name) for f in fields(Objective)}),
                           record_of=record_of, train=train, val=val, labels=labels, item_labels=item_labels,
                           iter_num=iter_num, resumed_at=resumed_at, baseline=baseline)


if __name__ == "__main__":
    run_cli(main)
