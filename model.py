"""
The looped language model (Ouro-style): one block of L layers applied U times, an exit gate after
every loop, the exit maths of the paper (Eq. 2-4), and the slow reference forwards that every fast
path is checked against.

Read top to bottom: the config; the layer; the looped model and its dense forward (Eq. 1, every
token runs every loop); the exit maths (Eq. 2-4, one function per rule, used everywhere); Ouro's
dense-lane generation (the recompute oracle and the cached decode: the baseline); and the
dense-shaped ragged forward (Eq. 7: token j is read at depth min(d, e_j)), the oracle of the paged
engine in serve_depthbatch.py and the forward of ragged-aware training.

Equation numbers refer to the paper, "Enabling Dynamic Computation in Looped LMs";
docs/equations.md writes each one out with the function that implements it and its test.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from configurator import UserError
from ragged import DenseLanes


def at_least_fp32(dtype):
    """Exit maths, norms and cross-entropy never run in bf16: fp32, or fp64 in float64 tests."""
    return torch.promote_types(dtype, torch.float32)


def token_ce(logits, targets):
    """Per-token next-token cross-entropy in >= fp32; 0 where the target is -1."""
    logits = logits.to(at_least_fp32(logits.dtype))
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-1, reduction="none")
    return loss.view(targets.shape)


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
    # pass norm(h) to the next loop (Ouro: True; our default, App. B: False)
    loop_norm: bool = False
    branch_norm_init: float = 0.02  # initial gain of the in-branch norms (*_2), App. B

    @property
    def head_dim(self):
        return self.n_embd // self.n_head



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
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                            device=positions.device) / head_dim)
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
    """Scaled dot-product attention, causal unless a mask is given. q (B, Hq, T, D); k, v (B, Hkv,
    S, D): with grouped-query attention each K/V head serves Hq/Hkv query heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class Attention(nn.Module):
    """The projections of grouped-query attention (the attention itself is `attention`, or a cache's)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        # q, k, v stacked (fuse), else None
        self.register_buffer("qkv_weight", None, persistent=False)

    def qkv(self, x, cos, sin):
        """Queries, keys and values (B, heads, T, D), queries and keys rotated (RoPE): one GEMM when
        fused, else three."""
        B, T, _ = x.shape
        # autograd reaches the parameters, not the stack
        if self.qkv_weight is None or torch.is_grad_enabled():
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = F.linear(x, self.qkv_weight).split([self.q_proj.out_features,
                                                          self.k_proj.out_features,
                                                          self.v_proj.out_features], -1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, y):
        """The heads' outputs (B, Hq, T, D) merged and projected back to the model width."""
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)
        # gate, up stacked (fuse), else None
        self.register_buffer("gate_up_weight", None, persistent=False)

    def forward(self, x):
        if self.gate_up_weight is None or torch.is_grad_enabled():
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, -1)    # one GEMM
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class Layer(nn.Module):
    """The Ouro layer: four RMSNorms ("sandwich"), attention and SwiGLU, no biases. Its two halves
    around the attention are methods of their own, so that a fast path can compile each once for
    every layer and run its own attention between them (engine/slot_pass.py)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.input_layernorm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.branch_norm_init)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.branch_norm_init)

    def forward(self, h, cos, sin, kv=None):
        """kv: None for plain causal self-attention, or a function (q, k, v) -> output through which
        a cache stores this step's K/V and attends over what the queries may read."""
        q, k, v = self.before_attention(h, cos, sin)
        return self.after_attention(h, attention(q, k, v) if kv is None else kv(q, k, v))

    def before_attention(self, h, cos, sin):
        """The input norm, the projections and RoPE: (q, k, v)."""
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def after_attention(self, h, y):
        """The output projection, the sandwich norms, the residuals and the SwiGLU MLP."""
        h = h + self.input_layernorm_2(self.self_attn.out(y))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


# ----------------------------------------------------------------------------- the looped model

class LoopedLM(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        check_shapes(cfg)
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

    def forward(self, idx, targets=None, keep_logits=False, loop_shift=False):
        """Dense forward through all U depths (how Ouro trains: every token runs every loop).

        Returns a dict with
          gate_logits (B, T, U) fp32,
          losses      (B, T, U): ℓ_{i,d}, next-token loss of every token at every depth (if targets),
          logits      list of U tensors (B, T, V) (only if keep_logits),
          loop_shift  (B, T, U): how far each loop moves the state, |block(h) - h| / |h| (only if
                      loop_shift): the paper's sign of a loop that acts as identity (App. B, Figure 7).
        During training each depth's logits are recomputed in the backward pass
        (checkpointing), so at most one full-vocabulary logits tensor is alive at a time.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise UserError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        h = self.embed_tokens(idx)
        cos, sin = self.rope(torch.arange(T, device=idx.device), h.dtype)
        gates, losses, logits, shifts = [], [], [], []
        for _ in range(self.config.n_loops):
            h_in, h = h, self.block(h, cos, sin)
            if loop_shift:
                # never in bf16
                d, h0 = (h - h_in).to(at_least_fp32(h.dtype)), h_in.to(at_least_fp32(h.dtype))
                shifts.append(d.norm(dim=-1) / h0.norm(dim=-1).clamp_min(1e-12))
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
        if loop_shift:
            out["loop_shift"] = torch.stack(shifts, -1)
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


@torch.inference_mode()
def generate(model, ids, max_new_tokens, mode="ouro", depth=None, thr=0.5, sampler=None,
             naive=False):
    """Generate on Ouro's dense per-depth lanes (Eq. 5-6): the layout of Ouro's own code and the
    baseline of every benchmark.

    mode 'fixed': every token runs `depth` loops (KV lanes 1..depth).
    mode 'ouro':  every token runs all U loops (one KV lane per loop and layer, as Ouro's code);
                  the threshold (Eq. 4) only picks which depth's logits are sampled.
    naive=True recomputes the whole context every step (the oracle).
    Returns (new token ids, exit depth per new token)."""
    U = model.config.n_loops
    if mode == "fixed" and not 1 <= (depth or 0) <= U:
        raise UserError(f"--depth={depth} must be in 1..{U}")
    check_prompt(model.config, list(ids), max_new_tokens)
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
        ids.append(tok)
        new.append(tok)
        exits.append(e)
        chunk = [tok]
    return new, exits


# ---------------------------------------------------------------------------- Ragged KV (§3, Eq. 7)

FULL = float("inf")  # a threshold no CDF reaches: the token runs every depth (exit at the last)


class RaggedReads:
    """Attention hook of the dense-shaped ragged forward: each layer keeps the K/V of every token at
    every depth run so far, and a query at depth d reads key j at depth min(d, e_j) (Eq. 7): its own
    depth while j still runs, j's exit depth once j has stopped. `depth` holds min(d, e_j) per key
    (B, T; e_j counts as U while j runs) for the block application in progress. With `history` a
    list, the K/V read at every (depth, layer) are appended to it (the committed rollout of
    counterfactual training)."""

    def __init__(self, n_layer, history=None):
        self.k, self.v = [[] for _ in range(n_layer)], [[] for _ in range(n_layer)]
        self.depth = None
        self.history = history

    def layer_kv(self, layer, k, v):
        self.k[layer].append(k)
        self.v[layer].append(v)
        at = (self.depth - 1)[None, :, None, :, None].expand(1, *k.shape)     # (1, B, H, T, D)
        # Eq. 7: key j is read at depth min(d, e_j), from the K/V it had there
        k, v = (torch.stack(kv).gather(0, at)[0] for kv in (self.k[layer], self.v[layer]))
        if self.history is not None:
            self.history.append((k, v))
        T = k.shape[2]
        return k, v, torch.ones(T, T, dtype=torch.bool, device=k.device).tril()


def forward_ragged(model, idx, targets=None, taus=None, exits=None, uniforms=None, full=None,
                   n_run=None, history=None, rule=None):
    """Dense-shaped ragged forward (Eq. 7): every token is computed at every depth, but a token that
    stopped keeps its hidden state, and later tokens read its K/V at min(d, e_j) (RaggedReads). The
    oracle of the paged engine, and the forward of ragged-aware training.

    Exits are decided online at each depth from gates <= d (exit_rule: given, sampled, by threshold
    or by a rule of one's own). `full` (B x T bool): keep running to the last depth after the exit is
    decided (a dense prefill, Ouro mode). Returns exits, gate_logits, the normed exit states, logits
    at the exit and, with targets, the cross-entropy at the exit depth per token and its mean (one
    logits call)."""
    B, T = idx.shape
    U, dev = n_run or model.config.n_loops, idx.device
    h = model.embed_tokens(idx)
    cos, sin = model.rope(torch.arange(T, device=dev), h.dtype)
    decide = exit_rule(taus, exits, uniforms, rule, (B, T), at_least_fp32(h.dtype), dev)
    full = torch.zeros(B, T, dtype=torch.bool, device=dev) if full is None else full
    decided = torch.zeros(B, T, dtype=torch.long, device=dev)     # e_i once decided (0: not yet)
    last = torch.full((B, T), U, dtype=torch.long, device=dev)    # the last depth j runs (U: running)
    states = torch.zeros_like(h)
    gates, kv = [], RaggedReads(model.config.n_layer, history)
    for d in range(1, U + 1):
        kv.depth = torch.clamp(last, max=d)                         # Eq. 7: min(d, e_j) for every j
        hn, gate, h_next = model.exit_heads(model.block(h, cos, sin, kv))
        gates.append(gate)
        running = last >= d                                         # ran depth d
        new = (decided == 0) & (decide(d, hn, gate) | (d == U))
        decided = torch.where(new, d, decided)
        states = torch.where(new[..., None], hn, states)
        h = torch.where(running[..., None], h_next, h)              # a stopped token's state stays
        last = torch.where(new & ~full, d, last)
    out = {"exits": decided, "gate_logits": torch.stack(gates, -1), "states": states,
           "logits": model.lm_head(states)}
    if targets is not None:
        tok = token_ce(out["logits"], targets)
        out["token_loss"] = tok                                     # ℓ_{i,e_i}, 0 where no target
        out["loss"] = tok.sum() / (targets != -1).sum().clamp(min=1)   # Eq. 15
    return out


def exit_rule(taus, exits, uniforms, rule, shape, dtype, device):
    """forward_ragged's exits, as decide(d, normed states, gate logits) -> who exits at depth d: given
    (`exits`, 1-based, B x T), sampled (`uniforms` B x T x U: exit at d when u_d < λ_d, §5), by
    threshold (`taus`, a number or B x T: Eq. 4 online, from the gates of depths <= d), or by a rule
    of one's own (`rule`, lab/ladder.py's gate-free baseline)."""
    if taus is not None and not torch.is_tensor(taus):
        taus = torch.full(shape, float(taus), dtype=dtype, device=device)
    survive = [torch.ones(shape, dtype=dtype, device=device)]          # Π (1 - λ) so far

    def decide(d, hn, gate):
        if exits is not None:
            return exits == d
        if uniforms is not None:                                        # exit at d with probability λ_d
            return uniforms[..., d - 1] < torch.sigmoid(gate.detach().to(uniforms.dtype))
        if rule is not None:
            return rule(d, hn, gate)
        survive[0], now = exit_now(survive[0], gate.detach(), taus)     # Eq. 4, online
        return now
    return decide


# ----------------------------------------------------------------------------- exit statistics

def exit_stats(exits, U):
    """The paper's exit metrics (§4.1, Fig. 2, 4) of a sequence of exit depths (1-based): the fraction at each
    depth, the jump rates J_k = P(|e_i - e_{i-1}| = k) for k = 0..U-1, and the large-jump rate
    Σ_{k>=2} J_k. exits: a list, or a tensor whose last dim is the position (jumps are taken within
    each row)."""
    e = torch.as_tensor(exits, dtype=torch.long)
    jumps = (e[..., 1:] - e[..., :-1]).abs()
    fr = [float((e == d).double().mean()) if e.numel() else 0.0 for d in range(1, U + 1)]
    jr = [float((jumps == k).double().mean()) if jumps.numel() else 0.0 for k in range(U)]
    return {"exit_fractions": fr, "jump_rates": jr, "large_jump_rate": float(sum(jr[2:]))}


# ----------------------------------------------------------------------------- below the paper
# The checks every entry point shares, and the engine's stacked projections.

def check_shapes(cfg):
    """Shapes that must fit together; each message names the keys (train.py's flags)."""
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                "ffn_hidden", "n_loops"):
        if getattr(cfg, key) < 1:
            raise UserError(f"--{key}={getattr(cfg, key)}: must be >= 1")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"--n_embd={cfg.n_embd}: must be a multiple of --n_head={cfg.n_head}")
    if cfg.n_head % cfg.n_kv_head:
        raise UserError(f"--n_kv_head={cfg.n_kv_head}: must divide --n_head={cfg.n_head}")
    if cfg.head_dim % 2:
        raise UserError(f"--n_embd={cfg.n_embd}: head_dim = n_embd / n_head = {cfg.head_dim} "
                        "must be even for RoPE")


def check_prompt(cfg, ids, max_new_tokens):
    """The one check of a prompt and its budget, for every entry point (generate, the engine, and so
    sample.py, lab/eval.py and the server): a non-empty list of token ids inside the vocabulary,
    with room in the context for max_new_tokens more. UserError names the field: prompt or
    max_tokens."""
    if not isinstance(ids, list) or not ids:
        raise UserError("prompt: the prompt is empty; give a non-empty list of token ids", "prompt")
    bad = [t for t in ids
           if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < cfg.vocab_size)]
    if bad:
        raise UserError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, "
                        f"{cfg.vocab_size})", "prompt")
    if len(ids) >= cfg.block_size:
        raise UserError(f"prompt of {len(ids)} tokens: the context length is "
                        f"block_size={cfg.block_size}; give "
                        f"at most {cfg.block_size - 1} tokens", "prompt")
    if len(ids) + max_new_tokens > cfg.block_size:
        raise UserError(f"prompt of {len(ids)} tokens + max_tokens={max_new_tokens} exceeds the "
                        f"context length block_size={cfg.block_size}", "max_tokens")


def stack_weights(*linears):
    """One weight for several projections of the same input: their weights stacked along the output,
    with each Linear's weight turned into a view of its rows (one tensor in memory, whatever later
    changes it in place). One GEMM then does the work of several: fewer kernels a layer, the way
    inference engines run q/k/v and gate/up (gpt-fast's wqkv). The checkpoint keeps its own names:
    the stacked weight is a non-persistent buffer, the views stay the parameters it saves."""
    stacked = torch.cat([lin.weight.detach() for lin in linears])
    at = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = stacked[at:at + n]
        at += n
    return stacked


def fuse_projections(model):
    """Four GEMMs a layer instead of seven: q/k/v as one projection and gate/up as one
    (stack_weights), for the graphed engine (engine/slots.py), which calls it when it starts
    (idempotent), where a layer's launches are its cost. The eager engine leaves them apart: on a CPU
    one wide GEMM is slower than three narrow ones at 4-8 rows (docs/benchmarks.md). Call it after
    moving the model (.to() would copy the stacked weights apart from the parameters). Returns the
    model."""
    for layer in model.layers:
        if layer.self_attn.qkv_weight is None:
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight = stack_weights(a.q_proj, a.k_proj, a.v_proj)
            m.gate_up_weight = stack_weights(m.gate_proj, m.up_proj)
    return model


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python train.py trains it, python sample.py generates from it")
