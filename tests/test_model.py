"""Model and exit maths against brute force; the cached Ouro-mode decode against the recompute oracle."""
import math

import pytest
import torch

from conftest import random_model
from model import exit_cdf, exit_now, exit_pdf, generate, sample_exit, threshold_exit
from engine.request import keyed_uniform, sample_set, sample_token, sample_tokens, seed_bits


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


def test_loop_shift_is_zero_for_an_identity_loop_and_the_relative_step_otherwise():
    """loop_shift (Figure 7's diagnostic): with every layer's output projections zeroed, the block is
    the identity and each loop moves nothing; with one loop's layers acting, its shift is
    |block(h) - h| / |h| computed from the layers one at a time, in float64."""
    model = random_model(int(torch.randint(0, 2**31, ())))
    x = torch.randint(0, 37, (2, 12))
    with torch.no_grad():
        h = model.embed_tokens(x)
        cos, sin = model.rope(torch.arange(12), h.dtype)
        out = h
        for layer in model.layers:
            out = layer(out, cos, sin)
        want = (out - h).norm(dim=-1) / h.norm(dim=-1)
        got = model(x, loop_shift=True)["loop_shift"]
        assert got.shape == (2, 12, 4) and torch.allclose(got[..., 0], want, atol=1e-12, rtol=0)
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        assert model(x, loop_shift=True)["loop_shift"].abs().max() < 1e-12


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
        def f(logits):
            logged[naive].append(logits.clone())
            return sample_token(logits, 1.0, 0, 0.9, seed=3, position=len(logged[naive]))
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
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if top_k and top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:                                   # no nucleus: every token, masked ones at probability 0
        return dict(enumerate(probs.tolist()))
    sp, si = torch.sort(probs, descending=True)
    keep = (sp.cumsum(0) - sp) < top_p
    return dict(zip(si[keep].tolist(), sp[keep].tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("V,scale", [(5, 1.0), (300, 0.1), (5000, 0.05), (50257, 3.0)])
def test_sample_set_equals_sorting_the_vocabulary(V, scale, dtype):
    """Fresh logits, flat (a nucleus of thousands: the search widens) and peaked: the same tokens with
    the same probabilities as the full sort, for top-p alone, with top-k, and top-p off."""
    for _ in range(4):
        logits = (torch.randn(V) * scale).to(dtype)
        temperature, top_p = float(torch.rand(()) * 1.5 + 0.2), float(torch.rand(()) * 0.98 + 0.01)
        for top_k, p in [(0, top_p), (int(torch.randint(1, V + 2, ())), top_p), (0, 1.0)]:
            ids, probs, _ = sample_set(logits, temperature, top_k, p)
            ref = nucleus_by_sort(logits, temperature, top_k, p)
            assert sorted(ids.tolist()) == sorted(ref) and len(ids) == len(set(ids.tolist()))
            assert all(math.isclose(q, ref[i], rel_tol=0, abs_tol=1e-15) for i, q in zip(ids.tolist(), probs.tolist()))


def test_sample_token_draws_only_from_the_set_and_all_of_it():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    assert sample_token(logits, 0) == 0
    assert {sample_token(logits, 1.0, 2, 1.0, seed=0, position=i) for i in range(300)} == {0, 1}
    p = torch.softmax(logits.double(), 0)
    k = int((p.cumsum(0) < 0.8).sum()) + 1             # top-p 0.8: the smallest prefix reaching 0.8 mass
    assert k == 2 and float(p[:k - 1].sum()) < 0.8 <= float(p[:k].sum())
    assert {sample_token(logits, 1.0, 0, 0.8, seed=5, position=i) for i in range(500)} == set(range(k))
    # the same (seed, position) draws the same token; another seed draws other tokens
    draw = lambda seed: [sample_token(logits, 1.0, 0, 0.95, seed=seed, position=i) for i in range(40)]
    assert draw(7) == draw(7) != draw(8)


def hash_reference(seed, position, i, bits):
    """request.keyed_uniform with Python's integers, written out."""
    M = 2**32 - 1

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x5BD1E995) & M
        return x ^ (x >> 16)
    key = mix((seed & M) ^ mix((seed >> 32) ^ mix(position)))
    a = mix((key + mix((i + 0x9E3779B9) & M)) & M)
    word = a >> 9 if bits == 23 else (a << 20) | (mix(a ^ 0x68E31DA4) >> 12)
    return (word + 0.5) * 2.0 ** -bits


@pytest.mark.parametrize("dtype,bits", [(torch.float64, 52), (torch.float32, 23)])
def test_keyed_uniform_is_its_integer_hash_bit_for_bit(dtype, bits):
    """The noise is integer arithmetic with no overflow: int64 tensors give what Python's integers
    give, for seeds over all 64 bits, so a draw is the same on any device."""
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1] + [int(torch.randint(0, 2**62, ())) * 4 + 3 for _ in range(5)]
    pos = torch.randint(0, 100_000, (len(seeds),))
    ids = torch.randint(0, 200_000, (7,))
    u = keyed_uniform(torch.tensor([seed_bits(s) for s in seeds]), pos, ids, dtype)
    ref = [[hash_reference(s, int(p), int(i), bits) for i in ids] for s, p in zip(seeds, pos)]
    assert u.dtype == dtype and u.tolist() == ref and 0 < u.min() and u.max() < 1


def random_sampling(R, V, dtype):
    logits = (torch.randn(R, V) * float(torch.rand(()) * 4 + 0.1)).to(dtype)
    temperature = (torch.rand(R) * 1.8 + 0.1).to(dtype)
    temperature[torch.rand(R) < 0.2] = 0.0
    top_k = torch.where(torch.rand(R) < 0.5, torch.randint(1, V + 3, (R,)), 0)
    top_p = torch.where(torch.rand(R) < 0.6, torch.rand(R) * 0.98 + 0.01, 1.0).to(dtype)
    seed = torch.randint(-2**63, 2**63 - 1, (R,))
    return logits, temperature, top_k, top_p, seed, torch.randint(0, 4096, (R,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_tokens_equals_sample_token(dtype):
    """The graph's sampler (sort every row) and the eager one (the nucleus among the top tokens) draw
    the same token from the same (logits, seed, position), greedy rows included."""
    for V in (2, 37, 1000, 50257):
        logits, temperature, top_k, top_p, seed, pos = random_sampling(6, V, dtype)
        batch = sample_tokens(logits, temperature, top_k, top_p, seed, pos)
        one = [sample_token(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]), int(seed[r]) % 2**64,
                            int(pos[r])) for r in range(6)]
        assert batch.tolist() == one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampling_without_a_sort_draws_the_sorting_samplers_tokens(dtype):
    """Where no row asks for top-k or top-p (a pass's "gumbel" kind), the Gumbel-max over the whole
    vocabulary without the sort draws the same token as the sorting sampler, for every (seed,
    position), greedy rows included."""
    for V in (2, 37, 1000, 50257):
        logits, temperature, _, _, seed, pos = random_sampling(16, V, dtype)
        top_k, top_p = torch.zeros(16, dtype=torch.long), torch.ones(16, dtype=dtype)
        sorted_ = sample_tokens(logits, temperature, top_k, top_p, seed, pos)
        assert sample_tokens(logits, temperature, top_k, top_p, seed, pos, nucleus=False).tolist() == sorted_.tolist()


def test_sample_tokens_is_the_same_whatever_else_is_batched():
    """A row's token depends on its logits, its request's seed and its position only: alone, or
    among other rows in any order and number, it draws the same token, for every position."""
    V = 300
    row = random_sampling(1, V, torch.float32)
    row[1][0], row[3][0] = 1.0, 0.9                       # sampled, with a nucleus
    for _ in range(20):
        n = int(torch.randint(1, 40, ()))
        others = random_sampling(n, V, torch.float32)
        at = int(torch.randint(0, n + 1, ()))
        batch = [torch.cat([o[:at], r, o[at:]]) for o, r in zip(others, row)]
        for p in range(0, 3000, 500):
            batch[5][at] = row[5][0] = p
            assert sample_tokens(*batch)[at] == sample_tokens(*row)[0]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.9), (4, 1.0)])
def test_sampled_tokens_follow_the_softmax_of_the_nucleus(top_k, top_p):
    """Chi-square over 20,000 positions of one seed on a vocabulary of 6: the frequencies are the
    softmax of the logits over the nucleus (Wilson-Hilferty's normal approximation, z < 5)."""
    logits = torch.randn(6, dtype=torch.float64) * 1.5
    ids, probs, _ = sample_set(logits, 1.0, top_k, top_p)
    ids, probs = ids[probs > 0], probs[probs > 0]       # top-k masks tokens to probability 0
    N = 20_000
    pos = torch.arange(N)
    seed = torch.full((N,), int(torch.randint(0, 2**62, ())))
    tok = sample_tokens(logits.expand(N, 6), torch.ones(N, dtype=torch.float64), torch.full((N,), top_k),
                        torch.full((N,), top_p, dtype=torch.float64), seed, pos)
    counts = torch.bincount(tok, minlength=6)
    assert set(tok.tolist()) <= set(ids.tolist())
    expect = torch.zeros(6, dtype=torch.float64)
    expect[ids] = probs / probs.sum() * N
    chi2 = float(((counts[ids] - expect[ids]) ** 2 / expect[ids]).sum())
    df = len(ids) - 1
    if df:
        z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        assert z < 5, (chi2, df)
