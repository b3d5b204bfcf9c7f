"""
What a training run measures on held-out windows (§4.1, App. B): the loss at every fixed depth and of
ETE-Ragged at each threshold τ, exit fractions and jump rates, the KL of the mean exit distribution
to the prior, and on labelled data the exit depth by difficulty with Spearman's ρ; and the batches
of windows that train.py and these measurements draw.
"""
import math

import numpy as np
import torch

from configurator import UserError, split_list
from model import exit_pdf, exit_stats, forward_ragged
from objectives import kl_global, kl_local

# ----------------------------------------------------------------------------- windows

def draw_starts(data, c, n, generator):
    return torch.randint(len(data) - c.block_size - 1, (n,), generator=generator).tolist()


def windows(data, starts, T, offset=0):
    return torch.stack([torch.from_numpy(data[i + offset:i + offset + T].astype(np.int64))
                        for i in starts])


def get_batch(data, c, starts, device):
    x, y = windows(data, starts, c.block_size), windows(data, starts, c.block_size, 1)
    return x.to(device), y.to(device)


CHUNK = 1 << 22         # ids a pass over a split reads at a time (32 MB as int64)


def chunks(ids):
    """A split's ids in chunks of CHUNK, read from its file where it is one (np.memmap): a memory
    map's pages, once read, would stay in the process's memory, so a pass over the whole split
    would make it as large as the data."""
    path = getattr(ids, "filename", None)
    if path is None:
        yield from (ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK))
        return
    with open(path, "rb") as f:
        f.seek(ids.offset)
        while len(part := np.fromfile(f, dtype=ids.dtype, count=CHUNK)):
            yield part


def unigram_loss(train, val, vocab_size):
    """Cross-entropy of the train-set unigram distribution (add-one) on val: the baseline to beat.
    The splits are read in chunks, so that memory does not grow with the data."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for part in chunks(train):
        counts += np.bincount(part, minlength=vocab_size)
    logp = np.log(counts / counts.sum())
    return float(-sum(logp[part].sum() for part in chunks(val)) / len(val))


# ----------------------------------------------------------------------------- measurements

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
    """--eval_thr's values, in order, each once (checked by RULES; a value given twice is refused)."""
    thrs = split_list("eval_thr", c.eval_thr, float)
    if len(set(thrs)) != len(thrs):
        raise UserError(f"--eval_thr={c.eval_thr}: a threshold given twice; give each once")
    return thrs


@torch.no_grad()
def evaluate(model, val, labels, c, prior, ctx, device, item_labels=None):
    """Fixed-depth and ragged (ETE-Ragged, teacher-forced) val losses, exit statistics at the first
    eval threshold, the KL of the batch-mean exit distribution, how far each loop moves the state
    (loop_shift, relative, mean over tokens), and on synthetic data the exit
    depth by difficulty (the depth at position i paired with the label of token i+1) and its
    Spearman correlation, at the first threshold and at each (`*_by_thr`); with item labels (the
    pointer dataset) also the mean depth over the whole span of items of each difficulty, since the
    work an answer needs may sit anywhere in its item."""
    model.eval()
    g = torch.Generator().manual_seed(c.seed + 1)  # the same eval batches every time
    U = model.config.n_loops
    thrs = eval_thresholds(c)
    fixed, shifts, pis, ragged, diffs, spans = [], [], [], {t: [] for t in thrs}, [], []
    depth, exits = {t: [] for t in thrs}, {t: [] for t in thrs}
    for _ in range(c.eval_iters):
        starts = draw_starts(val, c, c.batch_size, g)
        x, y = get_batch(val, c, starts, device)
        with ctx:
            out = model(x, y, loop_shift=True)
            for t in thrs:
                r = forward_ragged(model, x, y, taus=t)
                ragged[t].append(float(r["loss"]))
                depth[t].append(float(r["exits"].double().mean()))
                exits[t].append(r["exits"].cpu())
        fixed.append(out["losses"].float().reshape(-1, U).mean(0))
        shifts.append(out["loop_shift"].reshape(-1, U).mean(0))
        pis.append(exit_pdf(out["gate_logits"]).reshape(-1, U))
        if labels is not None:
            diffs.append(windows(labels, starts, c.block_size, 1))
        if item_labels is not None:
            spans.append(windows(item_labels, starts, c.block_size, 1))
    model.train()
    exits = {t: torch.cat(v) for t, v in exits.items()}      # (batches*B, T) per threshold
    metrics = summary(fixed, ragged, depth, exits[thrs[0]], torch.cat(pis), shifts, prior, U)
    metrics.update(by_difficulty(exits, diffs, spans, thrs))
    return metrics


def summary(fixed, ragged, depth, e, pi, shifts, prior, U):
    """evaluate's numbers, rounded: the losses and depths, the exit statistics of the first threshold
    (jumps within each sequence), both KLs to the prior, each loop's shift."""
    stats = exit_stats(e, U)
    r = lambda v: round(float(v), 5)
    return {"val_loss_fixed": [r(v) for v in torch.stack(fixed).mean(0)],
            "val_loss_ragged": {str(t): r(np.mean(v)) for t, v in ragged.items()},
            "ragged_depth": {str(t): r(np.mean(v)) for t, v in depth.items()},
            "avg_exit_depth": r(e.double().mean()),
            "exit_fractions": [r(v) for v in stats["exit_fractions"]],
            "jump_rates": [r(v) for v in stats["jump_rates"]],
            "large_jump_rate": r(stats["large_jump_rate"]),
            "kl_global": r(kl_global(pi, prior)), "kl_local": r(kl_local(pi, prior)),
            "loop_shift": [r(v) for v in torch.stack(shifts).mean(0)]}


def by_difficulty(exits, diffs, spans, thrs):
    """The exit depths {τ: (windows, T)} against the difficulty labels of their tokens (diffs: the
    label of the token each position predicts) or of their items (spans): mean depth per label at
    the first τ, and Spearman's ρ (tokens) or the mean depth per label (items) at every τ."""
    flat = {t: ev.reshape(-1).numpy() for t, ev in exits.items()}
    r = lambda v: round(float(v), 5)
    mean_by = lambda ev, d, ks: {str(k): (r(ev[d == k].mean()) if (d == k).any() else None)
                                 for k in ks}
    out = {}
    if diffs:
        d = torch.cat(diffs).reshape(-1).numpy()
        rho = {t: spearman(ev[d > 0], d[d > 0]) for t, ev in flat.items()}
        rho = {t: None if math.isnan(v) else r(v) for t, v in rho.items()}
        out["depth_by_difficulty"] = mean_by(flat[thrs[0]], d, range(0, 5))
        out["difficulty_spearman"] = rho[thrs[0]]
        out["difficulty_spearman_by_thr"] = {str(t): v for t, v in rho.items()}
    if spans:
        d = torch.cat(spans).reshape(-1).numpy()
        out["span_depth_by_difficulty"] = mean_by(flat[thrs[0]], d, range(1, 5))
        out["span_depth_by_thr"] = {str(t): mean_by(ev, d, range(1, 5)) for t, ev in flat.items()}
    return out


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python train.py evaluates with it")
