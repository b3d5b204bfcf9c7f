"""lab/reproduce.py: the quick grid end to end (every column, every figure, resumable, no verdict),
and the report's table, marks and figures on a small hand-made results file (the claims' rules:
test_claims.py)."""
import json
import os
import re

import numpy as np
import pytest
import torch

import prepare_data
from conftest import fake_run
from lab import claims, report, reproduce
from lab.figures import draw


def hand_made():
    return [fake_run("syn-local-poisson-s1", "local", jumps=0.002, rho=0.05, fractions=(0.0, 0.1, 0.8, 0.1), depth=3.0),
            fake_run("syn-local-poisson-s2", "local", seed=2, jumps=0.004, rho=0.07),
            fake_run("syn-global-poisson-s1", jumps=0.19),
            fake_run("syn-global-poisson-s2", seed=2, jumps=0.21, rho=0.35),
            fake_run("syn-global-poisson-s1-ra-direct", ra="direct", parent="syn-global-poisson-s1", ragged=1.5),
            fake_run("syn-global-poisson-s1-flatbeta", beta=0.1, fractions=(0.9, 0.05, 0.03, 0.02), depth=1.2,
                     fixed=(2.0, 1.99, 1.98, 1.99)),
            fake_run("syn-global-uniform-s1", prior="uniform")]


def test_the_report_opens_with_one_short_table(tmp_path):
    """RESULTS.md: the claims table first, a line a claim, each cell at most ~150 characters; the
    details, every run (with its training time) and the figures after it."""
    results = hand_made()
    rows = report.table_rows(results)
    assert len(rows) == len(results) and all(len(r) == len(report.COLUMNS) for r in rows)
    assert rows[0][4] == "2.000 / 1.800 / 1.700 / 1.650" and rows[0][10] == "0.2%"
    figures = draw(results, str(tmp_path), [1, 2])
    assert {f for f, _ in figures} == {"frontier.png", "exit_fractions.png", "exit_trace.png", "training_curves.png",
                                       "depth_by_difficulty.png", "flat_beta.png"}
    for f, _ in figures:
        with open(tmp_path / "figures" / f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    report.write_results(results, str(tmp_path), "quick", "setup", figures)
    text = (tmp_path / "RESULTS.md").read_text()
    table = text.split("| claim | paper | here: 95% interval (seeds) | verdict |")[1].split("\n\n")[0]
    lines = [re.split(r"(?<!\\)\|", line.strip().strip("|")) for line in table.strip().splitlines()[1:]]
    cells = [c.strip() for line in lines for c in line]
    assert cells and max(map(len, cells)) <= 160 and {len(line) for line in lines} == {4}   # four cells a line
    piped = dict(claims.row("c", "p", "r", "|exit − need| 0.1", "n", holds=True), reruns="", untraced=[])
    assert report.claims_table([piped])[2] == "| c | p | \\|exit − need\\| 0.1 | yes |"     # a bar in a cell, escaped
    assert text.index("| claim |") < text.index("## Each claim") < text.index("## Every run") < text.index("![")


def test_each_claim_names_its_runs_their_reruns_and_missing_provenance():
    """A claim's marks come from the runs behind it, and from no other: † where one of them was
    trained twice and moved (the flat-β row through its scheduled parent), ‡ where one records no
    provenance."""
    results = hand_made()
    R = {r["name"]: r for r in results}
    for r in results:
        r["provenance"] = {"commit": "c0ffee", "torch": "2.13.0", "threads": 1, "cpu": "x", "train_seconds": 1.0}
    rerun = R["syn-global-poisson-s1"]
    moved = dict(rerun["final"], val_loss_ragged={"0.5": 1.63}, val_loss_fixed=[2.0, 1.8, 1.7, 1.6])
    rerun["earlier"] = [{"final": moved}]
    flat_run = R["syn-global-poisson-s1-flatbeta"]
    flat_run["earlier"] = [{"final": dict(flat_run["final"])}]        # trained twice, the same numbers
    del R["syn-local-poisson-s2"]["provenance"]
    rows = {c["claim"]: c for c in report.claims(results)}
    flat, jumps = rows["A flat β = 0.1 collapses the loops after the first (global KL)"], \
        rows["Global gives many large jumps, local almost none: synthetic"]
    assert flat["runs"] == ["syn-global-poisson-s1", "syn-global-poisson-s1-flatbeta"]
    assert flat["reruns"] == ("reruns moved ragged@0.5 by up to 0.030 nats (syn-global-poisson-s1), the best fixed "
                              "depth by up to 0.050") and flat["untraced"] == []
    assert jumps["untraced"] == ["syn-local-poisson-s2"] and jumps["reruns"]
    assert report.rerun_note(R, dict(flat, runs=["syn-global-poisson-s1-flatbeta"])) == ""  # did not move: no †
    for c in rows.values():       # every mark is the runs' own: the uniform run is behind no claim
        assert "syn-global-uniform-s1" not in c["runs"]
        assert bool(c["untraced"]) == ("syn-local-poisson-s2" in c["runs"])
        assert bool(c["reruns"]) == ("syn-global-poisson-s1" in c["runs"])
    table = report.claims_table(list(rows.values()))
    both = [bool(c["reruns"] and c["untraced"]) for c in rows.values()]
    assert [line.endswith("† ‡ |") for line in table[2:-2]] == both and any(both)
    assert table[-1].startswith("† ") and "‡ a run" in table[-1]       # a legend for each mark in the table
    assert "‡" not in report.claims_table([dict(c, untraced=[]) for c in rows.values()])[-1]
    assert report.claims_table([dict(c, reruns="", untraced=[]) for c in rows.values()])[-1].startswith("| ")
    details = "\n".join(report.claim_details(list(rows.values())))
    assert "0.050. Runs that record no provenance: syn-local-poisson-s2." in details


def test_a_run_trained_twice_at_one_commit_gives_the_same_result(tmp_path):
    """Provenance and determinism: one small run of the grid trained twice gives the same numbers (all
    of result.json but the training's wall time), and records its commit, torch, threads and CPU."""
    a, b = (reproduce.main(["--quick", f"--out={tmp_path / x}", "--only=syn-global-poisson-s1337", "--plots=False"])[0]
            for x in "ab")
    made = [r.pop("provenance") for r in (a, b)]
    assert a == b and {k for k in made[0]} == {"commit", "dirty", "torch", "threads", "cpu", "train_seconds"}
    assert made[0]["torch"] == torch.__version__ and made[0]["commit"] == made[1]["commit"]
    os.remove(tmp_path / "b" / "syn-global-poisson-s1337" / "result.json")    # a run resumed from its checkpoint
    c = reproduce.main(["--quick", f"--out={tmp_path / 'b'}", "--only=syn-global-poisson-s1337", "--plots=False"])[0]
    assert c.pop("provenance")["resumed_at_iter"] == 16 and c == a              # says so, and changes nothing


def test_quick_grid_end_to_end_and_resumable(tmp_path):
    out = str(tmp_path / "r")
    results = reproduce.main(["--quick", f"--out={out}"])
    assert len(results) == 68 and all(len(r["windows"]["fixed"]) == 16 for r in results)
    for r in results:            # synthetic: every token of a window in one label, its depths summing to the mean
        assert ("labels" in r["windows"]) == (r["data"] == "synthetic")
        if r["data"] == "synthetic":
            T = sum(n for n, _ in r["windows"]["labels"][0])
            assert T == 32 and all(sum(n for n, _ in w) == T for w in r["windows"]["labels"])   # block_size
            assert np.allclose([sum(d for _, d in w) / T for w in r["windows"]["labels"]],
                               r["windows"]["depth"]["0.5"], atol=1e-4)
    text = open(os.path.join(out, "RESULTS.md")).read()
    header = "| " + " | ".join(report.COLUMNS) + " |"
    assert text.index("| claim | paper | here: 95% interval (seeds) | verdict |") < text.index("## Each claim")
    assert header in text and sum(text.count(f"\n| {p}-") for p in ("syn", "shk", "ptr", "hop", "grd", "gml")) == 68
    assert "## The graded task, per k" in text and "| global | ete_ragged@0.5 | 4 |" in text
    assert "Exits follow each model's need more under global than local: graded (k hidden)" in text
    table = text.split("| claim | paper |")[1].split("\n\n")[0].strip().splitlines()[2:]
    assert table and all(line.endswith(f"| {claims.QUICK} |") for line in table), table   # toy models: no verdict
    assert "no row has a verdict" in text and "Verdict: not judged (quick)." in text
    assert "RA lowers the ragged loss beyond the dense continuation: synthetic, global, direct" in text
    assert "RA changes the local model little: hops, local, direct" in text
    for scope in ("global", "local"):       # flat β over the trajectory, each loop's shift beside
        assert f"A flat β = 0.1 collapses the loops after the first ({scope} KL)" in text
    assert text.count("at each evaluation (1 seeds resampled)") == 2 and text.count("‖Δh‖/‖h‖") == 2
    assert all("label_correct" in r["windows"] for r in results if r["data"] == "synthetic")
    for f in ("frontier.png", "exit_fractions.png", "exit_trace.png", "exit_trace_pointer.png", "exit_trace_hops.png",
              "training_curves.png", "depth_by_difficulty.png", "graded_by_k.png", "exit_trace_graded.png"):
        assert os.path.getsize(os.path.join(out, "figures", f)) > 1000
    ptr = json.load(open(os.path.join(out, "ptr-global-poisson-s1338", "result.json")))
    assert set(ptr["builtin"]) == {f"fixed@{d}" for d in range(1, 5)} | {f"{m}@{t}" for t in reproduce.THRS
                                                                          for m in ("ete_ragged", "dense_ragged")}
    assert set(ptr["final"]["difficulty_spearman_by_thr"]) == {str(t) for t in reproduce.THRS}   # the τ sweep
    assert all(set(b) == {"1", "2", "3", "4"} and all(v["items"] == 2 for v in b.values())
               for b in ptr["builtin"].values())
    assert ptr["trace"]["labels"] and max(ptr["trace"]["labels"]) > 0
    assert "more under global than local: Pointer task, Uniform (k visible)" in text
    hop = json.load(open(os.path.join(out, "hop-local-uniform-s1337", "result.json")))
    assert set(hop["builtin"]) == set(ptr["builtin"]) and hop["data"] == "hops" and max(hop["trace"]["labels"]) > 0
    assert "dc " in prepare_data.HOP_PIECES and set(hop["trace"]["tokens"]) <= set(prepare_data.HOP_PIECES)
    assert "more under global than local: Hops task (one token a fact), Poisson (k visible)" in text
    assert hop["final"]["depth_by_difficulty"]["2"] is not None and hop["final"]["depth_by_difficulty"]["3"] is None
    assert all(set(b) == {"1", "2"} for b in hop["builtin"].values()) and hop["max_k"] == 2   # hops: k = 1, 2
    branch = json.load(open(os.path.join(out, "syn-global-poisson-s1337-ra-direct", "result.json")))
    assert branch["parent"] == "syn-global-poisson-s1337" and branch["final"]["iter"] == 6
    parent = json.load(open(os.path.join(out, "grd-global-poisson-s1337", "result.json")))
    assert set(parent["builtin_need"]) == set(parent["builtin"])      # the items that set each k's need, apart
    graded = json.load(open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json")))
    assert graded["parent"] == "grd-global-poisson-s1337" and graded["max_k"] == 4 and graded["ra"] == "direct"
    assert len(graded["builtin"]["ete_ragged@0.5"]["3"]["rollouts"]["correct"]) == 2     # 2 items per k
    hop_ra = json.load(open(os.path.join(out, "hop-local-poisson-s1337-ra-direct", "result.json")))
    assert hop_ra["parent"] == "hop-local-poisson-s1337" and hop_ra["max_k"] == 2 and hop_ra["ra"] == "direct"
    assert text.count("accuracy on 2 look-ups at ETE-Ragged τ 0.5: RA ") == 2    # RA on hops: answers beside
    stamp = os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json"))
    reproduce.main(["--quick", f"--out={out}"])                 # every result exists: nothing is trained again
    assert os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json")) == stamp
    del graded["windows"]                           # a result from before windows: its checkpoint gives them
    with open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json"), "w") as f:
        json.dump(graded, f)
    branch_path = os.path.join(out, "syn-global-poisson-s1337-ra-direct", "result.json")
    labels = branch["windows"].pop("labels")        # and one from before windows held labels
    with open(branch_path, "w") as f:
        json.dump(branch, f)
    os.remove(os.path.join(out, "RESULTS.md"))
    shk = os.path.join(out, "shk-local-poisson-s1337")
    os.rename(os.path.join(shk, "result.json"), os.path.join(shk, "result.json.away"))    # a run not finished
    reproduce.main(["--quick", f"--out={out}", "--report", "--plots=False"])
    assert "not finished yet" not in text and "1 run(s) of the grid are not finished yet (shk-local-poisson-s1337)" \
        in open(os.path.join(out, "RESULTS.md")).read()
    again = json.load(open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json")))
    assert len(again["windows"]["fixed"]) == 16 and json.load(open(branch_path))["windows"]["labels"] == labels
    assert os.path.isfile(os.path.join(out, "RESULTS.md"))
    assert os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json")) == stamp
    with pytest.raises(Exception, match="--only"):
        reproduce.main(["--quick", f"--out={out}", "--only=nope"])
    with pytest.raises(Exception, match="holds the --quick grid"):     # sizes never mix in one folder
        reproduce.main(["--full", f"--out={out}"])


def test_quick_never_writes_over_the_full_results(tmp_path, monkeypatch):
    """The committed results/ are a --full grid: --quick goes to results-quick/ by default, and is
    refused in a folder that holds the full runs (one written before grid.json, too)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert json.load(open(os.path.join(here, "results", "grid.json"))) == {"size": "full"}
    old = tmp_path / "old"
    old.mkdir()
    (old / "RESULTS.md").write_text("# Reproducing the paper at CPU scale (full)\n")
    with pytest.raises(Exception, match="holds the --full grid"):
        reproduce.main(["--quick", f"--out={old}"])
    assert sorted(os.listdir(old)) == ["RESULTS.md"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reproduce, "prepare", lambda *a: (_ for _ in ()).throw(SystemExit("stop here")))
    with pytest.raises(SystemExit):
        reproduce.main(["--quick"])
    assert json.load(open(tmp_path / "results-quick" / "grid.json")) == {"size": "quick"}


def test_the_readmes_results_rows_are_rows_of_results_md():
    """The README's results table quotes RESULTS.md: every row is one of RESULTS.md's claims rows as it
    stands there (claim, paper, numbers, verdict; a row's marks † ‡ are RESULTS.md's alone), so that it
    says no more, and no other verdict, than the runs do."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table = lambda text: text.split("| claim | paper | here: 95% interval (seeds) | verdict |")[1].split("\n\n")[0]
    rows = lambda text: [line.strip() for line in table(text).strip().splitlines()[1:]]
    unmarked = lambda line: re.sub(r"( [†‡])+ \|$", " |", line)
    results = {unmarked(line) for line in rows(open(os.path.join(here, "results", "RESULTS.md")).read())}
    readme = rows(open(os.path.join(here, "README.md")).read())
    assert len(readme) >= 5 and all(line in results for line in readme), [x for x in readme if x not in results]
