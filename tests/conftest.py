"""Test-session setup and the helpers that several test modules share.

Without a GPU, Triton kernels run in Triton's interpreter on the CPU (float32 only): set before any
test module imports kernels.py, since triton.jit reads it. Tests never reach the network and run
one torch thread."""
import contextlib
import json
import os
import random
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One torch thread: the suite's matrices are small, so it is about as fast on an idle 2-core machine
# (4 min 51 s against 4 min 31 s), and beside other CPU-bound jobs it is spared OpenMP threads that
# spin while they wait for a core.
torch.set_num_threads(1)

# lm-eval's datasets library reads local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model import FULL, GPTConfig, LoopedLM  # noqa: E402  (after the interpreter switch)
from engine.request import Request  # noqa: E402
from modes import prompt_thresholds  # noqa: E402
from serve_depthbatch import Engine  # noqa: E402
from lab.claims import THRS  # noqa: E402
from prepare_data import SYNTH_CHARS  # noqa: E402
from server import serve  # noqa: E402
from tokenizer import char_meta, load_tokenizer  # noqa: E402

U = 4


# ----------------------------------------------------------------------------- float64 models and prompts

def random_model(seed, **overrides):
    """A float64 model with weights large enough that exits and tokens really vary."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=37, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=40)
    cfg.update(overrides)
    model = LoopedLM(GPTConfig(**cfg)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.25)
            if p.dim() == 1 and p.numel() > 1:  # norm gains around 1
                p.add_(1.0)
        model.early_exit_gate.weight.mul_(4.0)
    return model


def varied_model(seed=None):
    """A float64 model whose threshold exits spread over all depths."""
    seed = random.choice([1, 2]) if seed is None else seed
    model = random_model(seed)
    with torch.no_grad():
        model.early_exit_gate.weight.mul_(0.4)
        model.early_exit_gate.bias.fill_(-0.5)
    return model


def prompt(n):
    return torch.randint(0, 37, (n,)).tolist()


def chase(facts, name):
    """Brute force over a pointer item's facts (`Dc C7`, or `dc c7` in hops: each name defined first,
    its value after it, a pointer's value in small letters): the digit the chain from the capital
    `name` ends at, and the look-ups it takes."""
    env = {f[0].upper(): f[1] for f in facts}
    hops, v = 1, name
    while not env[v].isdigit():
        v, hops = env[v].upper(), hops + 1
    return env[v], hops


def oracle_taus(n_prompt, n_total, mode, thr, **prefill):
    taus = torch.full((1, n_total), float(thr), dtype=torch.float64)
    if mode == "dense_ragged":
        taus[0, :n_prompt] = FULL
    else:
        taus[0, :n_prompt] = prompt_thresholds(n_prompt, thr, **prefill)
    return taus


# ----------------------------------------------------------------------------- the CUDA graph API, stood in

class StandInGraphs:
    """engine/graphs.GRAPHS on a CPU: the one object that stands in for the CUDA graph API, so that the
    engine's own construction and capture code runs as on a GPU. A graph records the callable it
    captures and the autograd mode of its capture, and replays that callable in that mode (a CUDA graph
    replays the kernels its capture launched, compiled in that mode); the side stream is no stream.
    Counts captures and replays, and the modes captures ran in."""

    def __init__(self):
        self.captures, self.replays, self.modes = 0, 0, set()
        self.current, self.captured_on, self.replayed_on = None, set(), set()   # the device made current

    def can_capture(self, device):
        return True

    @contextlib.contextmanager
    def on(self, device):
        before, self.current = self.current, torch.device(device)
        try:
            yield
        finally:
            self.current = before

    def side_stream(self):
        return contextlib.nullcontext()

    def capture(self, run, pool):
        mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self.captures += 1
        self.captured_on.add(self.current)
        self.modes.add(mode)
        run()
        return Recorded(self, run, mode), pool


class Recorded:
    def __init__(self, api, run, mode):
        self.api, self.run, self.mode = api, run, mode

    def replay(self):
        self.api.replays += 1
        self.api.replayed_on.add(self.api.current)
        grad, inference = self.mode
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            self.run()


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """The CUDA graph API stood in for (StandInGraphs) for one test."""
    from engine import graphs
    api = StandInGraphs()
    monkeypatch.setattr(graphs, "GRAPHS", api)
    return api


# ----------------------------------------------------------------------------- the engine against itself

def alone(model, r, **engine_args):
    """The request on an engine of its own; checks that every page came back and was written once
    per layer."""
    e = engine(model, engine_args.pop("kv_pages", 4000), **engine_args)
    out = e.run([clone(r)])[0]
    assert e.pool.used == 0 and e.pool.writes == out.kv["block_evals"] * model.config.n_layer
    return out


def engine(model, kv_pages, head="eager", **engine_args):
    """An Engine; with head="shared" its cost model is told that a head call costs more than any
    wait, so that exited rows wait as long as the rule lets them (the most deferral to test)."""
    e = Engine(model, kv_pages, head=head, **engine_args)
    if e.runner.shared is not None:          # (a fixed wave's rows all exit on its last pass: none)
        e.runner.shared.w_head = float("inf")
    return e


def drive(engine, reqs, arrive=None, cancel_at=None):
    """Add each request at its step (arrive), cancel some from their callback after k tokens; step to
    the end, checking the page tables after every step, and that the steps return every token
    sampled, once, in order."""
    arrive = arrive or [0] * len(reqs)
    for i, k in (cancel_at or {}).items():
        reqs[i].on_token = (lambda r, t, k=k: setattr(r, "cancelled", True)
                            if t is not None and len(r.tokens) >= k else None)
    step, returned = 0, []
    while step <= max(arrive) or engine.busy():
        for r, t in zip(reqs, arrive):
            if t == step:
                engine.add(r)
        returned += engine.step()
        engine.check()
        step += 1
        assert step < 3000
    assert engine.pool.used == 0
    for r in reqs:
        assert [t for q, t in returned if q is r] == r.tokens
    return reqs


def clone(r):
    return Request(list(r.prompt), r.max_tokens, r.mode, r.thr, depth=r.depth, draft_k=r.draft_k,
                   draft_depth=r.draft_depth, temperature=r.temperature,
                   top_p=r.top_p, top_k=r.top_k, seed=r.seed, stop=tuple(r.stop), prefill_thr=r.prefill_thr,
                   prefill_schedule=r.prefill_schedule, prefix_full=r.prefix_full, keep_logits=r.keep_logits)


def assert_same(a, b):
    assert a.tokens == b.tokens and a.exits == b.exits, (a.mode, a.thr)
    assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------- training runs

TINY = ["--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=16", "--ffn_hidden=24", "--block_size=16",
        "--batch_size=4", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2"]


def read_log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- Ouro folders

CFG = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=48, rope_theta=1e6, rms_norm_eps=1e-6, total_ut_steps=4,
           max_position_embeddings=128, tie_word_embeddings=False, model_type="ouro",
           architectures=["OuroForCausalLM"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
NORMS = ["input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"]


def ouro_tensors(cfg, seed, dtype=torch.float32):
    """Random weights under Ouro's exact key names."""
    g = torch.Generator().manual_seed(seed)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    r = lambda *s, scale=0.2: (torch.randn(*s, generator=g) * scale).to(dtype)
    t = {"model.embed_tokens.weight": r(V, H, scale=1.0), "model.norm.weight": 1 + r(H),
         "model.early_exit_gate.weight": r(1, H, scale=0.3), "model.early_exit_gate.bias": r(1, scale=1.0),
         "lm_head.weight": r(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(kv, H),
                  p + "self_attn.v_proj.weight": r(kv, H), p + "self_attn.o_proj.weight": r(H, H),
                  p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H),
                  p + "mlp.down_proj.weight": r(H, F)})
        t.update({p + n + ".weight": 1 + r(H) for n in NORMS})
    return t


def write_folder(path, cfg, tensors, shards=1):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return path
    keys = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::shards]}
        save_file(part, os.path.join(path, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def make_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "\n": 3, "user": 4, "assistant": 5}
    for w in "the cat sat on a mat dog".split():
        vocab[w] = len(vocab)
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split("\n", "isolated")])
    tok.decoder = decoders.WordPiece()
    tok.save(path)


# ----------------------------------------------------------------------------- runs of the grid, made by hand

def fake_run(name, scope="global", prior="poisson", seed=1, jumps=0.2, fractions=(0.4, 0.3, 0.2, 0.1), rho=0.3,
             fixed=(2.0, 1.8, 1.7, 1.65), ragged=1.6, depth=2.0, data="synthetic", **extra):
    """A run's result.json made by hand (lab/reproduce.py's keys): its final numbers, a training curve of
    three evaluations and an exit trace; extra keys (windows, builtin, parent, ...) as given."""
    final = {"val_loss_fixed": list(fixed), "val_loss_ragged": {str(t): ragged for t in (0.5, 0.2, 0.3, 0.7)},
             "ragged_depth": {str(t): depth for t in (0.5, 0.2, 0.3, 0.7)}, "avg_exit_depth": depth,
             "exit_fractions": list(fractions), "jump_rates": [1 - jumps, 0.0, jumps, 0.0], "large_jump_rate": jumps,
             "kl_global": 0.01, "depth_by_difficulty": {str(k): 1.0 + 0.5 * k for k in range(5)},
             "difficulty_spearman": rho}
    curve = [{"iter": i, "tokens": 100 * i, "val_loss_fixed": list(fixed), "val_loss_ragged": {"0.5": ragged},
              "avg_exit_depth": depth, "large_jump_rate": jumps, "exit_fractions": list(fractions)} for i in (0, 5, 10)]
    trace = {"tokens": list("x=3 a=x ; a? 3\n"), "exits": [1, 1, 2, 1, 1, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1],
             "labels": [0] * 13 + [1, 0], "thr": 0.5}
    return dict(name=name, data=data, scope=scope, prior=prior, seed=seed, final=final, curve=curve, trace=trace,
                **extra)


def windows(fixed, ragged, depth, seed, n=160, noise=0.05):
    """A run's per-window losses whose means are exactly the given ones: a window's own difficulty
    (shared by every depth, and by every run of the same seed) plus noise of its own."""
    g = np.random.default_rng(seed)
    own = lambda: (lambda e: e - e.mean())(g.normal(0, 0.01, n))
    shared = own() * noise / 0.01
    columns = [f + shared + own() for f in fixed]
    return {"fixed": [list(row) for row in zip(*columns)],
            "ragged": {str(t): list(ragged + shared + own()) for t in THRS},
            "depth": {str(t): list(np.full(n, depth)) for t in THRS}}


# ----------------------------------------------------------------------------- a server on a loopback port

@contextlib.contextmanager
def serving(seed, kv_pages, max_batch, **shape):
    """A char-level random model served on a free loopback port, with the engine thread running.
    Yields (url, engine, server, encode, decode)."""
    torch.manual_seed(seed)
    meta = char_meta(SYNTH_CHARS)
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], **shape)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 2.0)
    encode, decode = load_tokenizer(meta)
    engine = Engine(model, kv_pages, max_batch=max_batch)
    httpd, server = serve(engine, "127.0.0.1", 0, encode, decode, "tiny")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", engine, server, encode, decode
    finally:
        httpd.shutdown()
        server.stop()
        httpd.server_close()


@pytest.fixture(scope="module")
def http_server():
    shape = dict(block_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=48)
    with serving(0, 2000, 8, **shape) as (url, engine, _, enc, dec):
        yield url, engine, enc, dec


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
