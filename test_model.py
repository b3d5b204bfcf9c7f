"""Model and exit maths against brute force; the cached Ouro-mode decode against the recompute oracle."""
import math

import pytest
import torch

from conftest import random_model
from model import GPTConfig, LoopedLM, exit_cdf, exit_now, exit_pdf, generate, sample_exit, threshold_exit
from request import sample_set, sample_token


def brute_pdf(lam):
    U = len(lam)
    out = []
    for d in range(U):
        p = 1.0
        for r in range(d):
            p *= 1 - lam[r]
        out.append(p * lam[d] if d < U - 1 else p)
    return out


def test_exit_pdf_sums_to_one_and_matches_brute_force():
    g = torch.randn(50, 4, dtype=torch.float64) * 3
    pi = exit_pdf(g)
    assert torch.allclose(pi.sum(-1), torch.ones(50, dtype=torch.float64), atol=1e-12)
    lam = torch.sigmoid(g)
    for i in range(50):
        assert torch.allclose(pi[i], torch.tensor(brute_pdf(lam[i].tolist()), dtype=torch.float64), atol=1e-14)
    assert torch.allclose(exit_cdf(g)[:, :-1], pi.cumsum(-1)[:, :-1], atol=1e-12)


def test_exit_pdf_is_fp32_for_bf16_gates():
    g = torch.full((3, 4), 7.0, dtype=torch.bfloat16)  # bf16 sigmoid(7) rounds to 1.0
    assert exit_pdf(g).dtype == torch.float32
    assert float(exit_pdf(g)[0, 1]) > 0  # depth 2 keeps the mass that bf16 would lose


@pytest.mark.parametrize("tau", [0.0, 0.1, 0.3, 0.5, 0.7, 0.95, 1.0])
def test_threshold_exit_matches_brute_force(tau):
    g = torch.randn(200, 4, dtype=torch.float64) * 2
    e = threshold_exit(g, tau)
    pi = exit_pdf(g)
    for i in range(200):
        want = 4
        for d in range(1, 4):  # Eq. 4: the first d whose cumulative pdf reaches τ; d = U always
            if float(pi[i, :d].sum()) >= tau - 1e-12 and float(1 - torch.prod(1 - torch.sigmoid(g[i, :d]))) >= tau:
                want = d
                break
        assert int(e[i]) == want
    if tau == 0.0:
        assert (e == 1).all()


def test_online_exit_decisions_equal_batch_decisions():
    g = torch.randn(300, 4) * 2
    for tau in (0.2, 0.5, 0.8):
        survive = torch.ones(300)
        exited = torch.zeros(300, dtype=torch.bool)
        e = torch.full((300,), 4)
        for d in range(4):  # decided at depth d from gates <= d only
            survive, now = exit_now(survive, g[:, d], tau)
            first = now & ~exited
            e[first & (d < 3)] = d + 1
            exited |= now
        assert torch.equal(e, threshold_exit(g, tau).long())


def test_sampled_exit_follows_pi():
    g = torch.tensor([[-1.0, 0.5, 0.0, 2.0]]).expand(40000, 4)
    e = sample_exit(g, torch.Generator().manual_seed(0))
    freq = torch.bincount(e - 1, minlength=4).double() / 40000
    assert torch.allclose(freq, exit_pdf(g[:1].double())[0], atol=0.01)


def test_dense_forward_losses_match_logits_and_grad_flows():
    model = random_model(0).train()
    x = torch.randint(0, 37, (2, 16))
    y = torch.randint(0, 37, (2, 16))
    out = model(x, y)
    with torch.no_grad():
        ref = model(x, keep_logits=True)
    for d in range(4):
        ce = torch.nn.functional.cross_entropy(ref["logits"][d].reshape(-1, 37), y.reshape(-1), reduction="none")
        assert torch.allclose(out["losses"][..., d].reshape(-1), ce, atol=1e-10)
    (exit_pdf(out["gate_logits"]) * out["losses"]).sum().backward()
    assert model.early_exit_gate.weight.grad.abs().sum() > 0
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_dense_forward_is_causal():
    model = random_model(1)
    x = torch.randint(0, 37, (1, 20))
    x2 = x.clone()
    x2[0, 12:] = (x2[0, 12:] + 5) % 37
    a, b = model(x, keep_logits=True), model(x2, keep_logits=True)
    for d in range(4):
        assert torch.allclose(a["logits"][d][0, :12], b["logits"][d][0, :12], atol=1e-12)
    assert torch.allclose(a["gate_logits"][0, :12], b["gate_logits"][0, :12], atol=1e-12)


@pytest.mark.parametrize("loop_norm", [False, True])
@pytest.mark.parametrize("mode,depth,thr", [("ouro", None, 0.5), ("ouro", None, 0.8), ("fixed", 1, None),
                                            ("fixed", 3, None)])
def test_cached_decode_equals_recompute_oracle(loop_norm, mode, depth, thr):
    model = random_model(int(torch.randint(0, 10_000, ())), loop_norm=loop_norm)
    prompt = torch.randint(0, 37, (7,)).tolist()
    logged = {True: [], False: []}

    def recorder(naive):
        gen = torch.Generator().manual_seed(3)

        def f(logits):
            logged[naive].append(logits.clone())
            return sample_token(logits, 1.0, 0, 0.9, gen)
        return f

    a = generate(model, prompt, 20, mode, depth, thr, recorder(True), naive=True)
    b = generate(model, prompt, 20, mode, depth, thr, recorder(False))
    assert a == b
    for la, lb in zip(logged[True], logged[False]):
        assert torch.allclose(la, lb, atol=1e-10, rtol=0)
    if mode == "ouro":
        assert len(set(a[1])) > 1 or thr == 0.8  # exits really vary on this model


def test_ouro_mode_extremes_reproduce_fixed_depths():
    model = random_model(5)
    prompt = [1, 2, 3, 4]
    assert generate(model, prompt, 12, "ouro", thr=0.0)[0] == generate(model, prompt, 12, "fixed", 1)[0]
    assert generate(model, prompt, 12, "ouro", thr=1.0)[0] == generate(model, prompt, 12, "fixed", 4)[0]


def nucleus_by_sort(logits, temperature, top_k, top_p):
    """The slow reference of request.sample_set: mask to the top k, softmax, sort the whole vocabulary."""
    logits = logits.double() / temperature
    if top_k and top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:                                   # no nucleus: every token, masked ones at probability 0
        return dict(enumerate(probs.tolist()))
    sp, si = torch.sort(probs, descending=True)
    keep = (sp.cumsum(0) - sp) < top_p
    return dict(zip(si[keep].tolist(), sp[keep].tolist()))


@pytest.mark.parametrize("V,scale", [(5, 1.0), (300, 0.1), (5000, 0.05), (50257, 3.0)])
def test_sample_set_equals_sorting_the_vocabulary(V, scale):
    """Fresh logits, flat (a nucleus of thousands: the search widens) and peaked: the same tokens with
    the same probabilities as the full sort, for top-p alone, with top-k, and top-p off."""
    for _ in range(4):
        logits = torch.randn(V) * scale
        temperature, top_p = float(torch.rand(()) * 1.5 + 0.2), float(torch.rand(()) * 0.98 + 0.01)
        for top_k, p in [(0, top_p), (int(torch.randint(1, V + 2, ())), top_p), (0, 1.0)]:
            ids, probs = sample_set(logits, temperature, top_k, p)
            ref = nucleus_by_sort(logits, temperature, top_k, p)
            assert sorted(ids.tolist()) == sorted(ref) and len(ids) == len(set(ids.tolist()))
            assert all(math.isclose(q, ref[i], rel_tol=0, abs_tol=1e-15) for i, q in zip(ids.tolist(), probs.tolist()))


def test_sample_token_draws_only_from_the_set_and_all_of_it():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    assert sample_token(logits, 0) == 0
    assert {sample_token(logits, 1.0, 2, 1.0, gen) for _ in range(300)} == {0, 1}
    p = torch.softmax(logits.double(), 0)
    k = int((p.cumsum(0) < 0.8).sum()) + 1             # top-p 0.8: the smallest prefix reaching 0.8 mass
    assert k == 2 and float(p[:k - 1].sum()) < 0.8 <= float(p[:k].sum())
    assert {sample_token(logits, 1.0, 0, 0.8, gen) for _ in range(500)} == set(range(k))
    # the same seed draws the same tokens
    draw = lambda: [sample_token(logits, 1.0, 0, 0.95, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert draw() == draw()
