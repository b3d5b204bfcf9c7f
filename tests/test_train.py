"""Objectives, schedules, configurator, resume exactness and bad input for train/sample/prepare (the
datasets: tests/test_data.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import configurator
import objectives
import prepare_data
import run_folder
import sample
import train
from configurator import UserError
from conftest import TINY, read_log
from model import exit_pdf

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project root
# ----------------------------------------------------------------------------- priors and regularizers

def test_priors_match_appendix_b():
    assert torch.allclose(objectives.exit_prior("uniform", 4), torch.full((4,), 0.25, dtype=torch.float64))
    g = objectives.exit_prior("geometric", 4)
    p = objectives.exit_prior("poisson", 4)
    assert torch.allclose(g, torch.tensor([0.395, 0.276, 0.193, 0.135], dtype=torch.float64), atol=6e-4)
    assert torch.allclose(p, torch.tensor([0.315, 0.331, 0.232, 0.122], dtype=torch.float64), atol=6e-4)
    d = torch.arange(1, 5, dtype=torch.float64)
    assert abs(float((g * d).sum()) - 2.07) < 0.01 and abs(float((p * d).sum()) - 2.16) < 0.01
    with pytest.raises(UserError):
        objectives.exit_prior("zipf", 4)


def test_local_and_global_kl_hand_computed():
    pi = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    prior = torch.full((4,), 0.25, dtype=torch.float64)
    # local: each one-hot token is log(1/0.25) = log 4 away from uniform
    assert abs(float(objectives.kl_local(pi, prior)) - np.log(4)) < 1e-12
    # global: the mean [0.5, 0, 0, 0.5] is 0.5 log 2 + 0.5 log 2 = log 2 away
    assert abs(float(objectives.kl_global(pi, prior)) - np.log(2)) < 1e-12
    # a batch that matches the prior on average: global 0, local still log 4
    four = torch.eye(4, dtype=torch.float64)
    assert abs(float(objectives.kl_global(four, prior))) < 1e-12
    assert abs(float(objectives.kl_local(four, prior)) - np.log(4)) < 1e-12


def test_dense_loss_hand_computed():
    gates = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)   # λ = 0.5 -> π = [.5, .25, .125, .125]
    losses = torch.tensor([[[4.0, 2.0, 1.0, 1.0]]], dtype=torch.float64)
    prior = torch.full((4,), 0.25, dtype=torch.float64)
    total, expected, reg, _ = objectives.dense_loss(losses, gates, prior, global_kl=False, beta=0.1)
    assert abs(float(expected) - (2 + 0.5 + 0.125 + 0.125)) < 1e-12
    pi = np.array([.5, .25, .125, .125])
    assert abs(float(reg) - float((pi * np.log(pi / 0.25)).sum())) < 1e-12
    assert abs(float(total) - float(expected) - 0.1 * float(reg)) < 1e-12


def test_global_gradient_differs_from_local():
    g = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    prior = objectives.exit_prior("poisson", 4)
    grads = []
    for fn in (objectives.kl_local, objectives.kl_global):
        (gr,) = torch.autograd.grad(fn(exit_pdf(g), prior), g)
        grads.append(gr)
    assert not torch.allclose(grads[0], grads[1])


def test_saturated_gates_keep_the_kl_gradient_finite():
    # In float32 a gate logit of 40 gives λ = 1 exactly, so π(d > 1) underflows to 0; xlogy(p, p) had
    # the gradient 0/0 = NaN there (a real run on shakespeare_char diverged this way). float64 is the
    # oracle: its π does not underflow at these logits.
    g = torch.randn(16, 4) * 3
    g[:5, 0] = 40.0                      # saturated at depth 1
    g[5:8, :2] = -40.0                   # saturated "stay" then a normal gate
    losses = torch.rand(16, 4) * 3
    prior = objectives.exit_prior("poisson", 4)
    for global_kl in (False, True):
        grads = []
        for dtype in (torch.float32, torch.float64):
            gd = g.to(dtype).requires_grad_(True)
            total, _, reg, _ = objectives.dense_loss(losses.to(dtype), gd, prior, global_kl=global_kl, beta=0.1)
            (gr,) = torch.autograd.grad(total, gd)
            grads.append((float(reg.detach()), gr))
        (reg32, g32), (reg64, g64) = grads
        assert torch.isfinite(g32).all() and abs(reg32 - reg64) < 1e-4
        assert torch.allclose(g32.double(), g64, atol=1e-5, rtol=1e-3)


def test_a_diverging_run_stops_with_a_clean_error_and_keeps_its_checkpoint(tmp_path, data_dir, monkeypatch):
    out = str(tmp_path / "o")
    args = TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=6", "--eval_interval=2"]
    real_step, calls = train.train_step, []

    def diverges(*a, **k):               # the fourth step's loss and gradients are NaN
        loss, parts, kl_step = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 4:
            for p in a[0].parameters():
                p.grad.fill_(float("nan"))
            return float("nan"), parts, kl_step
        return loss, parts, kl_step
    monkeypatch.setattr(train, "train_step", diverges)
    with pytest.raises(UserError, match="diverged at iter 3.*the checkpoint of iter 2 in .* is kept"):
        train.main(args)
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ck["iter_num"] == 2 and all(torch.isfinite(v).all() for v in ck["model"].values())
    assert [r["iter"] for r in read_log(out)][-1] <= 3
    calls.clear()                        # diverging before any checkpoint: the message says so
    fresh = str(tmp_path / "fresh")
    with pytest.raises(UserError, match="diverged at iter 3.*no checkpoint of this run was written"):
        train.main(TINY + [f"--data_dir={data_dir}", f"--out_dir={fresh}", "--max_iters=6", "--eval_interval=5"])
    assert not os.path.exists(os.path.join(fresh, "ckpt.pt"))


def test_beta_schedule_knots():
    assert objectives.beta_schedule(0.0) == 0.0
    assert abs(objectives.beta_schedule(0.25) - 0.01) < 1e-12
    assert abs(objectives.beta_schedule(0.5) - 0.02) < 1e-12
    assert abs(objectives.beta_schedule(1.0) - 0.05) < 1e-12
    assert abs(objectives.beta_schedule(0.125) - 0.005) < 1e-12   # cosine midpoint of the first segment
    xs = [objectives.beta_schedule(i / 100) for i in range(101)]
    assert all(b >= a for a, b in zip(xs, xs[1:]))
    assert objectives.beta_schedule(0.3, beta=0.1) == 0.1


# ----------------------------------------------------------------------------- configurator

def test_configurator_three_forms_and_files(tmp_path):
    d = dict(a=1, lr=0.1, name="x", flag=False, other=True, opt=None)
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("a = 7\nname = 'from_file'\n")
    c = configurator.parse([str(cfg_file), "--a=3", "--lr", "2", "--flag", "--name", "y", "--opt=0.5",
                            "--other", "False"], d)
    assert c == dict(a=3, lr=2.0, name="y", flag=True, other=False, opt=0.5)
    assert configurator.parse([str(cfg_file)], d)["a"] == 7
    assert configurator.parse(["--lr", "-0.5"], d)["lr"] == -0.5
    for bad in (["--nope=1"], ["--a=1.5"], ["--a"], ["--flag=maybe"], ["stray"], [str(tmp_path / "none.py")]):
        with pytest.raises(UserError):
            configurator.parse(bad, d)
    with pytest.raises(UserError, match="allowed"):
        configurator.parse(["--nope=1"], d)
    with pytest.raises(UserError, match="choose one of"):
        configurator.parse(["--name=z"], d, rules={"name": ["x", "y"]})
    cfg_file.write_text("unknown_key = 1\n")
    with pytest.raises(UserError):
        configurator.parse([str(cfg_file)], d)


# ----------------------------------------------------------------------------- training end to end

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=str(d), size=30000))
    return str(d)


def test_resume_equals_uninterrupted_run(tmp_path, data_dir):
    common = TINY + [f"--data_dir={data_dir}", "--max_iters=8", "--eval_interval=4", "--global_kl",
                     "--prior=geometric"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.main(common + [f"--out_dir={full}"])
    train.main(common + [f"--out_dir={split}", "--stop_iter=4"])
    assert torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)["iter_num"] == 4
    train.main(common + [f"--out_dir={split}", "--init_from=resume"])
    a = [r["train_loss"] for r in read_log(full) if "train_loss" in r]
    b = [r["train_loss"] for r in read_log(split) if "train_loss" in r]
    assert len(a) == 8 and a == b
    ea = [(r["iter"], r["val_loss_fixed"]) for r in read_log(full) if "val_loss_fixed" in r]
    eb = [(r["iter"], r["val_loss_fixed"]) for r in read_log(split) if "val_loss_fixed" in r]
    assert ea == eb and [i for i, _ in ea] == [0, 4, 8]      # the log continues seamlessly: no duplicate record
    # resuming a finished run does nothing and rewrites nothing
    ckpt, log = (open(os.path.join(split, f), "rb").read() for f in ("ckpt.pt", "log.jsonl"))
    assert train.main(common + [f"--out_dir={split}", "--init_from=resume"]) is None
    assert tuple(open(os.path.join(split, f), "rb").read() for f in ("ckpt.pt", "log.jsonl")) == (ckpt, log)


def kill_at_step(monkeypatch, n):
    """train.train_step raises KeyboardInterrupt at its n-th call (a run killed mid-training)."""
    real_step, calls = train.train_step, []

    def killed(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real_step(*a, **k)
    monkeypatch.setattr(train, "train_step", killed)
    return real_step


def test_a_run_killed_after_a_checkpoint_resumes_with_each_iteration_logged_once(tmp_path, data_dir, monkeypatch):
    common = TINY + [f"--data_dir={data_dir}", "--max_iters=8", "--eval_interval=4", "--global_kl"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.main(common + [f"--out_dir={full}"])
    real_step = kill_at_step(monkeypatch, 7)   # killed at iter 6, after the checkpoint of iter 4 and two more records
    with pytest.raises(KeyboardInterrupt):
        train.main(common + [f"--out_dir={split}"])
    assert max(r["iter"] for r in read_log(split)) == 6
    monkeypatch.setattr(train, "train_step", real_step)
    train.main(common + [f"--out_dir={split}", "--init_from=resume"])
    iters = [(r["iter"], "val_loss_fixed" in r) for r in read_log(split)]
    assert len(iters) == len(set(iters)) and iters == [(r["iter"], "val_loss_fixed" in r) for r in read_log(full)]
    for flag in ("--n_embd=64", "--max_iters=2", "--prior=geometric"):
        with pytest.raises(UserError, match=flag):          # a resumed run keeps everything that defines it
            train.main(common + [f"--out_dir={split}", "--init_from=resume", flag])
    before = read_log(split)                # a flag at the default --help shows is as if left out: the run's own
    train.main(common + [f"--out_dir={split}", "--init_from=resume", "--global_kl=False"])
    assert read_log(split) == before


def test_a_resume_without_flags_continues_the_objective_it_was_started_with(tmp_path, data_dir):
    """`train.py --prior=geometric --global_kl --stop_iter=4`, then `train.py --init_from=resume` with no
    other flag: the same log and checkpoint config as the run that was never stopped (objective, prior,
    schedule, data all from the checkpoint); what a resume may change (RESUME_MAY_CHANGE) it may."""
    run = TINY + [f"--data_dir={data_dir}", "--max_iters=8", "--eval_interval=4", "--prior=geometric", "--global_kl",
                  "--ragged_aware", "--ra_method=counterfactual", "--cf_thr=0.3", "--learning_rate=3e-3"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train.main(run + [f"--out_dir={full}"])
    train.main(run + [f"--out_dir={split}", "--stop_iter=4"])
    train.main([f"--out_dir={split}", "--init_from=resume", "--log_interval=2"])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "ms_per_iter"} for r in rs if r["iter"] % 2 == 0]
    assert strip(read_log(split)) == strip(read_log(full))
    saved = torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)["config"]
    assert (saved["prior"], saved["global_kl"], saved["ra_method"], saved["cf_thr"]) == ("geometric", True,
                                                                                         "counterfactual", 0.3)
    with pytest.raises(UserError, match="--eval_only evaluates"):
        train.main([f"--out_dir={tmp_path / 'none'}", "--eval_only"])     # nothing to evaluate: refused
    record = train.main([f"--out_dir={split}", "--eval_only", f"--data_dir={data_dir}"])
    assert record["val_loss_fixed"] == read_log(full)[-1]["val_loss_fixed"]     # the checkpoint, not a new model


def test_a_finished_run_trains_on_with_a_larger_max_iters(tmp_path, data_dir, capsys):
    """A finished run of 10 iterations resumed with --max_iters=20 trains on, by train.extend_run's rule:
    from the resume on, the schedules are a 20-iteration run's. With a constant learning rate and a flat
    β that makes it a 20-iteration run exactly (the same log and weights); with the default schedules,
    every step past 10 takes the learning rate and β a 20-iteration run takes there."""
    for flags in (["--decay_lr=False", "--beta=0.05"], []):
        tiny = [a for a in TINY if not (flags and a.startswith("--warmup_iters"))]   # no warmup without decay
        run = tiny + [f"--data_dir={data_dir}", "--eval_interval=5", "--log_interval=1"] + flags
        straight, extended = str(tmp_path / f"s{len(flags)}"), str(tmp_path / f"e{len(flags)}")
        train.main(run + [f"--out_dir={straight}", "--max_iters=20"])
        train.main(run + [f"--out_dir={extended}", "--max_iters=10"])
        capsys.readouterr()
        assert train.main([f"--out_dir={extended}", "--init_from=resume"]) is None    # nothing to do
        assert "resume with a larger --max_iters" in capsys.readouterr().err
        train.main([f"--out_dir={extended}", "--init_from=resume", "--max_iters=20"])
        assert "extending the run from 10 to 20 iterations" in capsys.readouterr().err
        a, b = read_log(straight), read_log(extended)
        steps = lambda log, lo: [(r["iter"], r["lr"], r["beta"]) for r in log if "lr" in r and r["iter"] > lo]
        assert steps(a, 10) == steps(b, 10)
        if flags:
            strip = lambda rs: [{k: v for k, v in r.items() if k != "ms_per_iter"} for r in rs]
            assert strip(a) == strip(b)
            wa, wb = (torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)["model"] for d in (straight, extended))
            assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rerun_keeps_the_previous_run_until_it_has_a_checkpoint(tmp_path, data_dir, monkeypatch):
    out = str(tmp_path / "o")
    args = TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]
    train.main(args)
    files = {f: open(os.path.join(out, f), "rb").read() for f in ("ckpt.pt", "log.jsonl")}
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(os.path.join(out, "ckpt.pt")).st_mode & 0o777 == 0o666 & ~mask   # not mkstemp's 0600
    real_step = kill_at_step(monkeypatch, 2)   # the second run is killed in its first steps, before any checkpoint
    with pytest.raises(KeyboardInterrupt):
        train.main(args + ["--seed=7"])
    assert {f: open(os.path.join(out, f), "rb").read() for f in ("ckpt.pt", "log.jsonl")} == files
    assert not os.path.exists(os.path.join(out, "log.jsonl.new"))   # the killed run's log went with it
    monkeypatch.setattr(train, "train_step", real_step)
    train.main(args + ["--seed=7"])            # run again, to the end: its own checkpoint and log only
    log = read_log(out)
    assert [r["iter"] for r in log if "val_loss_fixed" in r] == [0, 2, 4] and not os.path.exists(out + "/log.jsonl.new")
    assert open(os.path.join(out, "ckpt.pt"), "rb").read() != files["ckpt.pt"]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]["seed"] == 7
    # the finished first run was not lost: it moved aside, whole, at the second run's first checkpoint
    assert {f: open(os.path.join(out, "earlier-1", f), "rb").read() for f in ("ckpt.pt", "log.jsonl")} == files


def test_a_run_is_never_replaced_unasked_and_an_interrupted_write_leaves_nothing(tmp_path, data_dir, capsys):
    """The quick start run three times into one folder: each earlier run moves aside whole (earlier-1,
    earlier-2, the log says where); --overwrite replaces it; the temp files an interrupted write left
    (atomic_write's, up to a checkpoint's size each) are removed at the next start, and said."""
    out = str(tmp_path / "o")
    args = TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"]
    runs = []
    for seed in (1, 2, 3):
        train.main(args + [f"--seed={seed}"])
        runs.append(open(os.path.join(out, "ckpt.pt"), "rb").read())
    assert open(os.path.join(out, "earlier-1", "ckpt.pt"), "rb").read() == runs[0]
    assert open(os.path.join(out, "earlier-2", "ckpt.pt"), "rb").read() == runs[1]
    err = capsys.readouterr().err
    assert f"moves to {os.path.join(out, 'earlier-2')}" in err and f"moved to {os.path.join(out, 'earlier-2')}" in err
    stale = [os.path.join(out, ".ckpt.pt.k2j4.tmp"), os.path.join(out, ".log.jsonl.x9.tmp")]
    for path in stale:
        open(path, "wb").write(b"\0" * 1000)
    train.main(args + ["--seed=4", "--overwrite"])
    assert not any(os.path.exists(p) for p in stale) and "removed 2 file(s) an interrupted write left" in \
        capsys.readouterr().err
    assert sorted(os.listdir(out)) == [".lock", "ckpt.pt", "earlier-1", "earlier-2", "log.jsonl"]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]["seed"] == 4


def test_a_second_run_into_a_used_out_dir_is_refused_while_the_first_runs(tmp_path, data_dir):
    """The run writing an out_dir holds its lock (here taken as train.py takes it): another run into
    the same folder stops with one line before writing anything; once the lock is gone it runs."""
    from types import SimpleNamespace
    out = str(tmp_path / "o")
    args = TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"]
    first = run_folder.lock_out_dir(SimpleNamespace(out_dir=out))
    with pytest.raises(UserError, match="another train.py is writing"):
        train.main(args)
    assert sorted(os.listdir(out)) == [".lock"]
    first.close()
    train.main(args)
    assert os.path.isfile(os.path.join(out, "ckpt.pt"))


def test_a_full_disk_is_a_one_line_error_and_the_old_files_stay(tmp_path, monkeypatch):
    """A write that fails midway (ENOSPC from a file object, torch.save's RuntimeError): one error
    naming the file, no temp file left, the earlier file unchanged."""
    import errno
    from checkpoint import save_checkpoint, write_json
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"a": 1}, str(path))
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(UserError, match="cannot write .*log.json .No space left on device"):
        write_json(str(tmp_path / "log.json"), {"x": 1})
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")))
    with pytest.raises(UserError, match="cannot write .*ckpt.pt"):
        save_checkpoint({"a": 2}, str(path))
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_training_beats_unigram_and_logs_metrics(tmp_path, data_dir):
    out = str(tmp_path / "o")
    m = train.main(TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=60", "--eval_interval=30",
                           "--batch_size=16", "--block_size=32", "--learning_rate=3e-3"])
    rec = read_log(out)[-1]
    assert rec["iter"] == 60 and len(rec["val_loss_fixed"]) == 4 and len(rec["exit_fractions"]) == 4
    assert abs(sum(rec["exit_fractions"]) - 1) < 1e-3 and 1 <= rec["avg_exit_depth"] <= 4
    assert min(m["val_loss_fixed"]) < rec["unigram_loss"] - 0.3
    # and sample.py reads the checkpoint back
    res = sample.main(["--ckpt", out, "--thr", "0.5", "--json", "--max_new_tokens=5"])
    assert len(res[0]["tokens"]) == 5 and all(1 <= e <= 4 for e in res[0]["exits"])


# ----------------------------------------------------------------------------- bad input

def run_cli(script, *args, cwd):
    return subprocess.run([sys.executable, os.path.join(HERE, script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    out = str(tmp_path_factory.mktemp("ckpt"))
    train.main(TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"])
    return out


@pytest.mark.parametrize("args", [
    ["--thr", "1.5"], ["--thr=-0.1"], ["--thr=abc"], ["--mode=warp"], ["--depth=9"], ["--bogus=1"],
    ["--top_p=0"], ["--prompt_ids=1,x"], ["--prompt=" + "a" * 40], ["--prompt=ABC"],
    ["--thr=0.5", "--prefix_full=2"], ["--kv_pages=-1"], ["--mode=ouro", "--thr=0.5", "--kv_pages=3"],
    ["--mode=ete_ragged", "--thr=0.5", "--prefill_schedule=linear"],
])
def test_sample_bad_input_is_a_user_error(trained, args):
    with pytest.raises(UserError):
        sample.main(["--ckpt", trained] + args)


@pytest.mark.parametrize("args", [["--prior=zipf"], ["--max_iters=ten"], ["--unknown"], ["--beta=-1"],
                                  ["--dataset=missing"], ["--init_from=resume"]])
def test_train_bad_input_is_a_user_error(tmp_path, data_dir, args):
    with pytest.raises(UserError):
        train.main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'empty'}"] + args)


def test_cli_errors_are_one_line_exit_2_and_nothing_lost(tmp_path, trained):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    ckpt = os.path.join(trained, "ckpt.pt")
    before = open(ckpt, "rb").read()
    cases = [("sample.py", "--ckpt", str(bad)), ("sample.py", "--ckpt", str(tmp_path / "nowhere")),
             ("sample.py", "--ckpt", trained, "--thr", "2"), ("train.py", "--prior=zipf"),
             ("train.py", f"--out_dir={trained}", "--n_layer=two"), ("prepare_data.py", "--dataset=imagenet")]
    for script, *args in cases:
        r = run_cli(script, *args, cwd=str(tmp_path))
        assert r.returncode == 2, (script, args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: ")
    assert bad.read_bytes() == b"not a checkpoint" and open(ckpt, "rb").read() == before


@pytest.mark.parametrize("rule,good,bad", [
    (">= 1", [1, 7], [0, -3, "abc", True]), ("> 0", [1e-9, 2], [0, -1]), ("<= 8", [8, -2], [9]),
    ("in [0, 1]", [0, 0.5, 1], [-0.1, 1.5, "x"]), ("in (0, 1]", [1, 0.2], [0]), ("in [0, 1)", [0], [1]),
    ("floats in [0, 1]", ["0.3", "0.3,0.5", "1"], ["", "a", "0.3,2", "-1"]),
    (["a", "b"], ["a"], ["c"]), (lambda v: None if v % 2 else "must be odd", [3], [4]),
])
def test_configurator_rules(rule, good, bad):
    for v in good:
        configurator.check("k", v, rule)
    for v in bad:
        with pytest.raises(UserError, match=r"^--k="):
            configurator.check("k", v, rule)
    configurator.check("k", None, rule)  # an unset key (default None) is not checked


def test_help_lists_every_key_with_its_comment_and_rule(capsys):
    for module in (train, sample, prepare_data):
        with pytest.raises(SystemExit) as e:
            configurator.parse(["--help"], module.DEFAULTS, module.RULES, module.__file__)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python ") and module.__doc__.strip().splitlines()[0] in out
        comments = dict(configurator.declared_comments(open(configurator.__file__, encoding="utf-8").read()),
                        **configurator.declared_comments(open(module.__file__, encoding="utf-8").read()))
        for key in module.DEFAULTS:   # every key is a declared setting (here or, shared, in configurator.py)
            assert comments.get(key), f"--{key} has no comment"
            line = next(l for l in out.splitlines() if l.strip().startswith(f"--{key}="))
            assert comments[key] in line
    size = next(l for l in out.splitlines() if "--size=" in l)
    assert size.endswith("[in [100, 1000000000]]")   # prepare_data's rule


def test_config_files_parse():
    cfg_dir = os.path.join(HERE, "config")
    files = sorted(f for f in os.listdir(cfg_dir) if f.endswith(".py"))
    assert "ouro160m_fineweb.py" in files and "shakespeare_char.py" in files
    for f in files:
        c = configurator.parse([os.path.join(cfg_dir, f)], train.DEFAULTS, train.RULES)
        assert c["n_loops"] == 4
    c = configurator.parse([os.path.join(cfg_dir, "ouro160m_fineweb.py")], train.DEFAULTS, train.RULES)
    assert c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"] == 524_288   # App. B
    assert (c["n_layer"], c["n_embd"], c["ffn_hidden"], c["n_head"]) == (12, 768, 2048, 12)


def test_training_on_the_pointer_dataset_reports_depth_over_item_spans(tmp_path):
    """train.py --dataset=pointer prepares it offline (answer and item-span labels that agree) and logs
    the mean depth over the spans of items of each difficulty."""
    out, data = str(tmp_path / "o"), str(tmp_path / "d")
    m = train.main(TINY + [f"--data_dir={data}", f"--out_dir={out}", "--dataset=pointer", "--max_iters=2",
                           "--eval_interval=2"])
    span = np.fromfile(os.path.join(data, "pointer", "val_item_labels.bin"), dtype=np.uint8)
    lab = np.fromfile(os.path.join(data, "pointer", "val_labels.bin"), dtype=np.uint8)
    assert len(span) == len(lab) and set(np.unique(span)) == {0, 1, 2, 3, 4}
    assert np.all(span[lab > 0] == lab[lab > 0])                   # an answer lies in its own item's span
    assert set(m["span_depth_by_difficulty"]) == {"1", "2", "3", "4"}
    assert all(v is None or 1 <= v <= 4 for v in m["span_depth_by_difficulty"].values())
    thrs = train.DEFAULTS["eval_thr"].split(",")            # the sweep: the same at every eval threshold
    assert set(m["span_depth_by_thr"]) == set(thrs) and m["span_depth_by_thr"][thrs[0]] == m["span_depth_by_difficulty"]
    with open(os.path.join(data, "pointer", "meta.json")) as f:   # the facts' capitals are in its vocabulary
        assert set(json.load(f)["chars"]) == set(prepare_data.POINTER_CHARS)


FULL_DISK = """
import errno, sys
import checkpoint, configurator, run_folder, train
saves, real = [0], checkpoint.OSWrites.write
def write(self, data):                          # the filesystem fills up at the run's second checkpoint
    if saves[0] >= 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data)
def save(obj, path, save=checkpoint.save_checkpoint):
    saves[0] += 1
    return save(obj, path)
checkpoint.OSWrites.write, run_folder.save_checkpoint = write, save
configurator.run_cli(train.main, sys.argv[1:])
"""


def test_a_full_disk_is_named_on_a_line_of_its_own_and_the_earlier_checkpoint_kept(tmp_path, data_dir):
    """Training onto a filesystem that fills up at its second checkpoint: a small tmpfs where this
    machine lets the test mount one, and the write made to fail with ENOSPC. One line on stderr, a
    line of its own after the progress bar, names the OS's reason and the path; exit 2; the first
    checkpoint is kept, whole, and no temp file is left."""
    for variant in ("tmpfs", "injected"):
        out = tmp_path / variant
        out.mkdir()
        mounted = variant == "tmpfs" and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(out)],
                                                        capture_output=True).returncode == 0
        argv = TINY + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2"]
        command = [sys.executable, "-c", FULL_DISK] if not mounted else [sys.executable, os.path.join(HERE, "train.py")]
        try:
            r = subprocess.run(command + argv, capture_output=True, text=True, cwd=HERE, timeout=300)
            kept = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
            left = sorted(os.listdir(out))
        finally:
            if mounted:
                subprocess.run(["umount", str(out)])
        line = (f"error: cannot write {out / 'ckpt.pt'} (No space left on device); what was there before is kept "
                "as it was")
        assert r.returncode == 2 and line in r.stderr.splitlines(), (variant, r.stderr[-800:])
        assert r.stderr.count("error:") == 1 and kept == 2 and left == [".lock", "ckpt.pt", "log.jsonl"], left


def test_the_passes_over_a_split_read_it_in_chunks_and_give_the_whole_arrays_numbers(tmp_path, monkeypatch):
    """metrics.chunks reads a memory-mapped split from its file in chunks (its memory does not grow
    with the data: python -m lab.bench --what=memory measures it); the unigram baseline and the ids
    it sees are those of the whole arrays, with chunks of any size."""
    import metrics
    rng = np.random.default_rng(int(torch.randint(0, 1000, ())))
    train_ids, val_ids = rng.integers(0, 50, 10007, dtype=np.uint16), rng.integers(0, 50, 999, dtype=np.uint16)
    for name, ids in (("train", train_ids), ("val", val_ids)):
        ids.tofile(tmp_path / f"{name}.bin")
    train_map, val_map = (np.memmap(tmp_path / f"{n}.bin", dtype=np.uint16, mode="r") for n in ("train", "val"))
    counts = np.bincount(train_ids, minlength=50) + 1.0
    whole = float(-np.log(counts / counts.sum())[val_ids].mean())
    for size in (7, 1000, 1 << 22):
        monkeypatch.setattr(metrics, "CHUNK", size)
        assert np.array_equal(np.concatenate(list(metrics.chunks(train_map))), train_ids)
        assert abs(metrics.unigram_loss(train_map, val_map, 50) - whole) < 1e-12
        assert abs(metrics.unigram_loss(train_ids, val_ids, 50) - whole) < 1e-12


@pytest.mark.parametrize("code,reason", [("EACCES", "Permission denied"), ("EROFS", "Read-only file system")])
def test_a_folder_that_cannot_be_written_is_named_with_the_os_reason_before_anything_runs(tmp_path, monkeypatch,
                                                                                           code, reason):
    """A read-only file system or a folder without write permission (the OS says so when the run
    tries its folder, before any work): one UserError naming --out_dir, the path and the OS's reason,
    and nothing written."""
    import errno
    import tempfile

    def refuse(*args, **kwargs):
        raise OSError(getattr(errno, code), reason)
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(UserError, match=f"--out_dir=.*cannot write in .*{reason}"):
        train.main(TINY + [f"--out_dir={tmp_path / 'o'}", "--max_iters=2"])
    assert not os.path.exists(tmp_path / "o")
