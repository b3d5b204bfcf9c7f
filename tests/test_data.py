"""The datasets (prepare_data.py) and tokenizers: pointer, Hops, graded and graded-multi items and what their
labels promise, synthetic data deterministic with correct labels, the pieces tokenizer, text data with a char
or an offline BPE tokenizer."""
import json
import os

import numpy as np
import pytest
import torch

import prepare_data
from configurator import UserError
from conftest import chase
from tokenizer import load_tokenizer, pieces_meta


def resolve(line):
    """Brute force: the value of the queried variable, and the look-ups it takes, of a chain item
    `x=3 a=x ; a? 3`."""
    left, q = line.split(" ; ")
    env = dict(p.split("=") for p in left.split())
    var, ans = q.split("? ")
    hops, v = 1, var
    while not env[v].isdigit():
        v, hops = env[v], hops + 1
    return env[v], ans, hops


def test_pointer_items_need_their_k_lookups_after_the_query():
    """Every pointer item: four chains of one length k, each fact naming a variable defined later or
    a digit (nothing resolves as it is read), every digit after every pointer; two queries of
    different heads (names no fact points at), each answered by what brute force finds in k
    look-ups and labelled k, the whole span labelled k; the answer's place among the digits gives
    nothing away."""
    text, labels, spans = prepare_data.synthetic_text(30000, seed=5, kinds="pointer")
    assert text == prepare_data.synthetic_text(30000, seed=5, kinds="pointer")[0] and len(text) == len(spans)
    pos, seen, last = 0, set(), []
    for line in text.split("\n")[:-1]:
        lab, span = labels[pos:pos + len(line)], spans[pos:pos + len(line)]
        if " ; " in line:
            left, right = line.split(" ; ")
            facts, queries = left.split(), right.split()
            defined = [f[0] for f in facts]
            assert all(len(f) == 2 and f[0].isupper() for f in facts) and len(set(defined)) == len(facts), line
            for i, f in enumerate(facts):
                assert f[1].isdigit() or f[1].upper() in defined[i + 1:], line   # a forward reference
            digits = [f[-1].isdigit() for f in facts]
            assert digits == sorted(digits) and sum(digits) == 4, line          # pointers first, then 4 digits
            heads = set(defined) - {f[1].upper() for f in facts}
            ks = {chase(facts, h)[1] for h in heads}
            assert len(heads) == 4 and len(ks) == 1, line                        # four chains of one length
            k = ks.pop()
            assert len(queries) == 2 and len({q[0] for q in queries}) == 2 and {q[0] for q in queries} <= heads
            answers = [len(left) + 3 + 3 * i + 1 for i in range(2)]              # where each answer digit sits
            for q, at in zip(queries, answers):
                assert len(q) == 2 and chase(facts, q[0]) == (q[1], k) and line[at] == q[1], line
                last.append(facts[-1][-1] == q[1])
            assert [int(x) for x in lab] == [k if i in answers else 0 for i in range(len(line))], line
            assert set(span.tolist()) == {k}
            seen.add(k)
        else:
            assert lab.sum() == 0 and span.sum() == 0
        pos += len(line) + 1
    assert seen == {1, 2, 3, 4} and 0.1 < sum(last) / len(last) < 0.5
    text, labels, _ = prepare_data.synthetic_text(5000, seed=5, kinds="pointer", max_k=2)   # chains of 1..2
    assert set(labels.tolist()) - {0} == {1, 2}
    lines = prepare_data.synthetic_text(5000, seed=5, kinds="pointer", filler=False)[0].split("\n")[:-1]
    assert all(" ; " in line for line in lines) and len(lines) > 20     # --filler=False: pointer items only


def test_hops_items_are_pointer_items_with_one_token_per_fact(tmp_path):
    """prepare_data --dataset=hops, read back from its files: every fact is one token (the
    longest-match vocabulary cuts `dc ` whole), the facts form four chains of one length k written
    as in pointer (forward references, every digit after every pointer), then a query of every
    head, each answered by what brute force finds; per token, only the first answer is labelled k,
    and every token of the item carries k in the span labels. Nothing but items."""
    seed = int(torch.randint(0, 1000, ()))
    out = prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="hops", data_dir=str(tmp_path), size=20000,
                                    val_fraction=0.5, seed=seed))
    meta = json.load(open(os.path.join(out, "meta.json")))
    encode, decode = load_tokenizer(meta)
    ids = np.fromfile(os.path.join(out, "val.bin"), dtype=np.uint16).tolist()
    labels, spans = (np.fromfile(os.path.join(out, f), dtype=np.uint8).tolist()
                     for f in ("val_labels.bin", "val_item_labels.bin"))
    assert meta["vocab_size"] == len(prepare_data.HOP_PIECES) == 444 and len(ids) == len(labels) == len(spans)
    newline, seen = encode("\n")[0], set()
    ends = [i for i, t in enumerate(ids) if t == newline]
    for start, end in zip(ends, ends[1:]):                         # whole items between two newlines
        toks = [decode([t]) for t in ids[start + 1:end]]
        facts, rest = toks[:toks.index(";")], toks[toks.index(";") + 1:]
        assert all(len(f) == 3 and f[0].islower() and f[2] == " " for f in facts), toks   # one token a fact
        defined = [f[0].upper() for f in facts]
        assert len(set(defined)) == len(facts)
        assert all(f[1].isdigit() or f[1].upper() in defined[i + 1:] for i, f in enumerate(facts)), toks
        digits = [f[1].isdigit() for f in facts]
        assert digits == sorted(digits) and sum(digits) == 4, toks
        heads = set(defined) - {f[1].upper() for f in facts}
        k = chase([f[:2] for f in facts], sorted(heads)[0])[1]
        queries = [q.strip() for q in rest[0::2]]
        assert len(rest) == 8 and sorted(queries) == sorted(heads) and len(heads) == 4
        assert all(chase([f[:2] for f in facts], q) == (a, k) for q, a in zip(queries, rest[1::2])), toks
        first = start + 1 + len(facts) + 2                          # the first answer's token
        assert labels[start + 1:end] == [k if i == first else 0 for i in range(start + 1, end)]
        assert spans[start + 1:end] == [k] * (end - start - 1) and spans[end] == 0
        seen.add(k)
    assert seen == {1, 2, 3, 4} and len(ends) > 50
    train_ids = np.fromfile(os.path.join(out, "train.bin"), dtype=np.uint16).tolist()
    assert decode(train_ids + ids) == prepare_data.synthetic_text(20000, seed, "hops", filler=False, encode=encode)[0]


def test_graded_items_hide_their_difficulty_and_label_both_answers(tmp_path):
    """prepare_data --dataset=graded, read back from its files: every item holds four chains of the
    lengths 1..4 (ten one-token facts, four of them digits, forward references), then two queries of
    different heads, each answered by what brute force finds and labelled with its chain's length;
    the span labels carry the item's largest label. Nothing but items."""
    seed = int(torch.randint(0, 1000, ()))
    out = prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="graded", data_dir=str(tmp_path), size=20000,
                                    val_fraction=0.5, seed=seed))
    encode, decode = load_tokenizer(json.load(open(os.path.join(out, "meta.json"))))
    ids = np.fromfile(os.path.join(out, "val.bin"), dtype=np.uint16).tolist()
    labels, spans = (np.fromfile(os.path.join(out, f), dtype=np.uint8).tolist()
                     for f in ("val_labels.bin", "val_item_labels.bin"))
    newline, seen = encode("\n")[0], []
    ends = [i for i, t in enumerate(ids) if t == newline]
    for start, end in zip(ends, ends[1:]):
        toks = [decode([t]) for t in ids[start + 1:end]]
        facts, rest = toks[:toks.index(";")], toks[toks.index(";") + 1:]
        defined = [f[0].upper() for f in facts]
        assert len(facts) == 10 and len(set(defined)) == 10 and sum(f[1].isdigit() for f in facts) == 4, toks
        assert all(f[1].isdigit() or f[1].upper() in defined[i + 1:] for i, f in enumerate(facts)), toks
        heads = set(defined) - {f[1].upper() for f in facts}
        assert sorted(chase([f[:2] for f in facts], h)[1] for h in heads) == [1, 2, 3, 4]
        queries = [q.strip() for q in rest[0::2]]
        assert len(rest) == 4 and len(set(queries)) == 2 and set(queries) <= heads
        ks = [chase([f[:2] for f in facts], q) for q in queries]
        assert [a for a, _ in ks] == rest[1::2], toks
        answers = [start + 1 + len(facts) + 2, start + 1 + len(facts) + 4]
        label_at = dict(zip(answers, [k for _, k in ks]))
        assert labels[start + 1:end] == [label_at.get(i, 0) for i in range(start + 1, end)]
        assert spans[start + 1:end] == [max(k for _, k in ks)] * (end - start - 1)
        seen += [k for _, k in ks]
    assert set(seen) == {1, 2, 3, 4} and len(ends) > 50


def test_graded_multi_items_ask_every_chain_and_answer_each_five_tokens_after_its_query(tmp_path):
    """prepare_data --dataset=graded_multi, read back from its files: the graded facts, then every head
    once (a random order, `;` after), then the four digits in that order, each what brute force finds
    and labelled with its chain's length, five tokens after its query; every k in every item, the
    queries' order saying nothing of k (each k takes each of the four places about equally often)."""
    seed = int(torch.randint(0, 1000, ()))
    out = prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="graded_multi", data_dir=str(tmp_path),
                                    size=40000, val_fraction=0.5, seed=seed))
    encode, decode = load_tokenizer(json.load(open(os.path.join(out, "meta.json"))))
    ids = np.fromfile(os.path.join(out, "val.bin"), dtype=np.uint16).tolist()
    labels = np.fromfile(os.path.join(out, "val_labels.bin"), dtype=np.uint8).tolist()
    newline, places = encode("\n")[0], np.zeros((4, 4))
    ends = [i for i, t in enumerate(ids) if t == newline]
    for start, end in zip(ends, ends[1:]):
        toks = [decode([t]) for t in ids[start + 1:end]]
        facts, rest = toks[:toks.index(";")], toks[toks.index(";") + 1:]
        heads = {f[0].upper() for f in facts} - {f[1].upper() for f in facts}
        queries, digits = [q.strip() for q in rest[:4]], rest[5:]
        assert rest[4] == ";" and len(rest) == 9 and set(queries) == heads, toks
        ks = [chase([f[:2] for f in facts], q) for q in queries]
        assert [a for a, _ in ks] == digits and sorted(k for _, k in ks) == [1, 2, 3, 4], toks
        at = start + 1 + len(facts) + 1
        assert labels[start + 1:end] == [0] * (len(facts) + 6) + [k for _, k in ks]
        assert all(toks[len(facts) + 1 + j] == " " + queries[j] and ids[at + j + 5] == encode(digits[j])[0]
                   for j in range(4))
        for j, (_, k) in enumerate(ks):
            places[k - 1, j] += 1
    n = places.sum() / 4
    assert n > 100 and np.abs(places / n - 0.25).max() < 0.1, places


def test_synthetic_data_is_deterministic_with_correct_labels(tmp_path):
    t1, l1, _ = prepare_data.synthetic_text(20000, seed=3)
    t2, l2, _ = prepare_data.synthetic_text(20000, seed=3)
    t3, _, _ = prepare_data.synthetic_text(20000, seed=4)
    assert t1 == t2 and np.array_equal(l1, l2) and t1 != t3
    assert len(t1) == len(l1)
    lines = t1.split("\n")[:-1]
    pos, seen = 0, set()
    for line in lines:
        labels = l1[pos:pos + len(line)]
        if "?" in line:  # chain: follow the assignments by brute force
            value, ans, hops = resolve(line)
            assert value == ans and labels[-1] == hops and labels[:-1].sum() == 0
            seen.add(("chain", hops))
        elif line.startswith("sum "):
            terms, ans = line[4:].split("=")
            terms = [int(t) for t in terms.split("+")]
            assert sum(terms) % 10 == int(ans) and labels[-1] == len(terms) and labels[:-1].sum() == 0
            seen.add(("sum", len(terms)))
        else:
            assert labels.sum() == 0
            if line.startswith("copy "):
                a, b = line[5:-1].split(" : ")
                assert a == b
        pos += len(line) + 1
    assert {("chain", k) for k in range(1, 5)} <= seen and {("sum", k) for k in range(1, 5)} <= seen
    assert set(prepare_data.synthetic_text(5000, seed=3, max_k=2)[1].tolist()) == {0, 1, 2}   # chains, sums of 1..2
    out = prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=str(tmp_path), size=20000, seed=3))
    val = np.fromfile(os.path.join(out, "val.bin"), dtype=np.uint16)
    lab = np.fromfile(os.path.join(out, "val_labels.bin"), dtype=np.uint8)
    train_ids = np.fromfile(os.path.join(out, "train.bin"), dtype=np.uint16)
    meta = json.load(open(os.path.join(out, "meta.json")))
    enc, dec = load_tokenizer(meta)
    assert dec(list(train_ids)) + dec(list(val)) == t1[:len(train_ids) + len(val)]
    assert len(lab) == len(val) and np.array_equal(lab, l1[len(train_ids):len(train_ids) + len(val)])


def test_pieces_tokenizer_takes_the_longest_piece_first():
    """The `pieces` tokenizer (hops): at every character the longest piece that matches, decoding
    gives the text back, and a character no piece starts with is a UserError naming where."""
    encode, decode = load_tokenizer(pieces_meta(["a", "ab", "ab ", "b", " ", ";"]))
    assert encode("ab ab;a b") == [2, 1, 5, 0, 4, 3] and decode(encode("ab ab;a b")) == "ab ab;a b"
    with pytest.raises(UserError, match="at character 3"):
        encode("ab c")


def test_text_dataset_char_and_offline_bpe(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("hello world, " * 50)
    out = prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="text", input=str(src), data_dir=str(tmp_path)))
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(set("hello world, "))
    with pytest.raises(UserError):
        prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="text", input=str(tmp_path / "missing")))
    with pytest.raises(UserError):
        prepare_data.gpt2_encoding(str(tmp_path / "missing.tiktoken"))
    # a ranks file in tiktoken's format (base64 token, rank), made here: bytes plus one merge
    import base64
    ranks = [bytes([b]) for b in range(256)] + [b"he"]
    f = tmp_path / "tiny.tiktoken"
    f.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    enc = prepare_data.gpt2_encoding(str(f))
    ids = enc.encode("hello world")
    assert ids[0] == 256 and enc.decode(ids) == "hello world"
    bpe = prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="text", input=str(src), tokenizer="gpt2",
                                    tiktoken_file=str(f), data_dir=str(tmp_path), name="bpe"))
    ids = np.fromfile(os.path.join(bpe, "train.bin"), dtype=np.uint16)
    assert ids[0] == 256 and json.load(open(os.path.join(bpe, "meta.json")))["tokenizer"] == "gpt2"
