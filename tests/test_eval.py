"""lab/eval.py, offline: multiple-choice log-likelihoods against a direct computation with the model,
pass@k against the closed form, answer extraction on tricky strings, the sweep's outputs and the
builtin difficulty suite, and the lm-evaluation-harness adapter on a local task."""
import json
import math
import os
import random
import string
from collections import Counter

import pytest
import torch

import prepare_data
from lab import eval as ev
from lab import harness
from lab import tasks
from checkpoint import model_args, save_checkpoint
from conftest import chase
from model import GPTConfig, LoopedLM, forward_ragged
from prepare_data import SYNTH_CHARS
from tokenizer import char_meta, load_tokenizer, pieces_meta


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small random char-level model whose exits vary, saved as a checkpoint with its tokenizer."""
    torch.manual_seed(int(torch.randint(0, 1000, ())))
    meta = char_meta(sorted(set(SYNTH_CHARS + string.ascii_uppercase + ",.!'\"()*$")))
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=128, n_layer=2, n_head=4, n_embd=32,
                               ffn_hidden=48)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.early_exit_gate.weight.normal_(0, 1.0)
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config), "meta": meta},
                    str(folder / "ckpt.pt"))
    return str(folder), model, *load_tokenizer(meta)


def write_jsonl(path, items):
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    return str(path)


MC = [{"type": "mc", "context": "the red ", "choices": ["cat", "dog sees", "bird"], "answer": 1},
      {"type": "mc", "context": "x=3 a=x ; a? ", "choices": ["3", "5"], "answer": 0},
      {"type": "mc", "context": "copy abc : ", "choices": ["abc.", "xyz."], "answer": 0}]


@torch.no_grad()
def direct_loglik(model, encode, context, choice, mode, thr=None, depth=None):
    ids = encode(context + choice)
    n = len(encode(choice))
    x = torch.tensor([ids[:-1]])
    if mode == "ete_ragged":
        logits = forward_ragged(model, x, taus=thr)["logits"][0]
    else:
        logits = model(x, keep_logits=True)["logits"][depth - 1][0]
    lp = torch.log_softmax(logits.float(), -1)
    return sum(float(lp[len(ids) - 1 - n + i, ids[len(ids) - n + i]]) for i in range(n))


def test_multiple_choice_logliks_equal_a_direct_computation(tmp_path, ckpt):
    folder, model, encode, _ = ckpt
    task = write_jsonl(tmp_path / "mc.jsonl", MC)
    runs = ev.main([f"--ckpt={folder}", f"--task={task}", "--modes=fixed@2,ete_ragged@0.5,dense_ragged@0.3",
                    f"--out={tmp_path / 'o'}", "--batch_size=2", "--plots=False"])
    recs = [json.loads(line) for line in open(tmp_path / "o" / "records.jsonl")]
    assert len(recs) == 3 * 3 and {r["mode"] for r in recs} == {"fixed", "ete_ragged", "dense_ragged"}
    for r in recs:
        item = MC[r["item"]]
        mode, thr, depth = r["mode"], r["thr"], r["depth"]
        want = [direct_loglik(model, encode, item["context"], ch, "fixed" if mode == "dense_ragged" else mode, thr,
                              4 if mode == "dense_ragged" else depth) for ch in item["choices"]]
        assert all(abs(a - b) < 1e-4 for a, b in zip(r["loglik"], want)), (r, want)
        assert r["pred"] == max(range(len(want)), key=lambda j: want[j])
        lens = [len(ch) for ch in item["choices"]]
        assert r["pred_norm"] == max(range(len(want)), key=lambda j: want[j] / lens[j])
    run = next(x for x in runs if x["mode"] == "fixed")
    assert run["acc"] == sum(r["correct"] for r in recs if r["mode"] == "fixed") / 3
    assert run["avg_depth"]["prefill"] == 2.0
    dense = next(x for x in runs if x["mode"] == "dense_ragged")
    assert dense["avg_depth"]["prefill"] == 4.0       # a teacher-forced pass is a prefill: fixed@U


@pytest.mark.parametrize("n,c,k,want", [(4, 1, 1, 0.25), (4, 1, 4, 1.0), (4, 2, 2, 1 - 1 / 6), (4, 0, 2, 0.0),
                                        (16, 3, 4, 1 - math.comb(13, 4) / math.comb(16, 4)), (5, 5, 3, 1.0)])
def test_pass_at_k_closed_form(n, c, k, want):
    assert abs(ev.pass_at_k(n, c, k) - want) < 1e-12


@pytest.mark.parametrize("text,answer", [
    ("So the answer is 42.", "42"), ("the answer is 3. Wait, the answer is 5.", "5"), ("The answer is (B)!", "(B)"),
    ("**The answer is True**", "True"), ("no marker here", None), ("the answer is 3.14.", "3.14"),
    ("The answer is: $12$.\nQ: next question", "12"), ("THE ANSWER IS False", "False"), ("the answer is\n", None),
])
def test_strict_answer_extraction(text, answer):
    assert tasks.extract_answer(text) == answer


def test_generation_sweep_writes_results_records_and_plot(tmp_path, ckpt):
    folder, model, encode, decode = ckpt
    gen = [{"type": "gen", "prompt": "x=3 a=x ; a?", "answer": "3", "cot": "a is x, x is 3. So the answer is 3."},
           {"type": "gen", "prompt": "sum 1+2=", "answer": "3"}, {"type": "gen", "prompt": "copy ab :", "answer": "ab"}]
    task = write_jsonl(tmp_path / "gen.jsonl", gen)
    out = tmp_path / "sweep"
    runs = ev.main([f"--ckpt={folder}", f"--task={task}", "--builtin=synthetic", "--builtin_items=2", "--sweep",
                    "--thresholds=0.3,0.6", "--n=3", "--k=1,2", "--shots=1", "--max_tokens=12", f"--out={out}"])
    U = model.config.n_loops
    assert len(runs) == 2 * (U + 4)                         # 2 tasks x (fixed@1..U + 2 modes x 2 thresholds)
    res = json.load(open(out / "results.json"))["runs"]
    for r in res:
        assert set(r) >= {"task", "mode", "thr", "depth", "n_items", "acc", "acc_norm", "pass_at", "stderr",
                          "avg_depth"}
        assert set(r["pass_at"]) == {"1", "2"} and r["pass_at"]["2"] >= r["pass_at"]["1"]
        assert set(r["avg_depth"]) == {"prefill", "decode", "overall"}
        if r["mode"] == "fixed":
            assert r["avg_depth"]["prefill"] == r["depth"]
    syn = [r for r in res if r["task"] == "synthetic"]
    assert all(set(r["by_difficulty"]) == {"1", "2", "3", "4"} for r in syn)
    recs = [json.loads(line) for line in open(out / "records.jsonl")]
    g = next(r for r in recs if r["task"] == "gen" and r["mode"] == "ete_ragged")
    assert len(g["completions"]) == 3 and len(g["correct"]) == 3 and len(g["decode_exits"]) == 3
    # every figure can be recomputed from the records: pass@1 of a run is the mean of its items' correct rates
    for r in res:
        mine = [x for x in recs if x["task"] == r["task"] and x["mode"] == r["mode"] and x["thr"] == r["thr"]
                and x["depth"] == r["depth"]]
        assert abs(r["pass_at"]["1"] - sum(sum(x["correct"]) / 3 for x in mine) / len(mine)) < 1e-12
    assert os.path.getsize(out / "frontier.png") > 1000
    # the few-shot prompt: the description-less exemplar, then the question (App. D)
    assert tasks.gen_prompt_text(gen[1], gen[:1], chat=False) == (
        "Q: x=3 a=x ; a?\nA: a is x, x is 3. So the answer is 3.\n\nQ: sum 1+2=\nA:")


def test_bad_task_files_are_one_line_errors(tmp_path, ckpt, capsys):
    import configurator
    folder = ckpt[0]
    bad = tmp_path / "bad.jsonl"
    for content, key in [('{"type": "mc", "context": "a", "choices": ["b"], "answer": 3}\n', "task"),
                         ("not json\n", "task"), ('{"type": "essay"}\n', "task"),
                         ('{"type": "mc", "context": "a", "choices": ["b", "c"], "answer": true}\n', "task"),
                         ('{"type": "mc", "context": "a", "choices": ["b", ""], "answer": 0}\n', "task"),
                         ('{"type": "mc", "context": 5, "choices": ["b", "c"], "answer": 0}\n', "task"),
                         ('{"type": "mc", "context_ids": [1], "choices_ids": [[2], [-3]], "answer": 0}\n', "task"),
                         ('{"type": "gen", "prompt": "a", "answer": 7}\n', "task"),
                         ('{"type": "gen", "prompt_ids": [], "answer_ids": []}\n', "task"),
                         ('{"type": "mc", "context_ids": [1], "choices_ids": [[2], [99999]], "answer": 0}\n', "task"),
                         ('{"type": "gen", "prompt_ids": [99999], "answer_ids": [1]}\n', "task"),
                         ('{"type": "mc", "context_ids": [1], "choices_ids": [[2], [3] * 9999], "answer": 0}\n'
                          .replace("[3] * 9999", str([3] * 9999)), "task")]:
        bad.write_text(content)
        with pytest.raises(SystemExit) as e:
            configurator.run_cli(ev.main, [f"--ckpt={folder}", f"--task={bad}", f"--out={tmp_path / 'x'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --task")
    for args in (["--builtin=synthetic", "--n=1", "--k=4"], ["--builtin=synthetic", "--modes=fixed@9"],
                 ["--builtin=synthetic", "--modes=warp@0.5"], ["--builtin=synthetic", "--modes=ete_ragged@2"], []):
        with pytest.raises(SystemExit) as e:
            configurator.run_cli(ev.main, [f"--ckpt={folder}", f"--out={tmp_path / 'x'}"] + args)
        assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")
    assert not os.path.exists(tmp_path / "x")


def test_a_template_the_vocabulary_cannot_encode_is_blamed_not_the_prompt(tmp_path, capsys):
    """A char model without 'Q', 'A' or ':' cannot encode App. D's template: the error says so, while a
    prompt with characters of its own the model lacks is blamed on the item."""
    import configurator
    meta = char_meta(sorted(set(string.ascii_lowercase + " ")))
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=64, n_layer=1, n_head=2, n_kv_head=2,
                               n_embd=16, ffn_hidden=24))
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config), "meta": meta},
                    str(tmp_path / "ckpt.pt"))
    for prompt, says in [("two plus two", "the prompt template"), ("TWO", "item 0: characters 'OTW'")]:
        task = write_jsonl(tmp_path / "t.jsonl", [{"type": "gen", "prompt": prompt, "answer": "four"}])
        with pytest.raises(SystemExit) as e:
            configurator.run_cli(ev.main, [f"--ckpt={tmp_path}", f"--task={task}", f"--out={tmp_path / 'x'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_lm_eval_adapter_answers_a_local_task(tmp_path, ckpt):
    """lm-evaluation-harness runs our model (ETE-Ragged) on a task defined here, offline."""
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager
    folder, model, encode, decode = ckpt
    data = write_jsonl(tmp_path / "tiny.jsonl", [{"context": c, "choices": ["cat", "dog", "tree"], "answer": 0}
                                                 for c in ("the red ", "a big ", "my old ")])
    (tmp_path / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 5\nmetric_list:\n  - metric: exact_match\n")
    lm = harness.lm_eval_adapter(model, encode, decode, "ete_ragged", 0.5, None, dict(ev.DEFAULTS), "cpu",
                                 ev.generation_engine)
    ll = lm.loglikelihood([Instance("loglikelihood", {}, ("the red ", "cat"), 0)])
    assert abs(ll[0][0] - direct_loglik(model, encode, "the red ", "cat", "ete_ragged", 0.5)) < 1e-4
    out = lm.generate_until([Instance("generate_until", {}, ("the ", {"until": ["e"], "max_gen_toks": 6}), 0)])
    assert isinstance(out[0], str) and "e" not in out[0] and len(out[0]) <= 6
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("the red cat",), 0)])
    assert rolling[0] < 0
    res = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    assert res["results"]["tiny_mc"]["sample_len"] == 3 and 0 <= res["results"]["tiny_mc"]["acc,none"] <= 1
    assert "exact_match,none" in res["results"]["tiny_gen"]


def test_standard_benchmark_rows_convert_to_the_task_schema():
    rows = {
        "mmlu": {"question": "2+2=?", "choices": ["3", "4", "5", "6"], "answer": 1},
        "arc_challenge": {"question": "Which?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"},
        "hellaswag": {"ctx": "He opens the door", "endings": ["and walks in.", "x", "y", "z"], "label": "0"},
        "winogrande": {"sentence": "The cup did not fit in the box because the _ was too big.", "option1": "cup",
                       "option2": "box", "answer": "1"},
        "gsm8k": {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        "bbh": {"input": "not ( True ) is", "target": "False"},
    }
    items = {name: tasks.BENCHMARKS[name][3](row) for name, row in rows.items()}
    for name, item in items.items():
        tasks.check_item(item, name)
    assert items["mmlu"]["choices"] == [" A", " B", " C", " D"] and items["mmlu"]["context"].endswith("D. 6\nAnswer:")
    assert items["arc_challenge"]["answer"] == 1 and items["hellaswag"]["answer"] == 0
    assert items["winogrande"]["context"] == "The cup did not fit in the box because the"
    assert items["winogrande"]["choices"][0] == " cup was too big." and items["winogrande"]["answer"] == 0
    assert items["gsm8k"]["answer"] == "7" and items["gsm8k"]["cot"] == "3 + 4 = 7 So the answer is 7."
    assert tasks.extract_answer(items["gsm8k"]["cot"]) == "7" and items["bbh"]["answer"] == "False"


def test_the_graded_task_hides_k_until_the_chain_is_followed():
    """Where a fact of a queried graded chain stands predicts the chain's length k no better than the
    number of look-ups that led to it: on 20,000 generated items, the rule "the most frequent k at this
    (look-up, place)", fitted on half, is right on the other half no more often (within 0.02) than "the
    most frequent k after this many look-ups" (chance at the head: 1 in 4). The same measure finds the
    leak of heads written first with the chains interleaved (the order the pointer and hops items
    keep), so it can fail."""
    def leak(rounds, n=20_000):
        rng, rows = random.Random(int(torch.randint(0, 2**31, ()))), []
        for _ in range(n):
            chains, _, facts = prepare_data._chains(rng, [1, 2, 3, 4], prepare_data.HOP_NAMES, rounds)
            where = {name: i for i, (name, _) in enumerate(facts)}
            queried = rng.choice(chains)
            rows += [(j, where[name], len(queried)) for j, name in enumerate(queried)]
        fit, held = rows[::2], rows[1::2]

        def right(key):
            counts = {}
            for r in fit:
                counts.setdefault(key(r), Counter())[r[2]] += 1
            return sum(key(r) in counts and counts[key(r)].most_common(1)[0][0] == r[2] for r in held) / len(held)
        return right(lambda r: r[:2]) - right(lambda r: r[0])
    assert leak(rounds=True) < 0.02
    assert leak(rounds=False) > 0.1


@pytest.mark.parametrize("kind", ["pointer", "hops", "graded"])
def test_builtin_pointer_items_are_graded_by_their_lookups(kind):
    """--builtin pointer / hops / graded: per_level items at each difficulty 1..4; the answer is what
    following the queried chain finds, in as many look-ups as the difficulty says, all after the last
    fact. In hops and graded every fact is one token of the dataset's vocabulary; in graded every item
    holds one chain of each length 1..4, so its look (how many facts, how many of them digits) is the
    same at every difficulty."""
    items = tasks.builtin_items(kind, 5, seed=int(torch.randint(0, 1000, ())))
    encode, _ = load_tokenizer(pieces_meta(prepare_data.HOP_PIECES))
    assert sorted(it["difficulty"] for it in items) == [k for k in (1, 2, 3, 4) for _ in range(5)]
    for it in items:
        facts, query = it["prompt"].strip("\n").split(" ; ")
        assert len(query) == 1 and query.isupper()   # the first query, written like a fact, its value to come
        assert chase(facts.split(), query) == (it["answer"], it["difficulty"]) and it["kind"] == kind
        if kind != "pointer":                         # "\n", a token per fact, ";", " D"
            assert len(encode(it["prompt"])) == len(facts.split()) + 3 and len(encode(it["answer"])) == 1
        if kind == "graded":
            heads = {f[0].upper() for f in facts.split()} - {f[1].upper() for f in facts.split()}
            assert sorted(chase(facts.split(), h)[1] for h in heads) == [1, 2, 3, 4]
            assert len(facts.split()) == 10 and sum(f[1].isdigit() for f in facts.split()) == 4
    two = tasks.builtin_items(kind, 5, seed=int(torch.randint(0, 1000, ())), max_k=2)   # --builtin_max_k=2: levels 1, 2
    assert sorted(it["difficulty"] for it in two) == [1] * 5 + [2] * 5


def test_an_empty_prompt_and_depth_zero_mean_the_same_in_eval_and_sample(ckpt, tmp_path, capsys):
    """An empty prompt is the start of a text in lab/eval.py (an item's "" or prompt_ids []) as in
    sample.py, and fixed@0 is fixed at all U loops as sample.py's --depth=0: the same greedy tokens."""
    import sample
    folder = ckpt[0]
    empty = [{"prompt": ""}, {"prompt_ids": []}]
    items = write_jsonl(tmp_path / "empty.jsonl", [dict(e, type="gen", answer="x", extract="prefix") for e in empty])
    ev.main(["--ckpt", folder, f"--task={items}", "--modes=fixed@0", "--temperature=0", "--max_tokens=4",
             "--plots=False", f"--out={tmp_path / 'e'}"])
    records = [json.loads(line) for line in open(tmp_path / "e" / "records.jsonl")]
    records_ids = [r["completions"][0] for r in records]
    capsys.readouterr()
    out = sample.main(["--ckpt", folder, "--prompt=", "--mode=fixed", "--depth=0", "--temperature=0",
                       "--max_new_tokens=4", "--json"])
    assert records_ids == [out[0]["text"]] * 2 and records[0]["depth"] == 4


def test_speculative_scores_and_generates_as_fixed_at_full_depth(ckpt, tmp_path, capsys):
    """speculative@d in lab/eval.py and --mode=speculative in sample.py: the greedy completions and
    the multiple-choice log-likelihoods of fixed@U, whatever the draft depth."""
    import sample
    folder = ckpt[0]
    out = tmp_path / "spec"
    ev.main(["--ckpt", folder, "--builtin=synthetic", "--builtin_items=2",
             "--modes=fixed@0,speculative@1,speculative@3",
             "--temperature=0", "--max_tokens=8", "--draft_k=3", "--plots=False", f"--out={out}"])
    recs = [json.loads(line) for line in open(out / "records.jsonl")]
    by = lambda depth, mode: [r.get("completions", r.get("loglik")) for r in recs
                              if r["mode"] == mode and r["depth"] == depth]
    fixed = by(4, "fixed")
    assert fixed and by(1, "speculative") == fixed and by(3, "speculative") == fixed
    capsys.readouterr()
    run = lambda *a: sample.main(["--ckpt", folder, "--prompt=sum 1+2=", "--temperature=0", "--max_new_tokens=12",
                                  "--json", *a])[0]["tokens"]
    assert run("--mode=speculative", "--draft_depth=2", "--draft_k=5") == run("--mode=fixed")
    capsys.readouterr()
    run("--mode=speculative", "--draft_k=2")
    rounds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["speculative"]
    assert rounds["draft_k"] == 2 and rounds["draft_depth"] == 1
    # every token is a position verified at depth U (the first, the prompt's last); some kept a draft
    assert rounds["verifies"] == 12 and rounds["accepted"] <= rounds["drafted"]
