"""
What one generation asks for and what it gets back: the Request, and how its tokens are sampled (an
OpenAI-style body asks for requests in api.py).

The engine (serve_depthbatch.py) validates a request (modes.check_request), runs it and fills in the
fields below the line; sample.py, lab/eval.py, server.py and lab/bench.py build them.
"""
from dataclasses import dataclass, field

import torch


SEED_MAX = 2**64 - 1      # seeds are 64-bit: they key the sampler's noise (sample_token)


@dataclass(eq=False)   # requests compare by identity (they sit in queues and lists)
class Request:
    """One generation: what the user asks for, then what the engine reports back."""
    prompt: list                   # token ids
    max_tokens: int = 16           # tokens to sample (the request ends after them, or at a stop id)
    mode: str = "dense_ragged"     # see modes.MODES
    thr: float = 0.5               # this request's exit threshold τ (Eq. 4)
    depth: int = 0                 # fixed mode: loops per token (0: U)
    draft_k: int = 4               # speculative mode: the most drafts in flight, not verified yet
    draft_depth: int = 1           # speculative mode: loops a draft runs (0: its exit gate at thr)
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    # seeds this request's sampler: reproducible whatever else is batched
    seed: int = 0
    stop: tuple = ()               # token ids that end the request (kept in tokens)
    prefill_thr: float = None      # ETE prefill options (App. E.2)
    prefill_schedule: str = ""
    prefix_full: int = 0
    keep_logits: bool = False      # keep the logits each token was sampled from (in .logits)
    # called as on_token(request, token) by the engine thread (None: ended)
    on_token: object = None
    # the caller's own label (an item index, a choice index); never read here
    tag: object = None
    # set from any thread; the engine frees the pages at its next step
    cancelled: bool = False
    # ---- reported by the engine
    tokens: list = field(default_factory=list)       # sampled tokens, in order
    # exit depth of every position that ran (1-based)
    exits: list = field(default_factory=list)
    logits: list = field(default_factory=list, repr=False)
    finish_reason: str = None      # length | stop | cancelled | error
    error: str = None
    # why a request ended before max_tokens without a stop (the pool ran dry)
    note: str = None
    kv: dict = None                # page accounting of this request at its end
    preemptions: int = 0

    @property
    def prompt_exits(self):
        return self.exits[:len(self.prompt)]

    @property
    def decode_exits(self):
        return self.exits[len(self.prompt):]

    @property
    def token_exits(self):
        """The depth that produced each sampled token (the exit of the position before it)."""
        return self.exits[len(self.prompt) - 1:len(self.prompt) - 1 + len(self.tokens)]


# ----------------------------------------------------------------------------- sampling

# A sampled token is the Gumbel-max of its nucleus: the argmax, over the tokens that top-k and top-p
# keep, of z_i + g_i, where z are the logits over the temperature and g_i = -log(-log u_i) is Gumbel
# noise whose uniform u_i is a hash of (the request's seed, the token's position, i). Drawing so is
# drawing from the softmax of z over the nucleus, and a draw depends on nothing but the request and
# the position: the same whatever else is batched, when a preempted request is replayed, and inside
# a CUDA graph, which cannot hold a generator's state. Two ways compute it, one law: sample_token
# for one row (the nucleus found without sorting the vocabulary) and sample_tokens for a batch with
# static shapes (what slot_pass's graphs run); test_model.py checks that they agree.

M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (multiply-xorshift, as in Wellons's lowbias32) on int64 tensors holding
    values in [0, 2**32). Its multipliers are below 2**31, so no product overflows int64: the same
    bits on every device and under every compiler (signed overflow is undefined in C++)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def keyed_uniform(seed, position, ids, dtype):
    """Uniforms in (0, 1), one per token id, keyed by (seed, position): seed and position are
    int64 tensors of one shape S (a seed is stored as its 64 bits: seed - 2**64 above 2**63), ids
    int64 of shape S + [n] or [n]. Returns S + [n] of dtype (float32: 23 random bits, else 52)."""
    key = mix32((seed & M32) ^ mix32(((seed >> 32) & M32) ^ mix32(position & M32)))
    a = mix32((key[..., None] + mix32((ids + 0x9E3779B9) & M32)) & M32)
    if dtype == torch.float32:
        bits, n = a >> 9, 23
    else:
        bits, n = (a << 20) | (mix32(a ^ 0x68E31DA4) >> 12), 52
    return (bits.to(dtype) + 0.5) * 2.0 ** -n              # exact: n + 1 bits fit the mantissa


def seed_bits(seed):
    """A request's seed (0 .. 2**64 - 1) as the int64 with the same 64 bits."""
    return seed - 2**64 if seed >= 2**63 else seed


def sample_set(logits, temperature=1.0, top_k=0, top_p=1.0):
    """What a sampled token is drawn from: (ids, probs, z) of the tokens it may be, most likely
    first under top_p, z their logits over the temperature. temperature > 0 scales the logits; top_k
    0 = off (else the k most likely, ties at the k-th kept); top_p 1 = off (else the nucleus: the
    smallest prefix of the tokens sorted by probability whose mass reaches top_p, each token kept
    while the mass before it is short of top_p). In >= fp32, as the exit maths. The nucleus is
    usually a small part of a real vocabulary, so it is found among the 64 most likely tokens, then
    4x as many while their mass falls short: the set that sorting the whole vocabulary gives
    (sample_tokens does, and test_model.py checks it), without the sort, which costs as much as a
    block pass on a 50,257-word vocabulary on a CPU."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    V = z.numel()
    if top_k and top_k < V:
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p >= 1.0:
        return torch.arange(V, device=z.device), probs, z
    n = 64
    while True:
        p, ids = torch.topk(probs, min(n, V))            # the n most likely, largest first
        mass = p.cumsum(0)
        # every later token has top_p before it: dropped
        if n >= V or mass[-1] >= top_p:
            keep = (mass - p) < top_p
            return ids[keep], p[keep], z[ids[keep]]
        n *= 4


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=0):
    """logits (V,) -> one token id. temperature 0 = greedy; else the Gumbel-max of the nucleus
    (sample_set) with noise keyed by (seed, position): reproducible, and equal to sample_tokens."""
    if temperature == 0:
        return int(logits.argmax())
    ids, _, z = sample_set(logits, temperature, top_k, top_p)
    key = lambda v: torch.tensor(v, dtype=torch.long, device=z.device)
    g = -torch.log(-torch.log(keyed_uniform(key(seed_bits(seed)), key(position), ids, z.dtype)))
    return int(ids[torch.argmax(z + g)])


def sample_tokens(logits, temperature, top_k, top_p, seed, position, nucleus=True):
    """The same draw for a batch, with static shapes and no value read on the host (a CUDA graph
    runs it): logits [R, V]; per row temperature, top_p (float), top_k, seed bits and position
    (int64), all [R]. Rows of temperature 0 take the argmax. The nucleus by sorting each row;
    nucleus=False when no row asks for top-k or top-p: then every token is kept, and the Gumbel-max
    over the whole vocabulary is the same draw without the sort (one pass over the logits, the
    greedy rows' argmax in it)."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(dt)
    R, V = x.shape
    z = x / torch.where(temperature > 0, temperature, 1.0).to(dt)[:, None]
    ids = torch.arange(V, device=x.device)
    g = -torch.log(-torch.log(keyed_uniform(seed, position, ids, dt)))
    if not nucleus:
        return torch.where(temperature[:, None] > 0, z + g, x).argmax(-1)
    sz, order = torch.sort(z, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    kth = sz.gather(1, (k - 1)[:, None])
    sz = sz.masked_fill(sz < kth, float("-inf"))          # top-k, ties at the k-th kept
    p = torch.softmax(sz, dim=-1)
    mass = p.cumsum(-1)
    keep = ((mass - p) < top_p[:, None].to(dt)) | (top_p[:, None] >= 1.0)
    # back to vocabulary order
    keep = torch.zeros_like(keep).scatter(1, order, keep & (sz > float("-inf")))
    drawn = torch.where(keep, z + g, float("-inf")).argmax(-1)
    return torch.where(temperature > 0, drawn, x.argmax(-1))


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python sample.py and python server.py build requests")
