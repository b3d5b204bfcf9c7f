"""
What one generation asks for and what it gets back: the Request, and how its tokens are sampled.

The engine (serve_depthbatch.py) validates a request (`check_request`), runs it and fills in the
fields below the line; sample.py, eval.py, server.py and bench.py build them.
"""
from dataclasses import dataclass, field

import torch

SEED_MAX = 2**64 - 1      # the largest seed torch.Generator.manual_seed takes


@dataclass(eq=False)   # requests compare by identity (they sit in queues and lists)
class Request:
    """One generation: what the user asks for, then what the engine reports back."""
    prompt: list                   # token ids
    max_tokens: int = 16           # tokens to sample (the request ends after them, or at a stop id)
    mode: str = "dense_ragged"     # see serve_depthbatch.MODES
    thr: float = 0.5               # this request's exit threshold τ (Eq. 4)
    depth: int = 0                 # fixed mode: loops per token (0: U)
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0                  # seeds this request's sampler: reproducible whatever else is batched
    stop: tuple = ()               # token ids that end the request (kept in tokens)
    prefill_thr: float = None      # ETE prefill options (App. E.2)
    prefill_schedule: str = ""
    prefix_full: int = 0
    keep_logits: bool = False      # keep the logits each token was sampled from (in .logits)
    on_token: object = None        # called as on_token(request, token) by the engine thread (None: ended)
    tag: object = None             # the caller's own label (an item index, a choice index); never read here
    cancelled: bool = False        # set from any thread; the engine frees the pages at its next step
    # ---- reported by the engine
    tokens: list = field(default_factory=list)       # sampled tokens, in order
    exits: list = field(default_factory=list)        # exit depth of every position that ran (1-based)
    logits: list = field(default_factory=list, repr=False)
    finish_reason: str = None      # length | stop | cancelled | error
    error: str = None
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


def sample_set(logits, temperature=1.0, top_k=0, top_p=1.0):
    """What a sampled token is drawn from: (ids, probs) of the tokens it may be, most likely first
    under top_p. temperature > 0 scales the logits; top_k 0 = off (else the k most likely, ties at
    the k-th kept); top_p 1 = off (else the nucleus: the smallest prefix of the tokens sorted by
    probability whose mass reaches top_p, each token kept while the mass before it is short of
    top_p). The nucleus is usually a small part of a real vocabulary, so it is found among the 64
    most likely tokens, then 4x as many while their mass falls short: the set that sorting the whole
    vocabulary gives (test_model.py checks it against that), without the sort, which costs as much
    as a block pass on a 50,257-word vocabulary."""
    logits = logits.double() / temperature
    V = logits.numel()
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return torch.arange(V), probs
    n = 64
    while True:
        p, ids = torch.topk(probs, min(n, V))            # the n most likely, largest first
        mass = p.cumsum(0)
        if n >= V or mass[-1] >= top_p:                   # every later token has top_p before it: dropped
            keep = (mass - p) < top_p
            return ids[keep], p[keep]
        n *= 4


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """logits (V,) -> one token id. temperature 0 = greedy; else a draw from sample_set."""
    if temperature == 0:
        return int(logits.argmax())
    ids, probs = sample_set(logits, temperature, top_k, top_p)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])
