"""
The training objectives (Eq. 9-22): the exit-depth priors, the local and global KL terms, the dense
expected loss, the β schedule, and the ragged-aware steps of App. C (direct, counterfactual,
REINFORCE), as functions of the model, a batch and an `Objective` (what train.py's flags choose).

Dense step (Eq. 9 / Eq. 10):  L = mean_i Σ_d π_i(d) ℓ_{i,d} + β R(π)
  local  (Ouro, Eq. 9):   R = mean_i KL(π_i ‖ prior)
  global (ours, Eq. 10):  R = KL(π̄ ‖ prior), π̄ = mean_i π_i
Ragged-aware training (App. C), ragged_aware with ra_method:
  direct (Eq. 14-16):          even steps dense, odd steps the mean CE at exits sampled from π
  counterfactual (Eq. 17-18):  odd steps: every token privately continued to every depth
  reinforce (Eq. 19-22):       every step: dense + w_rag (direct + α score), K sampled trajectories
"""
import math
from dataclasses import dataclass

import torch

from configurator import UserError
from model import exit_log_pdf, exit_pdf, forward_ragged


@dataclass
class Objective:
    """Which loss the optimizer steps minimise (train.py's flags of the same names)."""
    global_kl: bool = False      # False: local KL per token (Eq. 9, Ouro); True: global KL (Eq. 10)
    # global KL: π̄ over every token of the optimizer step, or over each micro-batch
    kl_scope: str = "step"
    ragged_aware: bool = False   # alternate dense steps with ragged steps (Eq. 16)
    # direct (Eq. 15), counterfactual (Eq. 17-18) or reinforce (Eq. 19-22)
    ra_method: str = "direct"
    cf_thr: float = 0.5          # threshold of the committed rollout in counterfactual steps
    # trajectories per step: 1 (baseline: dense final-depth path) or 4 (leave-one-out)
    reinforce_k: int = 1
    w_rag: float = 1.0           # weight of the ragged terms in the REINFORCE loss (Eq. 22)
    alpha: float = 0.01          # weight of the score term (Eq. 22)


# ----------------------------------------------------------------------------- the dense objective

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
    """KL(p ‖ q) over the last dim, with 0 log 0 = 0 and a finite gradient there. A saturated gate
    makes π(d) underflow to exactly 0, where torch.xlogy(p, p) has the gradient 0/0 = NaN."""
    p_log_p = p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))
    return (p_log_p - p * torch.log(q)).sum(-1)


def kl_local(pi, prior):
    """Eq. 9: mean over tokens of KL(π_i ‖ prior). pi: (N, U)."""
    return kl(pi, prior.to(pi)).mean()


def kl_global(pi, prior):
    """Eq. 10: KL(π̄ ‖ prior) with π̄ the batch-mean exit distribution."""
    return kl(pi.mean(0), prior.to(pi))


def dense_loss(losses, gate_logits, prior, global_kl, beta, valid=None, pi_bar=None):
    """L = mean_i Σ_d π_i(d) ℓ_{i,d} + β R(π)  (Eq. 9 or Eq. 10; Eq. 14 with mask `valid`).
    pi_bar: the global KL's mean exit distribution over the whole optimizer step, when this batch is
    only part of it (--kl_scope=step); None: the mean over this batch.
    Returns the loss, its two parts and the per-token π (detached)."""
    pi = exit_pdf(gate_logits).reshape(-1, gate_logits.shape[-1])
    losses = losses.reshape(-1, losses.shape[-1])
    if valid is not None:
        keep = valid.reshape(-1)
        pi, losses = pi[keep], losses[keep]
    expected = (pi * losses.to(pi.dtype)).sum(-1).mean()
    if not global_kl:
        reg = kl_local(pi, prior)
    elif pi_bar is None:
        reg = kl_global(pi, prior)
    else:
        # Eq. 10 over the step: π̄ mixes every micro-batch, so this batch's share of the gradient is
        # ∂KL(π̄‖p)/∂π̄ = log π̄ - log p + 1 applied to the mean π of its own tokens (the caller
        # divides by the number of micro-batches); the value is the step's KL.
        grad = torch.log(pi_bar.clamp_min(torch.finfo(pi.dtype).tiny)) - torch.log(prior.to(pi)) + 1
        lin = (pi.mean(0) * grad.detach()).sum()
        reg = kl(pi_bar.detach(), prior.to(pi)) + lin - lin.detach()
    return expected + beta * reg, expected, reg, pi.detach()


def beta_schedule(frac, beta=None):
    """App. B: cosine rises 0→0.01 over the first quarter of training, 0.01→0.02 to the half,
    0.02→0.05 to the end (the 5B/10B/20B-token knots as fractions). A number means flat β."""
    if beta is not None:
        return float(beta)
    frac = min(max(frac, 0.0), 1.0)
    for start, end, b0, b1 in [(0.0, 0.25, 0.0, 0.01), (0.25, 0.5, 0.01, 0.02),
                               (0.5, 1.0, 0.02, 0.05)]:
        if frac <= end:
            t = (frac - start) / (end - start)
            return b0 + (b1 - b0) * (1 - math.cos(math.pi * t)) / 2
    return 0.05


# ----------------------------------------------------------------- ragged-aware objectives (App. C)

def step_kind(step, obj):
    """Which objective optimizer step `step` runs (Eq. 16: even steps the dense loss of Eq. 14, odd
    steps the ragged loss of Eq. 15, from forward_ragged with sampled exits)."""
    if not obj.ragged_aware:
        return "dense"
    if obj.ra_method == "reinforce":
        return "reinforce"                     # dense + ragged terms in every step (Eq. 22)
    if step % 2 == 0:
        return "dense"
    return "ragged" if obj.ra_method == "direct" else "counterfactual"


def n_uniforms(obj):
    """How many sampled-exit trajectories a step needs (they are drawn for the global batch)."""
    return obj.reinforce_k if obj.ragged_aware and obj.ra_method == "reinforce" else 1


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


class PrivateKV:
    """Private-diagonal attention of counterfactual training (Eq. 17): over 2S columns
    [committed | candidate], query i reads the committed K/V of tokens j < i (read at
    min(d, ê_j), detached) and only its own candidate K/V at this depth."""

    def __init__(self, committed, depth, n_layer):
        self.committed, self.base = committed, depth * n_layer

    def layer_kv(self, layer, k, v):
        ck, cv = self.committed[self.base + layer]
        T = k.shape[2]
        eye = torch.eye(T, dtype=torch.bool, device=k.device)
        mask = torch.cat([torch.ones_like(eye).tril(-1), eye], dim=1)  # (S, 2S)
        return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2), mask


def forward_counterfactual(model, idx, targets, tau=0.5):
    """Counterfactual training forward (App. C, Eq. 17-18). A detached threshold rollout commits
    one exit ê per token and the K/V history it leaves; then every token is privately continued to
    every depth, attending to the committed states of earlier tokens and only its own candidate
    (PrivateKV). Returns the candidate losses ℓ^CF_{i,d} (B, T, U), their gate logits and ê."""
    history = []
    with torch.no_grad():
        rollout = forward_ragged(model, idx, taus=tau, history=history)
    B, T = idx.shape
    h = model.embed_tokens(idx)
    cos, sin = model.rope(torch.arange(T, device=idx.device), h.dtype)
    gates, losses = [], []
    for d in range(model.config.n_loops):
        h = model.block(h, cos, sin, PrivateKV(history, d, model.config.n_layer))
        hn, gate, h = model.exit_heads(h)
        gates.append(gate)
        losses.append(model.depth_loss(hn, targets))
    return {"losses": torch.stack(losses, -1), "gate_logits": torch.stack(gates, -1),
            "exits": rollout["exits"]}


def reinforce_loss(model, x, y, prior, obj, beta, uniforms, pi_bar=None):
    """Eq. 22: L_dense + w_rag (L_direct + α L_score) over K sampled Ragged-KV trajectories, with
    L_direct of Eq. 19, the suffix returns and advantages of Eq. 20 and the score term of Eq. 21."""
    out = model(x, y)
    loss, expected, reg, pi = dense_loss(out["losses"], out["gate_logits"], prior,
                                         obj.global_kl, beta, pi_bar=pi_bar)
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
    # Eq. 21 (a_i = m_i here)
    score = (rho * A.detach() * mask).sum() / (K * N)
    total = loss + obj.w_rag * (direct + obj.alpha * score)
    return total, {"expected_ce": expected.item(), "reg": reg.item(), "rag_ce": direct.item(),
                   "score": score.item()}, pi


def objective(model, x, y, step, prior, obj, beta, uniforms, pi_bar=None):
    """The loss of one micro-batch at optimizer step `step` (Eq. 16: step_kind says which; a ragged
    step is Eq. 15, the mean loss at exits sampled from π under Ragged KV), numbers to log, and the
    per-token exit distributions π (detached; None in ragged steps, which have no KL term)."""
    kind = step_kind(step, obj)
    if kind == "dense":                                                          # Eq. 9/10/14
        out = model(x, y)
        loss, expected, reg, pi = dense_loss(out["losses"], out["gate_logits"], prior,
                                             obj.global_kl, beta, pi_bar=pi_bar)
        return loss, {"expected_ce": expected.item(), "reg": reg.item()}, pi
    # Eq. 15, no KL term
    if kind == "ragged":
        out = forward_ragged(model, x, y, uniforms=uniforms[0])
        parts = {"rag_ce": out["loss"].item(),
                 "avg_sampled_depth": out["exits"].float().mean().item()}
        return out["loss"], parts, None
    if kind == "counterfactual":                                                 # Eq. 18
        out = forward_counterfactual(model, x, y, obj.cf_thr)
        loss, expected, reg, pi = dense_loss(out["losses"], out["gate_logits"], prior,
                                             obj.global_kl, beta, pi_bar=pi_bar)
        return loss, {"cf_ce": expected.item(), "reg": reg.item()}, pi
    return reinforce_loss(model, x, y, prior, obj, beta, uniforms, pi_bar)


@torch.no_grad()
def step_mean_pi(model, batches, kind, obj, world):
    """π̄ over every token of an optimizer step (Eq. 10 at --kl_scope=step): a forward pass without
    gradient of each of this process's micro-batches, summed over all processes. The KL term is not
    linear in π̄, so every micro-batch needs the step's π̄ before its own backward pass."""
    total = 0
    for x, y, _ in batches:
        g = (forward_counterfactual(model, x, y, obj.cf_thr) if kind == "counterfactual"
             else model(x))["gate_logits"]
        pi = exit_pdf(g).reshape(-1, g.shape[-1])
        total = total + torch.cat([pi.sum(0), pi.new_tensor([pi.shape[0]])])
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(total)
    return total[:-1] / total[-1]


def train_step(model, batches, step, prior, obj, beta, ctx, n_micro, world):
    """Forward and backward of this process's share `batches` [(x, y, uniforms)] of optimizer step
    `step` (n_micro micro-batches over all processes). Gradients accumulate in .grad and are summed
    over processes. Returns the step's mean loss, its parts (averaged over this process's
    micro-batches) and KL(π̄ ‖ prior) over every token of the step (None in ragged steps)."""
    kind = step_kind(step, obj)
    pi_bar = None
    if obj.global_kl and obj.kl_scope == "step" and n_micro > 1 and kind != "ragged":
        with ctx:
            pi_bar = step_mean_pi(model, batches, kind, obj, world)
    params = [p for p in model.parameters() if p.requires_grad]
    # [loss sum, Σ_i π_i (U values), token count]
    stats = 0
    parts = {}
    for x, y, u in batches:
        with ctx:
            loss, p, pi = objective(model, x, y, step, prior, obj, beta, u, pi_bar)
        (loss / n_micro).backward()
        U = prior.numel()
        pis = torch.zeros(U + 1, dtype=torch.float64, device=x.device) if pi is None else \
            torch.cat([pi.sum(0).double(), pi.new_tensor([pi.shape[0]], dtype=torch.float64)])
        stats = stats + torch.cat([loss.detach().double().reshape(1), pis])
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + v / len(batches)
    if world > 1:  # data parallel: sum gradients (already divided by the global micro-batch count)
        all_reduce_sum([p.grad for p in params if p.grad is not None] + [stats])
    kl_step = float(kl(stats[1:-1] / stats[-1], prior.to(stats))) if stats[-1] > 0 else None
    return float(stats[0]) / n_micro, parts, kl_step


def all_reduce_sum(tensors):
    """Sum a list of tensors over all ranks in one flat all-reduce (data-parallel gradients)."""
    import torch.distributed as dist
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python train.py trains with them")
