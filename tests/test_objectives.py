"""Ragged-aware objectives (App. C) against brute force, eval metrics, and data-parallel training."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import objectives
import prepare_data
import metrics
import train
from conftest import TINY, random_model, read_log
from model import attention, exit_log_pdf, forward_ragged
from objectives import forward_counterfactual

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project root


def brute_ragged_states(model, ids, exits):
    """Eq. 7 by brute force, one token at a time: token i runs depths 1..e_i; at depth d each layer
    reads token j < i at depth min(d, e_j), from a plain dict of every K/V ever computed."""
    L = model.config.n_layer
    kv_store, states = {}, []
    for i, tok in enumerate(ids):
        h = model.embed_tokens(torch.tensor([[tok]]))
        cos, sin = model.rope(torch.tensor([i]), h.dtype)
        for d in range(exits[i]):
            for l in range(L):
                def hook(q, k, v, i=i, l=l, d=d):
                    kv_store[(i, l, d)] = (k, v)
                    ks = [kv_store[(j, l, min(d, exits[j] - 1))][0] for j in range(i)] + [k]
                    vs = [kv_store[(j, l, min(d, exits[j] - 1))][1] for j in range(i)] + [v]
                    return attention(q, torch.cat(ks, 2), torch.cat(vs, 2), torch.ones(1, i + 1, dtype=torch.bool))
                h = model.layers[l](h, cos, sin, hook)
            hn, _, h = model.exit_heads(h)
        states.append(hn[0, 0])
    return torch.stack(states)


def test_ragged_step_loss_and_gradients_equal_brute_force():
    model = random_model(int(torch.randint(0, 1000, ()))).train()
    T = 10
    ids = torch.randperm(37)[:T]                       # distinct tokens: embedding rows are per position
    y = torch.randint(0, 37, (1, T))
    u = torch.rand(1, T, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = forward_ragged(model, ids[None], y, uniforms=u)
    exits = out["exits"][0].tolist()
    # the same exits given explicitly give the same loss
    assert torch.allclose(forward_ragged(model, ids[None], y, exits=out["exits"])["loss"], out["loss"])
    model.zero_grad()
    out["loss"].backward()
    g_fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    states = brute_ragged_states(model, ids.tolist(), exits)
    brute = F.cross_entropy(model.lm_head(states), y[0])
    brute.backward()
    assert abs(out["loss"].item() - brute.item()) < 1e-10
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(g_fast[n], p.grad, atol=1e-9), n
    # the gate gets no gradient from a ragged step
    assert "early_exit_gate.weight" not in g_fast and "early_exit_gate.bias" not in g_fast
    assert len(set(exits)) >= 2


def test_gradient_reaches_earlier_depths_through_aliased_kv():
    model = random_model(7).train()
    T = 8
    ids = torch.randperm(37)[:T][None]
    y = torch.full((1, T), -1)
    y[0, -1] = 3                                        # a loss on the last token only
    exits = torch.tensor([[1, 4, 4, 4, 4, 4, 4, 4]])    # token 0 stops at depth 1
    out = forward_ragged(model, ids, y, exits=exits)
    out["loss"].backward()
    # token 0 reaches the last token only through its depth-1 K/V, aliased into depths 2..4
    assert model.embed_tokens.weight.grad[ids[0, 0]].abs().sum() > 0


def test_counterfactual_equals_each_token_continued_alone():
    torch.set_grad_enabled(False)
    try:
        _check_counterfactual(random_model(int(torch.randint(0, 1000, ()))))
    finally:
        torch.set_grad_enabled(True)


def _check_counterfactual(model):
    T, U, L = 9, 4, model.config.n_layer
    ids = torch.randint(0, 37, (1, T))
    y = torch.randint(0, 37, (1, T))
    out = forward_counterfactual(model, ids, y, tau=0.5)
    history = []
    roll = forward_ragged(model, ids, taus=0.5, history=history)
    assert torch.equal(roll["exits"], out["exits"])
    for i in range(T):  # token i alone: committed K/V of j < i at depth d, plus its own candidate
        h = model.embed_tokens(ids[:, i:i + 1])
        cos, sin = model.rope(torch.tensor([i]), h.dtype)
        for d in range(U):
            for l in range(L):
                ck, cv = history[d * L + l]
                h = model.layers[l](h, cos, sin, lambda q, k, v: attention(
                    q, torch.cat([ck[:, :, :i], k], 2), torch.cat([cv[:, :, :i], v], 2),
                    torch.ones(1, i + 1, dtype=torch.bool)))
            hn, gate, h = model.exit_heads(h)
            ce = F.cross_entropy(model.lm_head(hn[0]), y[0, i:i + 1])
            assert abs(float(ce) - float(out["losses"][0, i, d])) < 1e-10
            assert abs(float(gate[0, 0]) - float(out["gate_logits"][0, i, d])) < 1e-10


def test_reinforce_returns_and_advantages_hand_worked():
    tok = torch.tensor([[[1.0, 2.0, 3.0]]])
    mask = torch.ones(1, 3)
    G = objectives.suffix_returns(tok, mask)
    assert G.tolist() == [[[6.0, 5.0, 3.0]]]
    assert objectives.suffix_returns(tok, torch.tensor([[1.0, 0.0, 1.0]])).tolist() == [[[4.0, 3.0, 3.0]]]
    A = objectives.reinforce_advantages(G, torch.tensor([[0.5, 0.5, 0.5]]), mask)   # K=1: dense final path
    assert A.tolist() == [[[4.5, 4.0, 2.5]]]
    G4 = torch.tensor([[[4.0]], [[8.0]], [[0.0]], [[4.0]]], dtype=torch.float64)                    # K=4: leave one out
    assert torch.allclose(objectives.reinforce_advantages(G4, None, None).flatten(),
                          torch.tensor([0.0, 16 / 3, -16 / 3, 0.0], dtype=torch.float64))


def test_reinforce_score_term_sign():
    """A trajectory with a higher loss than its baseline is made less likely by a descent step."""
    g = torch.zeros(1, 1, 4, requires_grad=True)
    rho = exit_log_pdf(g)[..., 1]                           # the sampled exit was depth 2
    (rho * torch.tensor(3.0)).sum().backward()              # positive advantage
    lam_grad = g.grad[0, 0, 1]
    assert lam_grad > 0  # descent lowers gate logit 2, so exiting at 2 becomes less likely


def test_spearman_and_jump_rates():
    assert abs(metrics.spearman([1, 2, 3, 4], [10, 20, 30, 40]) - 1) < 1e-12
    assert abs(metrics.spearman([1, 2, 3, 4], [4, 3, 2, 1]) + 1) < 1e-12
    a, b = [1, 1, 2, 3], [1, 2, 2, 3]   # ties take average ranks: [1.5,1.5,3,4] vs [1,2.5,2.5,4]
    ra, rb = np.array([1.5, 1.5, 3, 4]), np.array([1, 2.5, 2.5, 4])
    assert abs(metrics.spearman(a, b) - np.corrcoef(ra, rb)[0, 1]) < 1e-12


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=str(d), size=30000))
    return str(d)


@pytest.mark.parametrize("method,extra", [("direct", []), ("counterfactual", []), ("reinforce", ["--reinforce_k=1"]),
                                          ("reinforce", ["--reinforce_k=4"])])
def test_each_objective_trains(tmp_path, data_dir, method, extra):
    out = str(tmp_path / "o")
    train.main(TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=24", "--eval_interval=24",
                       "--ragged_aware", f"--ra_method={method}", "--global_kl", "--learning_rate=1e-2",
                       "--batch_size=8", "--eval_thr=0.3,0.5"] + extra)
    log = read_log(out)
    steps = [r for r in log if "train_loss" in r]
    kinds = {r["step"] for r in steps}
    assert kinds == ({"dense", "ragged"} if method == "direct" else
                     {"dense", "counterfactual"} if method == "counterfactual" else {"reinforce"})
    for kind in kinds:
        losses = [r["train_loss"] for r in steps if r["step"] == kind]
        assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, (kind, losses)
    ev = log[-1]
    for key in ("iter", "tokens", "val_loss_fixed", "val_loss_ragged", "avg_exit_depth", "exit_fractions",
                "jump_rates", "large_jump_rate", "kl_global", "depth_by_difficulty", "difficulty_spearman"):
        assert key in ev
    assert set(ev["val_loss_ragged"]) == {"0.3", "0.5"} and len(ev["jump_rates"]) == 4
    assert abs(sum(ev["jump_rates"]) - 1) < 1e-3 and abs(sum(ev["exit_fractions"]) - 1) < 1e-3


def test_eval_metrics_against_brute_force(data_dir):
    c = dict(train.DEFAULTS)
    c.update(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, ffn_hidden=24, block_size=16, batch_size=4,
             eval_iters=2, data_dir=data_dir, eval_thr="0.5,0.3")
    from types import SimpleNamespace
    c = SimpleNamespace(**c)
    model = random_model(3, vocab_size=44, block_size=16).float()
    val = train.load_split(c, "val")
    labels = np.memmap(os.path.join(data_dir, "synthetic", "val_labels.bin"), dtype=np.uint8, mode="r")
    prior = objectives.exit_prior("uniform", 4)
    m = metrics.evaluate(model, val, labels, c, prior, torch.autocast("cpu", enabled=False), "cpu")
    g = torch.Generator().manual_seed(c.seed + 1)
    exits, labs, at_03, shifts = [], [], [], []
    for _ in range(2):
        starts = metrics.draw_starts(val, c, 4, g)
        x, _ = metrics.get_batch(val, c, starts, "cpu")
        e = forward_ragged(model, x, taus=0.5)["exits"]
        with torch.no_grad():                                       # each loop's |block(h) - h| / |h|, by hand
            h = model.embed_tokens(x)
            cos, sin = model.rope(torch.arange(16), h.dtype)
            for _ in range(4):
                out = model.block(h, cos, sin)
                shifts.append(((out - h).norm(dim=-1) / h.norm(dim=-1)).reshape(-1))
                h = model.exit_heads(out)[2]
        at_03 += [v for row in forward_ragged(model, x, taus=0.3)["exits"].tolist() for v in row]
        for row, s in zip(e.tolist(), starts):
            exits.append(row)
            labs.append([int(labels[s + 1 + i]) for i in range(16)])   # label of token i+1
    flat = [v for row in exits for v in row]
    jumps = [abs(r[i] - r[i - 1]) for r in exits for i in range(1, 16)]
    assert abs(m["avg_exit_depth"] - np.mean(flat)) < 1e-4
    assert all(abs(m["jump_rates"][k] - np.mean([j == k for j in jumps])) < 1e-4 for k in range(4))
    fl = [l for row in labs for l in row]
    for k in range(5):
        sel = [e for e, l in zip(flat, fl) if l == k]
        got = m["depth_by_difficulty"][str(k)]
        assert got is None if not sel else abs(got - np.mean(sel)) < 1e-4
    for t, ev in (("0.5", flat), ("0.3", at_03)):              # the Spearman of the sweep, at each threshold
        pairs = [(e, l) for e, l in zip(ev, fl) if l > 0]
        rho = brute_spearman([e for e, _ in pairs], [l for _, l in pairs])
        got = m["difficulty_spearman_by_thr"][t]
        assert (got is None and np.isnan(rho)) or abs(got - rho) < 1e-4, (t, got, rho)
    assert m["difficulty_spearman"] == m["difficulty_spearman_by_thr"]["0.5"]
    by_loop = torch.stack(shifts).reshape(2, 4, -1).mean(-1).mean(0)   # per loop: batches, then tokens
    assert all(abs(m["loop_shift"][d] - float(by_loop[d])) < 1e-4 for d in range(4))


def brute_spearman(a, b):
    """Pearson correlation of average ranks (ties share the mean of their ranks)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out, i = [0.0] * len(v), 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return np.array(out)
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def test_torchrun_two_processes_match_one(tmp_path, data_dir):
    """torchrun with the default gradient_accumulation_steps=1: each of 2 processes runs one micro-batch,
    which equals one process with 2 micro-batches (the same global batch), step-scope global KL included."""
    common = TINY + [f"--data_dir={data_dir}", "--max_iters=4", "--eval_interval=4", "--ragged_aware", "--global_kl"]
    one = str(tmp_path / "one")
    train.main(common + [f"--out_dir={one}", "--gradient_accumulation_steps=2"])
    two = str(tmp_path / "two")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(HERE, "train.py")] + common + [f"--out_dir={two}"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 micro-batch(es) of 4x16 = 128 tokens per step (1 per process x 2 process(es))" in r.stderr
    a = [x["train_loss"] for x in read_log(one) if "train_loss" in x]
    b = [x["train_loss"] for x in read_log(two) if "train_loss" in x]
    assert len(a) == len(b) == 4
    assert np.allclose(a, b, rtol=1e-4, atol=1e-5), (a, b)
    va = read_log(one)[-1]["val_loss_fixed"]
    vb = read_log(two)[-1]["val_loss_fixed"]
    assert np.allclose(va, vb, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- global KL over the whole step (Eq. 10)

def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _kl_setup(seed, scope="step"):
    model = random_model(seed).train()                        # float64
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 37, (4, 12), generator=g), torch.randint(0, 37, (4, 12), generator=g)
    return model, x, y, objectives.Objective(global_kl=True, kl_scope=scope), objectives.exit_prior("poisson", 4)


def _two_process_worker(rank, seed, init_file, out):
    import torch.distributed as dist
    from contextlib import nullcontext
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model, x, y, c, prior = _kl_setup(seed)
    mine = slice(2 * rank, 2 * rank + 2)
    loss, _, kl_step = objectives.train_step(model, [(x[mine], y[mine], None)], 0, prior, c, 0.3, nullcontext(), 2, 2)
    if rank == 0:
        torch.save({"grad": _grads(model), "loss": loss, "kl": kl_step}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_step_scope_global_kl_gradient_equals_single_batch_eq10(tmp_path):
    """--kl_scope=step: 2 processes x 1 micro-batch and 1 process x 2 micro-batches give the gradient
    of Eq. 10 computed on the whole batch at once (float64); --kl_scope=micro does not."""
    from contextlib import nullcontext
    seed = int(torch.randint(0, 10_000, ()))
    model, x, y, c, prior = _kl_setup(seed)
    out = model(x, y)
    loss, _, reg, pi = objectives.dense_loss(out["losses"], out["gate_logits"], prior, True, 0.3)
    loss.backward()
    ref = _grads(model)
    assert abs(reg.item() - float(objectives.kl_global(pi, prior))) < 1e-12
    runs = {}
    for scope in ("step", "micro"):
        model, x, y, c, prior = _kl_setup(seed, scope)
        value, _, kl_step = objectives.train_step(model, [(x[:2], y[:2], None), (x[2:], y[2:], None)], 0, prior, c, 0.3,
                                             nullcontext(), 2, 1)
        runs[scope] = _grads(model)
        assert abs(kl_step - reg.item()) < 1e-12            # the logged KL is the step's, in both scopes
    assert torch.allclose(runs["step"], ref, atol=1e-12, rtol=1e-9)
    assert abs(value - loss.item()) > 1e-6 and not torch.allclose(runs["micro"], ref, atol=1e-6)
    torch.multiprocessing.spawn(_two_process_worker, args=(seed, str(tmp_path / "init"), str(tmp_path / "g.pt")),
                                nprocs=2)
    two = torch.load(tmp_path / "g.pt", weights_only=True)
    assert torch.allclose(two["grad"], ref, atol=1e-12, rtol=1e-9)
    assert abs(two["loss"] - loss.item()) < 1e-10 and abs(two["kl"] - reg.item()) < 1e-12
