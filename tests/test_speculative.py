"""Self-speculative decoding (speculative.py) against fixed@U (float64): greedy tokens, exits and
logits equal token for token at every draft depth and the gate's, alone, in mixed batches under both
schedulers and the shared head, under preemption, with stop ids and cancellation, the page tables
checked after every step; the pipeline's passes counted exactly; sampled tokens distributed as
fixed@U's (a chi-square test that a wrong acceptance rule fails); bad values refused."""
import random

import pytest
import torch

from configurator import UserError
from conftest import U, alone, assert_same, clone, drive, engine, prompt, random_model, varied_model
from engine import speculative
from engine.request import Request
from engine.speculative import accept_uniform, draw, probs
from serve_depthbatch import Engine


def fixed_twin(r):
    """The same request at fixed@U: what speculative decoding must give."""
    f = clone(r)
    f.mode, f.depth = "fixed", U
    return f


def spec(ids, n, rng, **kw):
    return Request(ids, n, "speculative", rng.choice([0.2, 0.5, 0.8]), draft_k=rng.randint(1, 5),
                   draft_depth=rng.randint(0, U - 1), keep_logits=True, **kw)


@pytest.mark.parametrize("draft_depth", range(U))
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_fixed_at_every_draft_depth(draft_depth, k):
    model = varied_model()
    r = Request(prompt(random.randint(3, 12)), random.randint(8, 20), "speculative", random.random(),
                draft_k=k, draft_depth=draft_depth, keep_logits=True)
    e = engine(model, 4000)
    drive(e, [r])
    assert_same(r, alone(model, fixed_twin(r)))
    assert r.token_exits == [U] * len(r.tokens)
    assert r.kv["physical"] == r.kv["dense"]                         # every kept position at depth U
    s = e.stats
    # every token is a position verified at depth U (the first, the prompt's last); a draft is
    # kept or refused there, and only a refusal leaves work behind (the positions after it, dropped)
    assert s["verifies"] == len(r.tokens) and s["drafted"] >= s["accepted"]
    assert (r.kv["block_evals"] > r.kv["physical"]) == (s["drafted"] > s["accepted"])
    assert s["verify_passes"] == s["verifies"] and (s["draft_passes"] > 0) == (s["drafted"] > 0)


def test_a_kept_draft_saves_the_passes_its_position_ran_beside_its_predecessor():
    """The pipeline, counted: one request with a fixed draft depth d and room for every draft in
    flight (k = U). The first token takes the prompt's passes (U a chunk: one chunk, or a chunk a
    position under --max_rows=1); the token after a kept draft is verified d passes after the one
    before (its position started when that one reached depth d); any other, U passes after (its
    position starts once the one before is verified, on a replacement or on a token drawn at U).
    So the passes are prompt + d·kept + U·(the other tokens after the first) exactly, whatever the
    row budget (a decode position always starts), and the tokens are fixed@U's."""
    for rows in (1, 64, 1, 64):
        model = varied_model()
        d = random.randint(1, U - 1)
        r = Request(prompt(random.randint(1, 8)), random.randint(6, 16), "speculative", 0.5, draft_k=U,
                    draft_depth=d, keep_logits=True)
        e = Engine(model, 4000, max_batch=1, max_rows=rows)
        drive(e, [r])
        assert_same(r, alone(model, fixed_twin(r)))
        kept, others = e.stats["accepted"], len(r.tokens) - 1 - e.stats["accepted"]
        assert e.stats["passes"] == U * (len(r.prompt) if rows == 1 else 1) + d * kept + U * others


@pytest.mark.parametrize("head", ["eager", "shared"])
@pytest.mark.parametrize("scheduler", ["continuous", "nested"])
def test_mixed_batches_equal_each_alone(scheduler, head):
    """Speculative requests beside every other mode, arriving at different steps: each speculative one
    equals fixed@U alone, each other one equals itself alone."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = []
    for _ in range(8):
        ids = prompt(rng.randint(3, 12))
        if rng.random() < 0.5:
            reqs.append(spec(ids, rng.randint(2, 12), rng))
        else:
            mode = rng.choice(["fixed", "ouro", "dense_ragged", "ete_ragged"])
            reqs.append(Request(ids, rng.randint(2, 12), mode, rng.choice([0.3, 0.6]),
                                depth=rng.randint(1, U) if mode == "fixed" else 0, keep_logits=True))
    e = engine(model, 4000, head, max_batch=5, max_rows=24, scheduler=scheduler)
    drive(e, reqs, sorted(rng.randint(0, 10) for _ in reqs))
    for r in reqs:
        assert_same(r, alone(model, fixed_twin(r) if r.mode == "speculative" else r))


def test_preemption_replays_exactly():
    """A pool too small for the batch: requests are preempted with positions in flight (drafts
    dropped, the replay from the verified tokens) and each still equals fixed@U alone."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = [spec(prompt(rng.randint(4, 10)), rng.randint(8, 16), rng) for _ in range(6)]
    e = Engine(model, 150, max_batch=6, max_rows=32)
    drive(e, reqs)
    assert e.stats["preemptions"] > 0
    for r in reqs:
        assert_same(r, alone(model, fixed_twin(r)))


def test_stop_ids_and_cancellation():
    """A stop id inside an accepted run of drafts ends the request there, as in fixed@U; a request
    cancelled from its callback keeps a prefix of fixed@U's tokens and gives back every page."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    ids = prompt(8)
    full = alone(model, Request(ids, 16, "fixed"))
    stop = full.tokens[rng.randint(2, 10)]
    r = Request(ids, 16, "speculative", 0.5, draft_k=4, draft_depth=rng.randint(0, U - 1), stop=(stop,))
    drive(Engine(model, 4000), [r])
    assert r.tokens == full.tokens[:full.tokens.index(stop) + 1] and r.finish_reason == "stop"
    cut = [spec(prompt(6), 16, rng) for _ in range(3)]
    drive(Engine(model, 4000, max_batch=3), cut, cancel_at={0: 3, 2: 7})
    for i, r in enumerate(cut):
        assert r.tokens == alone(model, fixed_twin(r)).tokens[:len(r.tokens)]
        assert r.finish_reason == ("length" if i == 1 else "cancelled")


def test_bad_values_are_refused():
    model = varied_model()
    e = Engine(model, 4000)
    for field, value, says in [("draft_k", 0, "draft_k=0"), ("draft_k", 65, "1..64"),
                               ("draft_depth", U, f"0..{U - 1}"), ("draft_depth", -1, "draft_depth"),
                               ("thr", 1.5, "thr=1.5")]:
        r = Request(prompt(4), 4, "speculative", **{field: value})
        with pytest.raises(UserError, match=says):
            e.add(r)
    with pytest.raises(UserError, match="eager runner"):
        Engine(model, 4000, runner="slots").add(Request(prompt(4), 4, "speculative"))


# ----------------------------------------------------------------------------- the sampled distribution

V, DRAWS = 6, 3000


def chi_square_p(counts, expected):
    """The chi-square test's p-value, cells of expected count under 5 pooled (a draw where fixed@U
    has probability 0: p = 0)."""
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = (expected < 5) & (expected > 0)
    obs = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    exp = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), stat / 2))


def exact_pairs(model, ids, r):
    """P(the second and third sampled tokens = (b, c)) under fixed@U with r's sampling: [V * V]."""
    full = lambda ctx: probs(model(torch.tensor([ctx]), keep_logits=True)["logits"][U - 1][0, -1],
                             r).double().detach()
    out = torch.zeros(V, V, dtype=torch.float64)
    for a, pa in enumerate(full(ids).tolist()):
        for b, pb in enumerate(full(ids + [a]).tolist()):
            if pa * pb > 0:
                out[b] += pa * pb * full(ids + [a, b])
    return out.flatten()


def sampled_pairs(model, ids, how):
    """The (second, third) tokens of DRAWS sampled requests of four, counted: [V * V]."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    reqs = [Request(list(ids), 4, "speculative", 0.5, draft_k=U, draft_depth=1, seed=rng.getrandbits(63),
                    **how) for _ in range(DRAWS)]
    Engine(model, 40000, max_batch=256, max_rows=1024).run(reqs)
    return torch.bincount(torch.tensor([r.tokens[1] * V + r.tokens[2] for r in reqs]),
                          minlength=V * V).double()


@pytest.mark.parametrize("how", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_sampled_tokens_are_distributed_as_fixed(how, monkeypatch):
    """The second and third tokens of 3,000 sampled requests of four tokens (each drafted at depth 1
    and kept or replaced; the third drafted while the second is not verified yet, so drafted again
    after a refused second: the pipeline's own case) against their exact joint law under fixed@U:
    the chi-square test passes; with the rule broken (every draft kept, or a refused draft replaced
    from p instead of max(0, p - q)), the same test fails. The model is one whose depth-1 and
    depth-U laws differ enough for that (a precondition, not a tuning)."""
    model = random_model(11, vocab_size=V)
    ids = [1, 4, 2]
    expected = exact_pairs(model, ids, Request(ids, 3, **how)) * DRAWS
    assert chi_square_p(sampled_pairs(model, ids, how), expected) > 1e-4

    def keep_all(r, position, draft, full):
        return draft[0], True

    def replace_from_p(r, position, draft, full):
        (x, q_lg), (_, p_lg) = draft, full
        p, q = probs(p_lg, r), probs(q_lg, r)
        if accept_uniform(r, position) * float(q[x]) > float(p[x]):
            return draw(p, r, position), False
        return x, True
    for wrong in (keep_all, replace_from_p):
        monkeypatch.setattr(speculative, "accept", wrong)
        assert chi_square_p(sampled_pairs(model, ids, how), expected) < 1e-6, wrong.__name__
