"""
The looped language model (Ouro-style): one block of L layers applied U times, an exit gate
after every loop, and the exit rules of the paper (Eq. 3, Eq. 4).

Read top to bottom: config, the layer, the looped model and its dense forward, exit maths,
generation on Ouro's dense lanes (the recompute oracle and the cached Ouro-mode decode), Ragged KV
(the dense-shaped forward of Eq. 7, the oracle of the paged engine in serve_depthbatch.py and the
training path; the counterfactual forward), our checkpoints, and Ouro Hugging Face folders.
Equation numbers refer to ../shared/paper/ragged-kv-paper.txt.
"""
import json
import math
import os
import tempfile
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def at_least_fp32(dtype):
    """Exit maths, norms and cross-entropy never run in bf16: fp32, or fp64 in float64 tests."""
    return torch.promote_types(dtype, torch.float32)


def token_ce(logits, targets):
    """Per-token next-token cross-entropy in >= fp32; 0 where the target is -1."""
    logits = logits.to(at_least_fp32(logits.dtype))
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                           reduction="none")
    return loss.view(targets.shape)


class UserError(Exception):
    """A mistake in what the user asked for. CLIs print it as one line and exit with code 2."""


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 256        # context length
    n_layer: int = 2             # L: layers in the looped block
    n_head: int = 4
    n_kv_head: int = 4           # < n_head for grouped-query attention
    n_embd: int = 128
    ffn_hidden: int = 352        # SwiGLU inner size
    n_loops: int = 4             # U: how many times the block is applied
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    loop_norm: bool = False      # pass norm(h) to the next loop (Ouro: True; our default, App. B: False)
    branch_norm_init: float = 0.02  # initial gain of the in-branch norms (*_2), App. B

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def check(self):
        """Shapes that must fit together; each message names the keys (train.py's flags)."""
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "n_loops"):
            if getattr(self, key) < 1:
                raise UserError(f"--{key}={getattr(self, key)}: must be >= 1")
        if self.n_embd % self.n_head:
            raise UserError(f"--n_embd={self.n_embd}: must be a multiple of --n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise UserError(f"--n_kv_head={self.n_kv_head}: must divide --n_head={self.n_head}")
        if self.head_dim % 2:
            raise UserError(f"--n_embd={self.n_embd}: head_dim = n_embd / n_head = {self.head_dim} must be even for RoPE")


# ----------------------------------------------------------------------------- the layer

class RMSNorm(nn.Module):
    """Ouro's RMSNorm: variance in (at least) fp32, then a plain `weight * x`."""

    def __init__(self, dim, eps, init=1.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x):
        xf = x.to(at_least_fp32(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """cos/sin tables for the given (any-shaped) integer positions; trailing dim = head_dim."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)  # NeoX layout: the two halves share frequencies
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: (B, H, T, D); cos/sin: (T, D) or (B, T, D). NeoX-style rotate_half."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention(q, k, v, mask=None):
    """Scaled dot-product attention, causal unless a mask is given. q (B, Hq, T, D); k, v (B, Hkv, S, D):
    with grouped-query attention each K/V head serves Hq/Hkv query heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def forward(self, x, cos, sin, kv=None):
        """kv: None for plain causal self-attention, or a function (q, k, v) -> output through which
        a cache stores this step's K/V and attends over what the queries may read."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention(q, k, v) if kv is None else kv(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Layer(nn.Module):
    """The Ouro layer: four RMSNorms ("sandwich"), attention and SwiGLU, no biases."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.input_layernorm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.branch_norm_init)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.branch_norm_init)

    def forward(self, h, cos, sin, kv=None):
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin, kv))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


# ----------------------------------------------------------------------------- the looped model

class LoopedLM(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.check()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.early_exit_gate = nn.Linear(cfg.n_embd, 1, bias=True)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied, as Ouro
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def block(self, h, cos, sin, cache=None):
        """One application of the shared block B_θ (Eq. 1). `cache`, if given, either stores and
        serves K/V (layer_kv(layer_index, k, v) -> keys, values, mask), or runs the attention of
        many rows itself (attend(layer_index, q, k, v) -> output: the engine's paged rows)."""
        for i, layer in enumerate(self.layers):
            if cache is None:
                kv = None
            elif hasattr(cache, "attend"):
                kv = (lambda q, k, v, i=i: cache.attend(i, q, k, v))
            else:
                kv = (lambda q, k, v, i=i: attention(q, *cache.layer_kv(i, k, v)))
            h = layer(h, cos, sin, kv)
        return h

    def exit_heads(self, h):
        """After a loop: the normed state, read by the LM head and the gate (Eq. 2), and the
        state passed to the next loop (normed in Ouro, raw in our from-scratch default)."""
        hn = self.norm(h)
        gate = self.early_exit_gate(hn).squeeze(-1)
        gate = gate.to(at_least_fp32(gate.dtype))  # exit maths never in bf16
        return hn, gate, (hn if self.config.loop_norm else h)

    def depth_loss(self, hn, targets):
        """ℓ_{i,d} at one depth. While training, the logits are recomputed in the backward pass
        (checkpointing), so at most one full-vocabulary logits tensor is alive at a time."""
        if torch.is_grad_enabled():
            return checkpoint(lambda x: token_ce(self.lm_head(x), targets), hn, use_reentrant=False)
        return token_ce(self.lm_head(hn), targets)

    def forward(self, idx, targets=None, keep_logits=False):
        """Dense forward through all U depths (how Ouro trains: every token runs every loop).

        Returns a dict with
          gate_logits (B, T, U) fp32,
          losses      (B, T, U): ℓ_{i,d}, next-token loss of every token at every depth (if targets),
          logits      list of U tensors (B, T, V) (only if keep_logits).
        During training each depth's logits are recomputed in the backward pass
        (checkpointing), so at most one full-vocabulary logits tensor is alive at a time.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise UserError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        h = self.embed_tokens(idx)
        cos, sin = self.rope(torch.arange(T, device=idx.device), h.dtype)
        gates, losses, logits = [], [], []
        for _ in range(self.config.n_loops):
            h = self.block(h, cos, sin)
            hn, gate, h = self.exit_heads(h)
            gates.append(gate)
            if targets is not None:
                losses.append(self.depth_loss(hn, targets))
            if keep_logits:
                logits.append(self.lm_head(hn))
        out = {"gate_logits": torch.stack(gates, -1)}
        if targets is not None:
            out["losses"] = torch.stack(losses, -1)
        if keep_logits:
            out["logits"] = logits
        return out


# ----------------------------------------------------------------------------- exits (Eq. 2-4)

def _prob_dtype(x):
    return at_least_fp32(x.dtype)


def exit_pdf(gate_logits):
    """Eq. 3: π(d) = λ_d Π_{r<d}(1-λ_r) for d < U, π(U) = Π_{r<U}(1-λ_r). Last dim = depth."""
    lam = torch.sigmoid(gate_logits.to(_prob_dtype(gate_logits)))  # Eq. 2, never in bf16
    survive = torch.cumprod(1 - lam, dim=-1)                        # Π_{r<=d}(1-λ_r)
    before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    pdf = lam * before
    return torch.cat([pdf[..., :-1], before[..., -1:]], dim=-1)     # the last depth takes the rest


def exit_log_pdf(gate_logits):
    """log π(d) of Eq. 3 in log space: log λ_d + Σ_{r<d} log(1-λ_r); the last depth takes the rest."""
    g = gate_logits.to(_prob_dtype(gate_logits))
    log_stay = F.logsigmoid(-g)                                     # log(1-λ)
    before = torch.cumsum(log_stay, -1) - log_stay                  # Σ_{r<d} log(1-λ_r)
    out = F.logsigmoid(g) + before
    return torch.cat([out[..., :-1], before[..., -1:]], dim=-1)


def exit_cdf(gate_logits):
    """CDF(d) = Σ_{r<=d} π(r) = 1 - Π_{r<=d}(1-λ_r); the last depth is forced to 1."""
    lam = torch.sigmoid(gate_logits.to(_prob_dtype(gate_logits)))
    cdf = 1 - torch.cumprod(1 - lam, dim=-1)
    cdf[..., -1] = 1.0
    return cdf


def threshold_exit(gate_logits, tau):
    """Eq. 4: e = min{d : CDF(d) >= τ}, 1-based; depth U always exits. Depends on gates <= e only."""
    hit = exit_cdf(gate_logits) >= tau
    hit[..., -1] = True
    return hit.to(torch.int8).argmax(dim=-1) + 1


def exit_now(survive, gate_logit, tau):
    """Online form of Eq. 4 at one depth: update Π(1-λ) with this depth's gate and say who exits.
    Uses the same float operations as exit_cdf, so online and batch decisions agree exactly."""
    survive = survive * (1 - torch.sigmoid(gate_logit.to(survive.dtype)))
    return survive, (1 - survive) >= tau


def sample_exit(gate_logits, generator=None):
    """Sampled exit (§5): at depth d exit with probability λ_d, i.e. e ~ π (Eq. 3)."""
    lam = torch.sigmoid(gate_logits.to(_prob_dtype(gate_logits)))
    u = torch.rand(lam.shape, generator=generator, dtype=lam.dtype, device=lam.device)
    hit = u < lam
    hit[..., -1] = True
    return hit.to(torch.int8).argmax(dim=-1) + 1


# ----------------------------------------------------------------------------- sampling

def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """logits (V,) -> one token id. temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.double() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:  # nucleus: keep the smallest prefix of sorted probs whose mass reaches top_p
        sp, si = torch.sort(probs, descending=True)
        drop = (sp.cumsum(0) - sp) >= top_p
        probs = torch.zeros_like(probs).scatter(0, si, sp.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


# ----------------------------------------------------------------------------- generation

@torch.no_grad()
def next_logits_naive(model, ids, mode, depth=None, thr=None):
    """The oracle: recompute the whole context densely and read the last position.
    mode 'fixed': logits at `depth`; mode 'ouro': at the threshold exit (Eq. 4)."""
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    out = model(idx, keep_logits=True)
    e = depth if mode == "fixed" else int(threshold_exit(out["gate_logits"][0, -1], thr))
    return out["logits"][e - 1][0, -1], e


@torch.no_grad()
def forward_lanes(model, idx, cache, pos, n_run):
    """Run a chunk of tokens (positions pos..pos+T-1) through depths 1..n_run with one KV lane
    per (depth, layer), as Ouro's code does. Returns the last position's normed states and gate
    logits per depth."""
    h = model.embed_tokens(idx)
    cos, sin = model.rope(torch.arange(pos, pos + idx.shape[1], device=idx.device), h.dtype)
    states, gates = [], []
    for d in range(n_run):
        cache.begin(d, pos)
        h = model.block(h, cos, sin, cache)
        hn, gate, h = model.exit_heads(h)
        states.append(hn[:, -1])
        gates.append(gate[:, -1])
    return states, torch.stack(gates, -1)


def check_prompt(model, ids, max_new_tokens):
    if not ids:
        raise UserError("the prompt is empty: give --prompt or --prompt_ids")
    if len(ids) >= model.config.block_size:
        raise UserError(f"the prompt has {len(ids)} tokens; the context length is "
                        f"block_size={model.config.block_size}: give a prompt of at most "
                        f"{model.config.block_size - 1} tokens")
    if len(ids) + max_new_tokens > model.config.block_size:
        raise UserError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds "
                        f"the context length block_size={model.config.block_size}")
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})")


@torch.inference_mode()
def generate(model, ids, max_new_tokens, mode="ouro", depth=None, thr=0.5, sampler=None, naive=False):
    """Generate with one of the dense-cache modes of this file.

    mode 'fixed': every token runs `depth` loops (KV lanes 1..depth).
    mode 'ouro':  every token runs all U loops (one KV lane per loop and layer, as Ouro's code);
                  the threshold (Eq. 4) only picks which depth's logits are sampled.
    naive=True recomputes the whole context every step (the oracle).
    Returns (new token ids, exit depth per new token)."""
    from ragged import DenseLanes  # the caches live in ragged.py
    U = model.config.n_loops
    if mode == "fixed" and not 1 <= (depth or 0) <= U:
        raise UserError(f"--depth={depth} must be in 1..{U}")
    check_prompt(model, ids, max_new_tokens)
    sampler = sampler or (lambda logits: int(logits.argmax()))
    ids, new, exits = list(ids), [], []
    n_run = depth if mode == "fixed" else U
    device = model.lm_head.weight.device
    cache = None if naive else DenseLanes(model, n_run, len(ids) + max_new_tokens)
    chunk, pos = ids, 0
    for _ in range(max_new_tokens):
        if naive:
            logits, e = next_logits_naive(model, ids, mode, depth, thr)
        else:
            idx = torch.tensor([chunk], dtype=torch.long, device=device)
            states, gates = forward_lanes(model, idx, cache, pos, n_run)
            e = depth if mode == "fixed" else int(threshold_exit(gates[0], thr))
            logits = model.lm_head(states[e - 1][0])
            pos += len(chunk)
        tok = sampler(logits)
        ids.append(tok); new.append(tok); exits.append(e)
        chunk = [tok]
    return new, exits


# ----------------------------------------------------------------------------- Ragged KV (§3, Eq. 7)

FULL = float("inf")  # a threshold no CDF reaches: the token runs every depth (exit at the last)


class TerminalKV:
    """Attention hook of the dense-shaped ragged forward: per layer, the K/V of tokens that
    stopped (`frozen`) are replaced by their terminal K/V, the last depth they ran (Eq. 7).
    With `history` a list, the K/V read at every (depth, layer) are appended to it."""

    def __init__(self, n_layer, history=None):
        self.k, self.v = [None] * n_layer, [None] * n_layer
        self.frozen = None  # (B, T) bool
        self.history = history

    def layer_kv(self, layer, k, v):
        if self.k[layer] is not None:
            keep = self.frozen[:, None, :, None]
            k, v = torch.where(keep, self.k[layer], k), torch.where(keep, self.v[layer], v)
        self.k[layer], self.v[layer] = k, v
        if self.history is not None:
            self.history.append((k, v))
        T = k.shape[2]
        return k, v, torch.ones(T, T, dtype=torch.bool, device=k.device).tril()


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


def forward_ragged(model, idx, targets=None, taus=None, exits=None, uniforms=None, full=None, n_run=None,
                   history=None):
    """Dense-shaped ragged forward (Eq. 7): every token is computed at every depth, but once a
    token stops, its hidden state is frozen and, in every layer, later tokens read its terminal
    K/V instead of fresh ones. The oracle of the paged path, and the training path.

    Exits, decided online at each depth from gates <= d: given (`exits`, 1-based, B x T), sampled
    (`uniforms` B x T x U: exit at d when u_d < λ_d), or by threshold (`taus`, a number or B x T).
    `full` (B x T bool): keep running to the last depth after the exit is decided (dense prefill).
    Returns exits, gate_logits, the normed exit states, logits at the exit and, with targets,
    the cross-entropy at the exit depth per token and its mean (one logits computation)."""
    B, T = idx.shape
    U = n_run or model.config.n_loops
    h = model.embed_tokens(idx)
    cos, sin = model.rope(torch.arange(T, device=idx.device), h.dtype)
    pdt = at_least_fp32(h.dtype)
    if taus is not None and not torch.is_tensor(taus):
        taus = torch.full((B, T), float(taus), dtype=pdt, device=idx.device)
    full = torch.zeros(B, T, dtype=torch.bool, device=idx.device) if full is None else full
    survive = torch.ones(B, T, dtype=pdt, device=idx.device)
    decided = torch.zeros(B, T, dtype=torch.long, device=idx.device)
    stopped = torch.zeros(B, T, dtype=torch.bool, device=idx.device)
    states = torch.zeros_like(h)
    gates, kv = [], TerminalKV(model.config.n_layer, history)
    for d in range(U):
        kv.frozen = stopped
        hn, gate, h_next = model.exit_heads(model.block(h, cos, sin, kv))
        gates.append(gate)
        if exits is not None:
            now = exits == d + 1
        elif uniforms is not None:
            now = uniforms[..., d] < torch.sigmoid(gate.detach().to(uniforms.dtype))
        else:
            survive, now = exit_now(survive, gate.detach(), taus)  # Eq. 4, online
        new = (decided == 0) & (now | (d == U - 1))
        decided = torch.where(new, d + 1, decided)
        states = torch.where(new[..., None], hn, states)
        h = torch.where(stopped[..., None], h, h_next)           # exited tokens stay frozen
        stopped = stopped | (new & ~full) | (d == U - 1)
    out = {"exits": decided, "gate_logits": torch.stack(gates, -1), "states": states}
    logits = model.lm_head(states)
    out["logits"] = logits
    if targets is not None:
        tok = token_ce(logits, targets)
        valid = targets != -1
        out["token_loss"] = tok                                  # ℓ_{i,e_i}, 0 where no target
        out["loss"] = tok.sum() / valid.sum().clamp(min=1)       # Eq. 15
    return out


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


def prompt_thresholds(n, thr, prefill_thr=None, prefill_schedule="", prefix_full=0):
    """Per-token thresholds for an ETE-Ragged prefill (App. E.2): a threshold of its own, a cosine
    schedule from 1 (full depth) at the first prompt token down to τ at the last, and the first k
    tokens at full depth (the Ouro-2.6B prefix fix)."""
    base = thr if prefill_thr is None else prefill_thr
    taus = torch.full((n,), float(base), dtype=torch.float64)
    if prefill_schedule == "cosine" and n > 1:
        t = torch.arange(n, dtype=torch.float64) / (n - 1)
        taus = base + (1 - base) * (1 + torch.cos(math.pi * t)) / 2
    taus[:prefix_full] = FULL
    return taus


def exit_stats(exits, U):
    """Exit-depth fractions, jump rates J_k = P(|e_i - e_{i-1}| = k) and the large-jump rate."""
    e = torch.as_tensor(exits, dtype=torch.long).reshape(-1)
    fr = [float((e == d).double().mean()) if len(e) else 0.0 for d in range(1, U + 1)]
    jumps = (e[1:] - e[:-1]).abs()
    jr = [float((jumps == k).double().mean()) if len(jumps) else 0.0 for k in range(U)]
    return {"exit_fractions": fr, "jump_rates": jr, "large_jump_rate": float(sum(jr[2:]))}


# ----------------------------------------------------------------------------- checkpoints

def atomic_write(path, write):
    """Write a file atomically: write(tmp) fills a temp file beside `path`, which gets the usual
    permissions (0666 less the umask; mkstemp would leave 0600) and is then renamed over `path`.
    An interrupted write leaves the old file as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    atomic_write(path, write)


def save_checkpoint(obj, path):
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def resolve_device(name):
    """--device: auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N or mps."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device={name}: CUDA is not available on this machine; use --device=cpu or auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"--device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device=mps: MPS is not available on this machine; use --device=cpu or auto")
    return name


def resolve_ckpt_path(path, flag="--ckpt"):
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise UserError(f"{flag}: no checkpoint at {path!r}: give a ckpt.pt file or a directory holding one "
                        "(train.py writes out_dir/ckpt.pt)")
    return path


def load_checkpoint(path, device="cpu", dtype=None, flag="--ckpt"):
    """The one loader used by train, sample and serve: our ckpt.pt (file or directory) or an Ouro
    Hugging Face folder (config.json + safetensors), detected automatically. `flag` names the
    option in error messages. Returns (model, checkpoint dict)."""
    if is_ouro_folder(path):
        return load_ouro(path, device, dtype)
    path = resolve_ckpt_path(path, flag)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not written by torch.save, or holding more than tensors
        raise UserError(f"{flag}={path}: not a readable PyTorch checkpoint (torch.load: {type(e).__name__}); "
                        "is it truncated, or another kind of file?")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_args"), dict) or "model" not in ckpt:
        raise UserError(f"{flag}={path}: a PyTorch file, but not one of our checkpoints (no 'model' and "
                        "'model_args'; train.py writes them)")
    known = {f.name for f in fields(GPTConfig)}
    try:
        cfg = GPTConfig(**{k: v for k, v in ckpt["model_args"].items() if k in known})
        model = LoopedLM(cfg)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise UserError(f"{flag}={path}: its model_args do not describe a model ({type(e).__name__})")
    state = ckpt["model"]
    want = model.state_dict()
    bad = sorted(set(want) ^ set(state)) or sorted(k for k in want if tuple(want[k].shape) != tuple(state[k].shape))
    if bad:
        raise UserError(f"{flag}={path}: its weights do not match its model_args ({len(bad)} mismatched, "
                        f"e.g. {bad[0]})")
    model.load_state_dict(state)
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return model, ckpt


def model_args(cfg):
    return asdict(cfg)


# ----------------------------------------------------------------------------- Ouro checkpoints (Hugging Face format)

# config.json field -> GPTConfig field (DESIGN.md "The model")
OURO_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
               "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
               "intermediate_size": "ffn_hidden", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
               "total_ut_steps": "n_loops", "max_position_embeddings": "block_size"}


def is_ouro_folder(path):
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")))


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("Ouro checkpoints are safetensors files: install the optional package with "
                        "`pip install safetensors`")
    return safetensors.torch


def ouro_key(key):
    """Our parameter name -> Ouro's: everything but the LM head lives under `model.`."""
    return key if key.startswith("lm_head.") else "model." + key


# The other fields of the published Ouro configs (1.4B, 2.6B and their -Thinking variants). Each is
# either inert here (it does not change what the model computes) or accepted with the only value
# that we implement; anything else in a config.json is refused, so no field silently changes the model.
# (tie_word_embeddings and head_dim are read by the loader; max_window_layers and sliding_window act
# only with use_sliding_window; early_exit_threshold is Ouro's own τ, ours is --thr.)
OURO_INERT = {"architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
              "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "early_exit_threshold",
              "tie_word_embeddings", "head_dim", "max_window_layers", "sliding_window"}
OURO_ONLY = {"hidden_act": ["silu"], "rope_scaling": [None], "use_sliding_window": [False],
             "attention_dropout": [0, 0.0], "attention_bias": [False]}


def ouro_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{folder}/config.json is not valid JSON ({e})")
    if hf.get("model_type", "ouro") != "ouro":
        raise UserError(f"{folder}: model_type {hf.get('model_type')!r} is not 'ouro'")
    missing = [k for k in OURO_FIELDS if k not in hf and k not in ("num_key_value_heads", "max_position_embeddings")]
    if missing:
        raise UserError(f"{folder}/config.json lacks {', '.join(missing)}")
    for key, value in hf.items():
        if key in OURO_ONLY and value not in OURO_ONLY[key]:
            raise UserError(f"{folder}/config.json: {key}={value!r} is not implemented here (only "
                            f"{' or '.join(map(repr, OURO_ONLY[key]))}); refusing rather than computing another model")
        if key == "layer_types" and any(t != "full_attention" for t in value):
            raise UserError(f"{folder}/config.json: layer_types other than 'full_attention' "
                            f"({sorted(set(value) - {'full_attention'})}) are not implemented here")
        if key not in OURO_FIELDS and key not in OURO_INERT and key not in OURO_ONLY and key != "layer_types":
            raise UserError(f"{folder}/config.json: field {key}={value!r} is not one of the Ouro config fields "
                            "this loader implements; refusing rather than ignoring it")
    args = {ours: hf[theirs] for theirs, ours in OURO_FIELDS.items() if theirs in hf}
    args.setdefault("n_kv_head", args["n_head"])
    args.setdefault("block_size", 4096)
    # Ouro normalizes the hidden state after every loop; the in-branch gains come from the weights
    cfg = GPTConfig(**args, loop_norm=True, branch_norm_init=1.0)
    if "head_dim" in hf and hf["head_dim"] != cfg.head_dim:
        raise UserError(f"{folder}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads = {cfg.head_dim}")
    if len(hf.get("layer_types", [None] * cfg.n_layer)) != cfg.n_layer:
        raise UserError(f"{folder}/config.json: layer_types has {len(hf['layer_types'])} entries for {cfg.n_layer} layers")
    return cfg, hf


def read_ouro_tensors(folder):
    st = _safetensors()
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        try:
            tensors.update(st.load_file(os.path.join(folder, name)))
        except Exception as e:
            raise UserError(f"cannot read {folder}/{name}: {type(e).__name__}: {str(e)[:160]}")
    return tensors


def load_ouro(folder, device="cpu", dtype=None):
    """Load an Ouro folder strictly: every key consumed, every parameter filled, shapes checked.
    The stored dtype (bf16) is kept unless `dtype` is given."""
    cfg, hf = ouro_config(folder)
    tensors = read_ouro_tensors(folder)
    with torch.device("meta"):
        model = LoopedLM(cfg)
    want = {ouro_key(k): v.shape for k, v in model.state_dict().items()}
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise UserError(f"{folder}: checkpoint keys do not match an Ouro model of this config: "
                        f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                        f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise UserError(f"{folder}: {k} has shape {tuple(tensors[k].shape)}, the config implies {tuple(shape)}")
    state = {k: tensors[ouro_key(k)] for k in model.state_dict()}
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    meta = {}
    if os.path.isfile(os.path.join(folder, "meta.json")):          # exported from here: our tokenizer
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
    elif os.path.isfile(os.path.join(folder, "tokenizer.json")):   # Ouro's own (SmolLM2-style)
        meta = {"tokenizer": "hf", "path": os.path.join(folder, "tokenizer.json"), "vocab_size": cfg.vocab_size}
    return model, {"model_args": asdict(cfg), "meta": meta, "ouro_config": hf}


OURO_HUB = "ByteDance/Ouro-1.4B"  # where the published Ouro modeling code lives (for auto_map)


def export_ouro(model, folder, meta=None, dtype=torch.bfloat16, force=False):
    """Write an Ouro-format folder: config.json (model_type "ouro", an auto_map to the Ouro modeling
    code on the Hub) + model.safetensors with Ouro's key names. Refuses a model that Ouro's code
    would run differently, and an existing Ouro folder unless `force`."""
    cfg = model.config
    if not cfg.loop_norm:
        raise UserError("this model was trained without the per-loop norm (loop_norm=False); Ouro's code "
                        "normalizes the hidden state after every loop and would compute something else. "
                        "Only models trained with --loop_norm can be exported")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--out={folder}: exists and is not a folder")
    ours = ["config.json", "model.safetensors", "model.safetensors.index.json", "meta.json"]
    present = [f for f in ours if os.path.exists(os.path.join(folder, f))]
    if present and not force:
        raise UserError(f"--out={folder}: already holds {', '.join(present)}; give --force to overwrite it")
    st = _safetensors()
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded folder: its index would shadow the new single file
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        for name in shards:
            if os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        os.remove(index)
    hf = {"model_type": "ouro", "architectures": ["OuroForCausalLM"], "hidden_act": "silu",
          "head_dim": cfg.head_dim, "tie_word_embeddings": False, "early_exit_threshold": 1.0,
          "torch_dtype": str(dtype).replace("torch.", ""), "use_cache": True, "attention_dropout": 0.0,
          "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
          "layer_types": ["full_attention"] * cfg.n_layer, "initializer_range": 0.02,
          "auto_map": {"AutoConfig": f"{OURO_HUB}--configuration_ouro.OuroConfig",
                       "AutoModel": f"{OURO_HUB}--modeling_ouro.OuroModel",
                       "AutoModelForCausalLM": f"{OURO_HUB}--modeling_ouro.OuroForCausalLM"}}
    hf.update({theirs: getattr(cfg, ours) for theirs, ours in OURO_FIELDS.items()})
    tensors = {ouro_key(k): v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    atomic_write(os.path.join(folder, "model.safetensors"),
                 lambda tmp: st.save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(folder, "config.json"), hf)
    if meta:
        write_json(os.path.join(folder, "meta.json"), meta)
    return folder
