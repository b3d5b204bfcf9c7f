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
