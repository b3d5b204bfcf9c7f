"""
Train a looped LM with an exit-prior objective (paper §4, App. B).

    python train.py                                   # small model on synthetic data, a few CPU minutes
    python train.py --prior=geometric --global_kl     # global prior enforcement (Eq. 10)
    python train.py config/shakespeare_char.py --max_iters=2000
    python train.py --init_from=resume                # continue out_dir/ckpt.pt exactly

    python train.py --global_kl --ragged_aware        # alternate dense and sampled-ragged steps (§5)
    torchrun --standalone --nproc_per_node=2 train.py # data parallel (gloo on CPU, nccl on CUDA)

Dense step (Eq. 9 / Eq. 10):  L = mean_i Σ_d π_i(d) ℓ_{i,d} + β R(π)
  local  (Ouro, Eq. 9):   R = mean_i KL(π_i ‖ prior)
  global (ours, Eq. 10):  R = KL(π̄ ‖ prior), π̄ = mean_i π_i
Ragged-aware training (App. C), --ragged_aware with --ra_method:
  direct (Eq. 14-16):          even steps dense, odd steps the mean CE at exits sampled from π
  counterfactual (Eq. 17-18):  odd steps: every token privately continued to every depth
  reinforce (Eq. 19-22):       every step: dense + w_rag (direct + α score), K sampled trajectories
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
from model import (GPTConfig, LoopedLM, UserError, exit_log_pdf, exit_pdf, forward_counterfactual,
                   forward_ragged, load_checkpoint, model_args, save_checkpoint)

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
eval_thr = "0.5"            # τ list (comma-separated) for the ragged val loss; the first also gives the exit stats
# ragged-aware training (App. C)
ragged_aware = False        # alternate dense steps with ragged steps
ra_method = "direct"        # direct | counterfactual | reinforce
cf_thr = 0.5                # threshold of the committed rollout in counterfactual steps
reinforce_k = 1             # trajectories per step: 1 (baseline: dense final-depth path) or 4 (leave-one-out)
w_rag = 1.0                 # weight of the ragged terms in the REINFORCE loss (Eq. 22)
alpha = 0.01                # weight of the score term (Eq. 22); the paper gives no value
# optimizer
learning_rate = 1e-3
max_iters = 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 50
lr_decay_start = -1         # cosine decay starts here (-1: right after warmup); App. B: at 1B tokens
lr_decay_iters = -1         # -1: max_iters
min_lr = 1e-4
# system
device = "auto"             # auto | cpu | cuda | cuda:N | mps
dtype = "auto"              # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
compile = False
backend = ""                # torchrun: "" = nccl on CUDA, gloo on CPU
seed = 1337

DEFAULTS = {k: v for k, v in dict(globals()).items()
            if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}
CHOICES = dict(init_from=["scratch", "resume"], prior=["uniform", "geometric", "poisson"],
               dtype=["auto", "float32", "bfloat16"], ra_method=["direct", "counterfactual", "reinforce"],
               reinforce_k=[1, 4])
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
    start = c.lr_decay_start if c.lr_decay_start >= 0 else c.warmup_iters
    if it < start:
        return c.learning_rate
    if it >= decay_iters:
        return c.min_lr
    ratio = (it - start) / max(decay_iters - start, 1)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


# ----------------------------------------------------------------------------- ragged-aware objectives

def step_kind(step, c):
    """Which objective optimizer step `step` runs (Eq. 16: even dense, odd ragged)."""
    if not c.ragged_aware:
        return "dense"
    if c.ra_method == "reinforce":
        return "reinforce"                     # dense + ragged terms in every step (Eq. 22)
    if step % 2 == 0:
        return "dense"
    return "ragged" if c.ra_method == "direct" else "counterfactual"


def n_uniforms(c):
    """How many sampled-exit trajectories a step needs (they are drawn for the global batch)."""
    return c.reinforce_k if c.ragged_aware and c.ra_method == "reinforce" else 1


def suffix_returns(token_loss, mask):
    """Eq. 20: G_i = Σ_{j>=i} m_j ℓ_j within each sequence (last dim = position)."""
    x = (token_loss * mask).flip(-1)
    return x.cumsum(-1).flip(-1)


def reinforce_advantages(G, dense_final_loss, mask):
    """Eq. 20 baselines (App. C). G: (K, B, T). K = 1: b = the detached suffix loss of the dense
    final-depth path; K > 1: b_k = mean of the other K-1 trajectories' returns."""
    K = G.shape[0]
    if K == 1:
        b = suffix_returns(dense_final_loss.detach(), mask)[None]
    else:
        b = (G.sum(0, keepdim=True) - G) / (K - 1)
    return G - b


def reinforce_loss(model, x, y, prior, c, beta, uniforms):
    """Eq. 22: L_dense + w_rag (L_direct + α L_score) over K sampled Ragged-KV trajectories."""
    out = model(x, y)
    loss, expected, reg = dense_loss(out["losses"], out["gate_logits"], prior, c.global_kl, beta)
    mask = (y != -1).to(out["losses"].dtype)
    N = mask.sum().clamp(min=1)
    tok, rho = [], []
    for u in uniforms:  # K trajectories, exits sampled online from the current π (detached)
        r = forward_ragged(model, x, y, uniforms=u)
        tok.append(r["token_loss"])
        # ρ = log π_k(ê), connected to the gates of this trajectory's own states
        rho.append(exit_log_pdf(r["gate_logits"]).gather(-1, (r["exits"] - 1)[..., None])[..., 0])
    tok, rho = torch.stack(tok), torch.stack(rho)
    K = len(uniforms)
    direct = (tok * mask).sum() / (K * N)                                        # Eq. 19
    A = reinforce_advantages(suffix_returns(tok.detach(), mask), out["losses"][..., -1], mask)
    score = (rho * A.detach() * mask).sum() / (K * N)                            # Eq. 21 (a_i = m_i here)
    total = loss + c.w_rag * (direct + c.alpha * score)
    return total, {"expected_ce": expected.item(), "reg": reg.item(), "rag_ce": direct.item(),
                   "score": score.item()}


def objective(model, x, y, step, prior, c, beta, uniforms):
    """The loss of one micro-batch at optimizer step `step`, and numbers to log."""
    kind = step_kind(step, c)
    if kind == "dense":                                                          # Eq. 9/10/14
        out = model(x, y)
        loss, expected, reg = dense_loss(out["losses"], out["gate_logits"], prior, c.global_kl, beta)
        return loss, {"expected_ce": expected.item(), "reg": reg.item()}
    if kind == "ragged":                                                         # Eq. 15, no KL term
        out = forward_ragged(model, x, y, uniforms=uniforms[0])
        return out["loss"], {"rag_ce": out["loss"].item(), "avg_sampled_depth": out["exits"].float().mean().item()}
    if kind == "counterfactual":                                                 # Eq. 18
        out = forward_counterfactual(model, x, y, c.cf_thr)
        loss, expected, reg = dense_loss(out["losses"], out["gate_logits"], prior, c.global_kl, beta)
        return loss, {"cf_ce": expected.item(), "reg": reg.item()}
    return reinforce_loss(model, x, y, prior, c, beta, uniforms)


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


def draw_starts(data, c, n, generator):
    if len(data) <= c.block_size + 1:
        raise UserError(f"split of {len(data)} tokens is shorter than block_size+1={c.block_size + 1}")
    return torch.randint(len(data) - c.block_size - 1, (n,), generator=generator).tolist()


def windows(data, starts, T, offset=0):
    return torch.stack([torch.from_numpy(data[i + offset:i + offset + T].astype(np.int64)) for i in starts])


def get_batch(data, c, starts, device):
    x, y = windows(data, starts, c.block_size), windows(data, starts, c.block_size, 1)
    return x.to(device), y.to(device)


def unigram_loss(train, val, vocab_size):
    """Cross-entropy of the train-set unigram distribution (add-one) on val: the baseline to beat."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


# ----------------------------------------------------------------------------- eval

def spearman(a, b):
    """Spearman's rank correlation with average ranks for ties."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def eval_thresholds(c):
    try:
        thrs = [float(t) for t in str(c.eval_thr).split(",") if t.strip()]
    except ValueError:
        thrs = []
    if not thrs or not all(0 <= t <= 1 for t in thrs):
        raise UserError(f"--eval_thr={c.eval_thr!r}: expected comma-separated thresholds in [0, 1]")
    return thrs


@torch.no_grad()
def evaluate(model, val, labels, c, prior, ctx, device):
    """Fixed-depth and ragged (ETE-Ragged, teacher-forced) val losses, exit statistics at the first
    eval threshold, the KL of the batch-mean exit distribution, and on synthetic data the exit
    depth by difficulty (the depth at position i paired with the label of token i+1)."""
    model.eval()
    g = torch.Generator().manual_seed(c.seed + 1)  # the same eval batches every time
    U = model.config.n_loops
    thrs = eval_thresholds(c)
    fixed, pis, ragged, exits, diffs = [], [], {t: [] for t in thrs}, [], []
    for _ in range(c.eval_iters):
        starts = draw_starts(val, c, c.batch_size, g)
        x, y = get_batch(val, c, starts, device)
        with ctx:
            out = model(x, y)
            for t in thrs:
                r = forward_ragged(model, x, y, taus=t)
                ragged[t].append(float(r["loss"]))
                if t == thrs[0]:
                    exits.append(r["exits"].cpu())
        fixed.append(out["losses"].float().reshape(-1, U).mean(0))
        pis.append(exit_pdf(out["gate_logits"]).reshape(-1, U))
        if labels is not None:
            diffs.append(windows(labels, starts, c.block_size, 1))
    model.train()
    e = torch.cat(exits)                                    # (batches*B, T)
    jumps = (e[:, 1:] - e[:, :-1]).abs().reshape(-1)
    jr = [float((jumps == k).double().mean()) for k in range(U)]
    pi = torch.cat(pis)
    r = lambda v: round(float(v), 5)
    metrics = {
        "val_loss_fixed": [r(v) for v in torch.stack(fixed).mean(0)],
        "val_loss_ragged": {str(t): r(np.mean(v)) for t, v in ragged.items()},
        "avg_exit_depth": r(e.double().mean()),
        "exit_fractions": [r((e == d).double().mean()) for d in range(1, U + 1)],
        "jump_rates": [r(v) for v in jr],
        "large_jump_rate": r(sum(jr[2:])),
        "kl_global": r(kl_global(pi, prior)),
        "kl_local": r(kl_local(pi, prior)),
    }
    if diffs:
        d = torch.cat(diffs).reshape(-1).numpy()
        ev = e.reshape(-1).numpy()
        metrics["depth_by_difficulty"] = {str(k): (r(ev[d == k].mean()) if (d == k).any() else None)
                                          for k in range(0, 5)}
        lab = d > 0
        rho = spearman(ev[lab], d[lab])
        metrics["difficulty_spearman"] = None if math.isnan(rho) else r(rho)
    return metrics


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


def all_reduce_sum(tensors):
    """Sum a list of tensors over all ranks in one flat all-reduce (data-parallel gradients)."""
    import torch.distributed as dist
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def main(argv):
    c = SimpleNamespace(**parse(argv, DEFAULTS, CHOICES))
    if c.beta is not None and (isinstance(c.beta, bool) or not isinstance(c.beta, (int, float)) or c.beta < 0):
        raise UserError(f"--beta={c.beta!r} must be a number >= 0 (or leave it unset for the App. B schedule)")
    if c.prior_lambda is not None and not (isinstance(c.prior_lambda, (int, float)) and c.prior_lambda > 0):
        raise UserError(f"--prior_lambda={c.prior_lambda!r} must be a positive number")
    eval_thresholds(c)
    rank, world, device = setup_distributed(c)
    master = rank == 0
    if c.gradient_accumulation_steps % world:
        raise UserError(f"gradient_accumulation_steps={c.gradient_accumulation_steps} must be a multiple of "
                        f"the {world} processes (each runs its share of the global batch)")
    torch.manual_seed(c.seed)
    meta = ensure_data(c) if master else None
    if world > 1:
        import torch.distributed as dist
        box = [meta]
        dist.broadcast_object_list(box)  # rank 0 may have just prepared the data
        meta = box[0]
    train, val = load_split(c, "train"), load_split(c, "val")
    label_path = os.path.join(c.data_dir, c.dataset, "val_labels.bin")
    labels = np.memmap(label_path, dtype=np.uint8, mode="r") if os.path.isfile(label_path) else None

    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    data_gen = torch.Generator().manual_seed(c.seed)       # batches: the same on every rank
    exit_gen = torch.Generator().manual_seed(c.seed + 2)   # sampled exits of ragged steps
    if c.init_from == "resume":
        model, ckpt = load_checkpoint(ckpt_path, device)
        model.train()
        saved = ckpt["config"]
        for k in MODEL_KEYS + ["dataset", "batch_size"]:  # these define the run; keep them
            setattr(c, k, saved[k])
        optimizer = make_optimizer(model, c, device)
        optimizer.load_state_dict(ckpt["optimizer"])
        data_gen.set_state(ckpt["data_rng"])
        exit_gen.set_state(ckpt["exit_rng"])
        iter_num = ckpt["iter_num"]
        if master:
            print(f"resuming from {ckpt_path} at iter {iter_num}", file=sys.stderr)
    else:
        cfg = GPTConfig(vocab_size=meta["vocab_size"], **{k: getattr(c, k) for k in MODEL_KEYS})
        model = LoopedLM(cfg).to(device)
        optimizer = make_optimizer(model, c, device)
        iter_num = 0
        if master and os.path.exists(os.path.join(c.out_dir, "log.jsonl")):
            os.remove(os.path.join(c.out_dir, "log.jsonl"))  # a fresh run starts a fresh log
    if master:
        os.makedirs(c.out_dir, exist_ok=True)

    use_bf16 = c.dtype == "bfloat16" or (c.dtype == "auto" and device.startswith("cuda"))
    ctx = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16) if use_bf16
           else torch.autocast(device_type="cpu", enabled=False))
    fwd = torch.compile(model) if c.compile else model
    U = model.config.n_loops
    prior = exit_prior(c.prior, U, c.prior_lambda).to(device)
    baseline = unigram_loss(np.asarray(train), np.asarray(val), model.config.vocab_size)
    objective_name = f"{'global' if c.global_kl else 'local'} KL to {c.prior} prior" + (
        f", ragged-aware ({c.ra_method})" if c.ragged_aware else "")
    if master:
        print(f"model: {model.num_params():,} parameters, L={model.config.n_layer}, U={U}; "
              f"objective: {objective_name}; device {device}, {world} process(es)", file=sys.stderr)
        print(f"unigram baseline val loss: {baseline:.4f}", file=sys.stderr)

    def log(record):
        if master:
            with open(os.path.join(c.out_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def save(it):
        if master:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "model_args": model_args(model.config), "iter_num": it, "config": vars(c),
                             "meta": meta, "data_rng": data_gen.get_state(), "exit_rng": exit_gen.get_state()},
                            ckpt_path)

    n_micro = c.gradient_accumulation_steps           # micro-batches per optimizer step, all ranks together
    mine = range(rank * n_micro // world, (rank + 1) * n_micro // world)
    B, T = c.batch_size, c.block_size
    tokens_per_iter = B * T * n_micro
    last = c.max_iters if c.stop_iter < 0 else min(c.stop_iter, c.max_iters)
    from tqdm import tqdm
    bar = tqdm(total=last, initial=iter_num, desc="train", unit="it", file=sys.stderr, dynamic_ncols=True,
               mininterval=1.0, disable=not master)
    metrics = None
    while True:
        if iter_num % c.eval_interval == 0 or iter_num == last:
            metrics = evaluate(model, val, labels, c, prior, ctx, device)
            record = {"iter": iter_num, "tokens": iter_num * tokens_per_iter, **metrics,
                      "beta": beta_schedule(iter_num / c.max_iters, c.beta), "unigram_loss": round(baseline, 5)}
            log(record)
            if master:
                bar.write(f"iter {iter_num}: val loss fixed@1..{U} {metrics['val_loss_fixed']}, ragged "
                          f"{metrics['val_loss_ragged']}; avg exit depth {metrics['avg_exit_depth']:.2f}, "
                          f"fractions {metrics['exit_fractions']}, large jumps {metrics['large_jump_rate']:.3f}")
            if iter_num > 0 or c.eval_only:
                save(iter_num)
        if iter_num >= last or c.eval_only:
            break
        lr = lr_at(iter_num, c)
        b = beta_schedule(iter_num / c.max_iters, c.beta)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.time()
        # The global batch is drawn identically on every rank; each rank runs its share of it.
        starts = draw_starts(train, c, B * n_micro, data_gen)
        kind = step_kind(iter_num, c)
        uniforms = (torch.rand(n_uniforms(c), B * n_micro, T, U, generator=exit_gen)
                    if kind in ("ragged", "reinforce") else None)
        loss_sum = torch.zeros((), device=device)
        for m in mine:
            x, y = get_batch(train, c, starts[m * B:(m + 1) * B], device)
            u = None if uniforms is None else uniforms[:, m * B:(m + 1) * B].to(device)
            with ctx:
                loss, parts = objective(fwd, x, y, iter_num, prior, c, b, u)
            (loss / n_micro).backward()
            loss_sum += loss.detach().float()
        if world > 1:  # data parallel: sum gradients (already divided by the global micro-batch count)
            all_reduce_sum([p.grad for p in model.parameters() if p.grad is not None] + [loss_sum])
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        bar.update(1)
        if iter_num % c.log_interval == 0:
            train_loss = loss_sum.item() / n_micro
            log({"iter": iter_num, "step": kind, "train_loss": train_loss, **parts, "lr": lr, "beta": b,
                 "ms_per_iter": round(1000 * (time.time() - t0), 1)})
            bar.set_postfix(loss=f"{train_loss:.4f}", beta=f"{b:.4f}")
    bar.close()
    if master:
        print(f"val loss (best fixed depth) {min(metrics['val_loss_fixed']):.4f}, ragged "
              f"{metrics['val_loss_ragged']} vs unigram baseline {baseline:.4f}; checkpoint: {ckpt_path}",
              file=sys.stderr)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    run_cli(main)
