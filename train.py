"""
Train a looped LM with an exit-prior objective (paper §4, App. B).

    python train.py                                   # small model on synthetic data, a few CPU minutes
    python train.py --prior=geometric --global_kl     # global prior enforcement (Eq. 10)
    python train.py config/shakespeare_char.py --max_iters=2000
    python train.py --init_from=resume                # continue out_dir/ckpt.pt exactly

Dense step (Eq. 9 / Eq. 10):  L = mean_i Σ_d π_i(d) ℓ_{i,d} + β R(π)
  local  (Ouro, Eq. 9):   R = mean_i KL(π_i ‖ prior)
  global (ours, Eq. 10):  R = KL(π̄ ‖ prior), π̄ = mean_i π_i
"""
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from configurator import parse, run_cli
from model import (GPTConfig, LoopedLM, UserError, exit_pdf, load_checkpoint, model_args,
                   save_checkpoint, threshold_exit)

# ----------------------------------------------------------------------------- defaults
# I/O
out_dir = "out"
eval_interval = 100
log_interval = 10
eval_iters = 10
eval_only = False
init_from = "scratch"       # scratch | resume
stop_iter = -1              # stop (checkpoint written) at this iteration, to split a run into jobs
# data
dataset = "synthetic"       # a folder under data_dir made by prepare_data.py
data_dir = "data"
batch_size = 16
block_size = 128
gradient_accumulation_steps = 1
# model (GPTConfig fields)
n_layer = 2
n_head = 4
n_kv_head = 4
n_embd = 128
ffn_hidden = 352
n_loops = 4
rope_theta = 1e6
loop_norm = False
branch_norm_init = 0.02
# objective
prior = "uniform"           # uniform | geometric | poisson (App. B)
prior_lambda = None         # geometric: 0.3, poisson: 2.1 when None
global_kl = False           # False: local KL per token (Eq. 9, Ouro); True: global KL (Eq. 10)
beta = None                 # None: App. B cosine-rise schedule over the run; a number: flat β (Ouro: 0.1)
eval_thr = 0.5              # τ for the exit statistics at eval
# optimizer
learning_rate = 1e-3
max_iters = 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 50
lr_decay_iters = -1         # -1: max_iters
min_lr = 1e-4
# system
device = "auto"             # auto | cpu | cuda | cuda:N | mps
dtype = "auto"              # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
compile = False
seed = 1337

DEFAULTS = {k: v for k, v in dict(globals()).items()
            if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}
CHOICES = dict(init_from=["scratch", "resume"], prior=["uniform", "geometric", "poisson"],
               dtype=["auto", "float32", "bfloat16"])
MODEL_KEYS = ["n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "n_loops", "block_size",
              "rope_theta", "loop_norm", "branch_norm_init"]


# ----------------------------------------------------------------------------- objective

def exit_prior(name, U, lam=None):
    """Priors over depths 1..U, renormalised (App. B)."""
    d = torch.arange(1, U + 1, dtype=torch.float64)
    if name == "uniform":
        p = torch.ones(U, dtype=torch.float64)
    elif name == "geometric":   # π(d) ∝ λ(1-λ)^(d-1), λ = 0.3
        lam = 0.3 if lam is None else lam
        p = lam * (1 - lam) ** (d - 1)
    elif name == "poisson":     # π(d) ∝ λ^d e^-λ / d!, λ = 2.1
        lam = 2.1 if lam is None else lam
        p = torch.exp(d * math.log(lam) - lam - torch.lgamma(d + 1))
    else:
        raise UserError(f"--prior={name!r}; allowed: uniform, geometric, poisson")
    return p / p.sum()


def kl(p, q):
    """KL(p ‖ q) over the last dim, with 0 log 0 = 0."""
    return (torch.xlogy(p, p) - p * torch.log(q)).sum(-1)


def kl_local(pi, prior):
    """Eq. 9: mean over tokens of KL(π_i ‖ prior). pi: (N, U)."""
    return kl(pi, prior.to(pi)).mean()


def kl_global(pi, prior):
    """Eq. 10: KL(π̄ ‖ prior) with π̄ the batch-mean exit distribution."""
    return kl(pi.mean(0), prior.to(pi))


def dense_loss(losses, gate_logits, prior, global_kl, beta, valid=None):
    """L = mean_i Σ_d π_i(d) ℓ_{i,d} + β R(π)  (Eq. 9 or Eq. 10; Eq. 14 with mask `valid`)."""
    pi = exit_pdf(gate_logits).reshape(-1, gate_logits.shape[-1])
    losses = losses.reshape(-1, losses.shape[-1])
    if valid is not None:
        keep = valid.reshape(-1)
        pi, losses = pi[keep], losses[keep]
    expected = (pi * losses.to(pi.dtype)).sum(-1).mean()
    reg = kl_global(pi, prior) if global_kl else kl_local(pi, prior)
    return expected + beta * reg, expected, reg


def beta_schedule(frac, beta=None):
    """App. B: cosine rises 0→0.01 over the first quarter of training, 0.01→0.02 to the half,
    0.02→0.05 to the end (the 5B/10B/20B-token knots as fractions). A number means flat β."""
    if beta is not None:
        return float(beta)
    frac = min(max(frac, 0.0), 1.0)
    for start, end, b0, b1 in [(0.0, 0.25, 0.0, 0.01), (0.25, 0.5, 0.01, 0.02), (0.5, 1.0, 0.02, 0.05)]:
        if frac <= end:
            t = (frac - start) / (end - start)
            return b0 + (b1 - b0) * (1 - math.cos(math.pi * t)) / 2
    return 0.05


def lr_at(it, c):
    """Linear warmup, then cosine decay to min_lr (nanoGPT)."""
    if not c.decay_lr:
        return c.learning_rate
    decay_iters = c.lr_decay_iters if c.lr_decay_iters > 0 else c.max_iters
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it >= decay_iters:
        return c.min_lr
    ratio = (it - c.warmup_iters) / max(decay_iters - c.warmup_iters, 1)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


# ----------------------------------------------------------------------------- data

def data_paths(c):
    folder = os.path.join(c.data_dir, c.dataset)
    return {s: os.path.join(folder, f"{s}.bin") for s in ("train", "val")}, os.path.join(folder, "meta.json")


def ensure_data(c):
    paths, meta_path = data_paths(c)
    if all(os.path.isfile(p) for p in paths.values()) and os.path.isfile(meta_path):
        with open(meta_path) as f:
            return json.load(f)
    if c.dataset == "synthetic":  # the default dataset prepares itself, offline
        import prepare_data
        print("preparing the synthetic dataset (python prepare_data.py)", file=sys.stderr)
        prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=c.data_dir))
        return ensure_data(c)
    import prepare_data
    kind = c.dataset if c.dataset in prepare_data.CHOICES["dataset"] else "<" + "|".join(prepare_data.CHOICES["dataset"]) + ">"
    raise UserError(f"dataset {c.dataset!r} is not prepared in {os.path.dirname(meta_path)!r}: run "
                    f"python prepare_data.py --dataset={kind} --name={c.dataset} --data_dir={c.data_dir}")


def load_split(c, split):
    return np.memmap(data_paths(c)[0][split], dtype=np.uint16, mode="r")


def get_batch(data, c, generator, device):
    if len(data) <= c.block_size + 1:
        raise UserError(f"split of {len(data)} tokens is shorter than block_size+1={c.block_size + 1}")
    ix = torch.randint(len(data) - c.block_size - 1, (c.batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + c.block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + c.block_size].astype(np.int64)) for i in ix.tolist()])
    return x.to(device), y.to(device)


def unigram_loss(train, val, vocab_size):
    """Cross-entropy of the train-set unigram distribution (add-one) on val: the baseline to beat."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


# ----------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model, val, c, prior, ctx, device):
    """Fixed-depth val losses, exit statistics at τ = eval_thr, and the regularizers."""
    model.eval()
    g = torch.Generator().manual_seed(c.seed + 1)  # the same eval batches every time
    U = model.config.n_loops
    losses, pis, exits = [], [], []
    for _ in range(c.eval_iters):
        x, y = get_batch(val, c, g, device)
        with ctx:
            out = model(x, y)
        losses.append(out["losses"].float().reshape(-1, U))
        pis.append(exit_pdf(out["gate_logits"]).reshape(-1, U))
        exits.append(threshold_exit(out["gate_logits"], c.eval_thr).reshape(-1))
    losses, pi, e = torch.cat(losses), torch.cat(pis), torch.cat(exits)
    model.train()
    return {
        "val_loss_fixed": [round(float(v), 5) for v in losses.mean(0)],
        "val_loss_exit": round(float(losses.gather(1, (e - 1)[:, None].long()).mean()), 5),
        "avg_exit_depth": round(float(e.float().mean()), 4),
        "exit_fractions": [round(float((e == d).float().mean()), 4) for d in range(1, U + 1)],
        "kl_local": round(float(kl_local(pi, prior)), 5),
        "kl_global": round(float(kl_global(pi, prior)), 5),
    }


# ----------------------------------------------------------------------------- main

def resolve_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device={name!r} but CUDA is not available; use --device=cpu or auto")
    return name


def make_optimizer(model, c, device):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, gate bias
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=c.learning_rate, betas=(c.beta1, c.beta2), fused=fused or None)


def main(argv):
    c = SimpleNamespace(**parse(argv, DEFAULTS, CHOICES))
    if c.beta is not None and (isinstance(c.beta, bool) or not isinstance(c.beta, (int, float)) or c.beta < 0):
        raise UserError(f"--beta={c.beta!r} must be a number >= 0 (or leave it unset for the App. B schedule)")
    if c.prior_lambda is not None and not (isinstance(c.prior_lambda, (int, float)) and c.prior_lambda > 0):
        raise UserError(f"--prior_lambda={c.prior_lambda!r} must be a positive number")
    device = resolve_device(c.device)
    torch.manual_seed(c.seed)
    meta = ensure_data(c)
    train, val = load_split(c, "train"), load_split(c, "val")

    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    data_gen = torch.Generator().manual_seed(c.seed)
    if c.init_from == "resume":
        model, ckpt = load_checkpoint(ckpt_path, device)
        model.train()
        saved = ckpt["config"]
        for k in MODEL_KEYS + ["dataset", "batch_size"]:  # these define the run; keep them
            setattr(c, k, saved[k])
        optimizer = make_optimizer(model, c, device)
        optimizer.load_state_dict(ckpt["optimizer"])
        data_gen.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        iter_num = ckpt["iter_num"]
        print(f"resuming from {ckpt_path} at iter {iter_num}", file=sys.stderr)
    else:
        cfg = GPTConfig(vocab_size=meta["vocab_size"], **{k: getattr(c, k) for k in MODEL_KEYS})
        model = LoopedLM(cfg).to(device)
        optimizer = make_optimizer(model, c, device)
        iter_num = 0
        if os.path.exists(os.path.join(c.out_dir, "log.jsonl")):
            os.remove(os.path.join(c.out_dir, "log.jsonl"))  # a fresh run starts a fresh log
    os.makedirs(c.out_dir, exist_ok=True)

    use_bf16 = c.dtype == "bfloat16" or (c.dtype == "auto" and device.startswith("cuda"))
    ctx = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16) if use_bf16
           else torch.autocast(device_type="cpu", enabled=False))
    fwd = torch.compile(model) if c.compile else model
    prior = exit_prior(c.prior, model.config.n_loops, c.prior_lambda).to(device)
    baseline = unigram_loss(np.asarray(train), np.asarray(val), model.config.vocab_size)
    print(f"model: {model.num_params():,} parameters, L={model.config.n_layer}, U={model.config.n_loops}; "
          f"objective: {'global' if c.global_kl else 'local'} KL to {c.prior} prior; device {device}",
          file=sys.stderr)
    print(f"unigram baseline val loss: {baseline:.4f}", file=sys.stderr)

    def log(record):
        with open(os.path.join(c.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def save(it):
        save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "model_args": model_args(model.config), "iter_num": it, "config": vars(c),
                         "meta": meta, "data_rng": data_gen.get_state(), "torch_rng": torch.get_rng_state()},
                        ckpt_path)

    tokens_per_iter = c.batch_size * c.block_size * c.gradient_accumulation_steps
    last = c.max_iters if c.stop_iter < 0 else min(c.stop_iter, c.max_iters)
    from tqdm import tqdm
    bar = tqdm(total=last, initial=iter_num, desc="train", unit="it", file=sys.stderr, dynamic_ncols=True,
               mininterval=1.0)
    metrics = None
    while True:
        if iter_num % c.eval_interval == 0 or iter_num == last:
            metrics = evaluate(model, val, c, prior, ctx, device)
            record = {"iter": iter_num, "tokens": iter_num * tokens_per_iter, **metrics,
                      "beta": beta_schedule(iter_num / c.max_iters, c.beta), "unigram_loss": round(baseline, 5)}
            log(record)
            bar.write(f"iter {iter_num}: val loss by depth {metrics['val_loss_fixed']}, "
                      f"avg exit depth {metrics['avg_exit_depth']:.2f} (τ={c.eval_thr}), "
                      f"exit fractions {metrics['exit_fractions']}")
            if iter_num > 0 or c.eval_only:
                save(iter_num)
        if iter_num >= last or c.eval_only:
            break
        lr = lr_at(iter_num, c)
        b = beta_schedule(iter_num / c.max_iters, c.beta)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.time()
        for _ in range(c.gradient_accumulation_steps):
            x, y = get_batch(train, c, data_gen, device)
            with ctx:
                out = fwd(x, y)
            loss, expected, reg = dense_loss(out["losses"], out["gate_logits"], prior, c.global_kl, b)
            (loss / c.gradient_accumulation_steps).backward()
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        bar.update(1)
        if iter_num % c.log_interval == 0:
            log({"iter": iter_num, "train_loss": loss.item(), "expected_ce": expected.item(),
                 "reg": reg.item(), "lr": lr, "beta": b, "ms_per_iter": round(1000 * (time.time() - t0), 1)})
            bar.set_postfix(loss=f"{loss.item():.4f}", beta=f"{b:.4f}")
    bar.close()
    best = min(metrics["val_loss_fixed"])
    print(f"val loss (best fixed depth) {best:.4f} vs unigram baseline {baseline:.4f}; "
          f"checkpoint: {ckpt_path}", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    run_cli(main)
