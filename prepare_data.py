"""
Datasets -> data/<name>/{train,val}.bin (uint16 token ids, as nanoGPT) + meta.json.

    python prepare_data.py                                  # synthetic (default, offline)
    python prepare_data.py --dataset=pointer|hops|graded    # look-ups after the query (below)
    python prepare_data.py --dataset=shakespeare_char [--input=FILE]
    python prepare_data.py --dataset=text --input=FILE [--tokenizer=gpt2 --tiktoken_file=PATH]
    python prepare_data.py --dataset=fineweb_edu --tokens=10000000 [--tiktoken_file=PATH]

`synthetic` mixes easy tokens with hard tokens whose needed depth is known, and saves a
per-token difficulty label (0 = unlabelled, k = difficulty) beside val.bin as val_labels.bin:
  - templated sentences        "the red cat sees a dog."
  - copy spans                 "copy kqzfm : kqzfm."       (the second span is predictable)
  - k-hop variable chains      "x=3 a=5 b=a c=b ; c? 5"    (answer label k = hops, 1..4)
  - digit sums mod 10          "sum 3+4+8=5"               (answer label = number of terms, 1..4)
In those two the k steps can be taken while reading, one per position (`b=a` can be resolved where
it is read), so the answer is a one-step read-out whatever k is. `pointer` holds items whose k
steps cannot be taken one per position as the facts arrive, beside sentences and copies:
  - pointer chasing            "Dc Ab Cf By F7 Y2 ... ; D7 A2"   (D -> c -> 7: k = 2)
    a fact is a name in capitals and its value; four chains of one length k, their pointers first,
    each naming a variable defined *later*, then every chain's digit in a random order, then two
    queries of different chains: answer label k, the look-ups from the queried head to its digit.
    Where a causal model could do the work: from the head, only after the query (k look-ups in a
    row); or traced back while reading, every chain (the query is not known yet), each fact finding
    the one that points at it (about log2 k + 1 in a row by pointer jumping), then one look-up after
    the query. Either way the work grows with k, and it may sit before the answer: the span is
    labelled too.
  python prepare_data.py --dataset=pointer [--max_k=2 --name=pointer2]    # k in 1..max_k
  python prepare_data.py --dataset=pointer --filler=False                 # pointer items only
`hops` holds the pointer items alone, written with one token per fact (a vocabulary of its own,
`dc ` is one token), so that a look-up is a single attention match and k look-ups are k attention
reads in a row; a query of every chain, the first answer labelled:
  - pointer chasing, one token a fact   "hg na pl ei l8 i9 g3 a5 ; E9 P8 N5 H3"   (E -> i -> 9: k = 2)
  python prepare_data.py --dataset=hops [--max_k=2 --name=hops2]
`graded` hides the difficulty: the hops facts, but every item holds four chains of the lengths 1..4,
and two queries of different chains, each answer labelled with its chain's length; which k a query
has is known only by following its chain:
  - graded look-ups                     "hn nl pg ld ae ei i3 m5 d8 g9 ; M5 A3"   (M: k = 1; A -> e -> i -> 3: k = 3)
  python prepare_data.py --dataset=graded
`graded_multi` asks every chain of a graded item, and the answer is the four digits in the order asked:
  - graded, answered in turn            "hn ... g9 ; M A E H;5372"   (each digit labelled with its k)
  python prepare_data.py --dataset=graded_multi
Besides val_labels.bin (the answer token's k), pointer and hops write val_item_labels.bin: the item's
k on every token of the item span, since the work may sit anywhere in it.
"""
import os
import random
import sys
import urllib.request

import numpy as np

from checkpoint import atomic_write, write_json
from configurator import SEED_RULE, UserError, check_writable, parse, run_cli
from tokenizer import char_meta, gpt2_encoding, load_tokenizer, pieces_meta


# ----------------------------------------------------------- the synthetic items (known difficulty)

SYNTH_CHARS = "\n .:;=?+abcdefghijklmnopqrstuvwxyz0123456789"
POINTER_CHARS = SYNTH_CHARS + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"   # names in capitals where they are defined
HOP_NAMES = "abcdefghijklmnop"                                # 16: four chains of up to four names
# and one per fact
HOP_PIECES = (["\n", ";"] + [" " + name.upper() for name in HOP_NAMES] + list("0123456789")   # queries, answers,
              + [name + value + " " for name in HOP_NAMES for value in HOP_NAMES + "0123456789"])

WORDS = dict(
    det=["the", "a", "my", "one"],
    adj=["red", "big", "old", "sad", "tiny", "green"],
    noun=["cat", "dog", "bird", "king", "ship", "tree", "fox"],
    verb=["sees", "likes", "finds", "eats", "helps", "hears"],
)


# Every maker takes (rng, max_k): the items of difficulty k in 1..max_k (unlabelled ones ignore it).

def _sentence(rng, max_k=4):
    w = {k: rng.choice(v) for k, v in WORDS.items()}
    return [(f"{w['det']} {w['adj']} {w['noun']} {w['verb']} the {rng.choice(WORDS['noun'])}.", 0)]


def _copy(rng, max_k=4):
    span = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 8)))
    return [(f"copy {span} : {span}.", 0)]


def _chain(rng, max_k=4):
    """k hops: the answer needs k look-ups. One distractor assignment is mixed in."""
    k = rng.randint(1, max_k)
    names = rng.sample("abcdefghijklmnopqrstuvwxyz", k + 1)
    value, other = rng.sample("0123456789", 2)
    parts = [f"{names[0]}={value}"] + [f"{names[i]}={names[i - 1]}" for i in range(1, k)]
    parts.insert(rng.randint(0, len(parts)), f"{names[k]}={other}")  # distractor
    return [(" ".join(parts) + f" ; {names[k - 1]}? ", 0), (value, k)]


def _digit_sum(rng, max_k=4):
    n = rng.randint(1, max_k)
    terms = [rng.randint(0, 9) for _ in range(n)]
    return [("sum " + "+".join(map(str, terms)) + "=", 0), (str(sum(terms) % 10), n)]


def _chains(rng, lengths, alphabet, rounds=False):
    """Chains of the given lengths (head -> ... -> the name that holds a digit) and their facts
    [(name, value)] in the order written, every fact naming a variable defined *later*, so that a
    look-up cannot start before the query is read. rounds=False: all the pointers first, the chains
    interleaved, each head first, then every chain's digit in a random order (the answer's place
    among the digits says nothing); with chains of one length (pointer, hops) nothing but following
    the queried one tells its digit from the others'. rounds=True (graded, chains of different
    lengths): in rounds, the r-th fact of every chain that has one, in a random order within each
    round, so that where a fact stands says no more about its chain's length than the look-ups that
    led to it (a head, written first among its chain's facts, would otherwise stand earlier the
    longer its chain: tests/test_eval.py checks it). Returns chains, digits, facts."""
    names = iter(rng.sample(alphabet, sum(lengths)))
    chains = [[next(names) for _ in range(k)] for k in lengths]
    digits = [rng.choice("0123456789") for _ in chains]
    facts = [[(vs[i], vs[i + 1]) for i in range(len(vs) - 1)] + [(vs[-1], d)]
             for vs, d in zip(chains, digits)]
    if rounds:
        written = []
        for r in range(max(lengths)):
            this = [f[r] for f in facts if len(f) > r]
            rng.shuffle(this)
            written += this
        return chains, digits, written
    pointers = [f[:-1] for f in facts]
    values = [f[-1] for f in facts]
    order = [i for i, c in enumerate(pointers) for _ in c]
    rng.shuffle(order)
    rng.shuffle(values)
    return chains, digits, [pointers[i].pop(0) for i in order] + values


def _pointer(rng, max_k=4):
    """k look-ups after the query. Four chains of the same length k (_chains), each fact written as
    two characters, the name it defines in capitals and its value (`Dc`: D holds c, look up C), then
    two queries of different chains, each a name in capitals written like a fact, its value to come
    (`Dc Ab Cf By F7 Y2 ... ; D7 A2`). One look-up is one match of a single character (a one-look-up
    query is a copy of what followed its name before): an induction head."""
    k, n = rng.randint(1, max_k), 4
    chains, digits, facts = _chains(rng, [k] * n, "abcdefghijklmnopqrstuvwxyz")
    item = [(" ".join(name.upper() + value for name, value in facts) + " ;", 0)]
    for i in rng.sample(range(n), 2):
        item += [(" " + chains[i][0].upper(), 0), (digits[i], k)]
    return item


def _hops(rng, max_k=4):
    """The pointer items with one token per fact (`dc ` is one token of the `hops` vocabulary,
    HOP_PIECES): a look-up is then one attention match, the query's name against a fact's, whose
    value can carry what it holds, so that k look-ups are k attention reads in a row and no
    induction circuit has to be learned first. Four chains of length k (_chains) over 16 names, then
    a query of every chain in a random order (`hg na pl ei l8 i9 g3 a5 ; E9 P8 N5 H3`). Only the
    first answer is labelled k: a later one may be told by elimination (the last is the digit no
    earlier answer took)."""
    return hops_item(rng, rng.randint(1, max_k))


def hops_item(rng, k, every_answer=False):
    """One hops item of k look-ups (_hops); every_answer: all four answers labelled k (the chain digits
    are drawn with replacement, so that no answer can be had by elimination: lab/ladder.py)."""
    n = 4
    chains, digits, facts = _chains(rng, [k] * n, HOP_NAMES)
    item = [("".join(name + value + " " for name, value in facts) + ";", 0)]
    for j, i in enumerate(rng.sample(range(n), n)):
        item += [(" " + chains[i][0].upper(), 0), (digits[i], k if j == 0 or every_answer else 0)]
    return item


def _graded(rng, max_k=4):
    """Hidden, graded difficulty: the hops items' facts (one token a fact), but the four chains of
    an item have the lengths 1..max_k (cycled: 1, 2, 3, 4), so every item has the same facts of the
    same kinds, written in rounds (_chains): first every chain's head, then every second fact, and
    so on (`hn m5 ae pg nl ei d8 ld i3 g9 ; M5 A3`: M holds 5, k = 1; A -> e -> i -> 3, k = 3). Two
    queries of different chains, each labelled with its chain's length. A query's k is known only by
    following its chain: its head stands among the others' at a place that says nothing of k, and
    each step tells only whether the chain has ended. Two queries of four chains, so that no answer
    can be told by elimination."""
    lengths = [1 + i % max_k for i in range(4)]
    chains, digits, facts = _chains(rng, lengths, HOP_NAMES, rounds=True)
    item = [("".join(name + value + " " for name, value in facts) + ";", 0)]
    for i in rng.sample(range(4), 2):
        item += [(" " + chains[i][0].upper(), 0), (digits[i], len(chains[i]))]
    return item


def _graded_multi(rng, max_k=4):
    """The graded items with every chain queried, and answered in one answer of several tokens (the
    decode regime of Fig. 1 on a look-up task): the graded facts (chains of lengths 1..max_k,
    cycled, written in rounds), then after `;` the four heads in a random order and `;`, then the
    four digits in that order, each labelled with its chain's length (`... ; M A E H;5372`: M: k =
    1, A: k = 3). Answer j stands five tokens after its query, so that finding which chain it
    answers is one attention read at a fixed offset; its digit takes the chain's look-ups. Every
    item holds every k, in an order that says nothing of them."""
    lengths = [1 + i % max_k for i in range(4)]
    chains, digits, facts = _chains(rng, lengths, HOP_NAMES, rounds=True)
    order = rng.sample(range(4), 4)
    item = [("".join(name + value + " " for name, value in facts) + ";", 0)]
    item += [(" " + chains[i][0].upper(), 0) for i in order] + [(";", 0)]
    return item + [(digits[i], len(chains[i])) for i in order]


FILLER = [_sentence, _copy]                 # unlabelled items, the easy tokens between the labelled ones
KINDS = {"synthetic": [_chain, _digit_sum], "pointer": [_pointer, _pointer], "hops": [_hops, _hops],
         "graded": [_graded, _graded], "graded_multi": [_graded_multi, _graded_multi]}


# ----------------------------------------------------------------------------- the command line

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

DEFAULTS = dict(
    dataset="synthetic",   # which dataset to prepare
    data_dir="data",       # writes data_dir/<name>/
    name="",               # output folder name (default: the dataset name)
    seed=1337,             # synthetic: the text generator's seed
    size=1_000_000,        # synthetic, pointer, hops: tokens in total (train + val; a character each, but in hops)
    val_fraction=0.1,      # share of the tokens kept for validation (the end of the text)
    input="",              # shakespeare_char / text: local file (shakespeare downloads if empty)
    tokenizer="char",      # text: characters, or GPT-2 BPE
    tiktoken_file="",      # a gpt2.tiktoken ranks file, to build the GPT-2 encoding offline
    tokens=10_000_000,     # fineweb_edu: how many tokens to take
    max_k=4,               # synthetic, pointer, hops: the hardest item (difficulty k in 1..max_k: look-ups, sum terms)
    filler=True,           # synthetic, pointer: sentences and copies between the labelled items (False: none)
)
RULES = dict(dataset=["synthetic", "pointer", "hops", "graded", "graded_multi",
                      "shakespeare_char", "text", "fineweb_edu"],
             tokenizer=["char", "gpt2"], seed=SEED_RULE, size="in [100, 1000000000]",
             val_fraction="in (0, 1)", tokens="in [100, 100000000000]", max_k="in [1, 4]",
             name=lambda v: "a folder name, not a path" if ("/" in v or v in (".", "..")) else None)
# the keys that act only for some datasets (their comments say which): set for another, refused
made = ("--dataset=synthetic (or pointer, hops, graded, graded_multi)",
        lambda c: c["dataset"] in KINDS)
NEEDS = dict(seed=made, size=made, max_k=made,
             filler=("--dataset=synthetic (or pointer)",
                     lambda c: c["dataset"] in ("synthetic", "pointer")),
             input=("--dataset=text (or shakespeare_char)",
                    lambda c: c["dataset"] in ("text", "shakespeare_char")),
             tokenizer=("--dataset=text", lambda c: c["dataset"] == "text"),
             tiktoken_file=("--dataset=text --tokenizer=gpt2 (or fineweb_edu)",
                            lambda c: c["tokenizer"] == "gpt2" or c["dataset"] == "fineweb_edu"),
             tokens=("--dataset=fineweb_edu", lambda c: c["dataset"] == "fineweb_edu"))


# ----------------------------------------------------------------------------- synthetic

def synthetic_text(n_tokens, seed, kinds="synthetic", max_k=4, filler=True, encode=None):
    """Deterministic text of the makers of KINDS[kinds] (half the items, the rest FILLER;
    filler=False: the labelled items only), with two per-token labels: the answer token's difficulty
    (0 = unlabelled, else 1..max_k), and the item's difficulty over its whole span. encode: the
    tokenizer (None: one token per character)."""
    rng = random.Random(seed)
    makers = (FILLER if filler else []) + KINDS[kinds]
    length = (lambda piece: len(encode(piece))) if encode else len
    text, labels, spans, total = [], [], [], 0
    while total < n_tokens:
        item = rng.choice(makers)(rng, max_k)
        span = max(label for _, label in item)
        for piece, label in item + [("\n", 0)]:
            n = length(piece)
            text.append(piece)
            labels.extend([label] * n)
            spans.extend([span if piece != "\n" else 0] * n)
            total += n
    return "".join(text), np.array(labels, dtype=np.uint8), np.array(spans, dtype=np.uint8)


# ----------------------------------------------------------------------------- writers

def write_split(out, ids, val_fraction, labels=None, meta=None, spans=None):
    ids = np.asarray(ids)
    if len(ids) < 2:
        raise UserError(f"only {len(ids)} token(s) to split into train and val")
    if ids.max() >= 2 ** 16:
        raise UserError(f"token id {ids.max()} does not fit uint16")
    n_val = min(max(int(len(ids) * val_fraction), 1), len(ids) - 1)
    n_train = len(ids) - n_val
    files = {"train.bin": ids.astype(np.uint16)[:n_train],
             "val.bin": ids.astype(np.uint16)[n_train:]}
    if labels is not None:
        files["val_labels.bin"] = labels[n_train:]
    if spans is not None:
        files["val_item_labels.bin"] = spans[n_train:]
    for name, array in files.items():  # each file whole or not at all
        atomic_write(os.path.join(out, name), lambda tmp: array.tofile(tmp))
    write_json(os.path.join(out, "meta.json"), meta)
    print(f"wrote {out}: train {n_train:,} tokens, val {n_val:,} tokens, vocab {meta['vocab_size']}",
          file=sys.stderr)


def prepare(c):
    out = os.path.join(c["data_dir"], c["name"] or c["dataset"])
    if c["dataset"] in KINDS:
        meta = {"synthetic": char_meta(SYNTH_CHARS), "pointer": char_meta(POINTER_CHARS),
                "hops": pieces_meta(HOP_PIECES), "graded": pieces_meta(HOP_PIECES),
                "graded_multi": pieces_meta(HOP_PIECES)}[c["dataset"]]
        encode, _ = load_tokenizer(meta)
        # no tokens for sentences in the others
        filler = c["filler"] and c["dataset"] in ("synthetic", "pointer")
        text, labels, spans = synthetic_text(c["size"], c["seed"], c["dataset"], c["max_k"],
                                             filler, encode)
        meta["labels"] = "val_labels.bin: uint8 per val token, 0 unlabelled, k = difficulty 1..4"
        # the work may sit anywhere in a look-up item
        look_ups = c["dataset"] != "synthetic"
        if look_ups:
            meta["item_labels"] = "val_item_labels.bin: uint8 per val token, the difficulty of its item (0: none)"
        write_split(out, encode(text), c["val_fraction"], labels, meta, spans if look_ups else None)
    elif c["dataset"] in ("shakespeare_char", "text"):
        text = _read_text(c)
        if c["dataset"] == "text" and c["tokenizer"] == "gpt2":
            meta = {"tokenizer": "gpt2", "vocab_size": 50257}
            ids = load_tokenizer(meta, c["tiktoken_file"])[0](text)
        else:
            meta = char_meta(sorted(set(text)))
            ids = load_tokenizer(meta)[0](text)
        write_split(out, ids, c["val_fraction"], meta=meta)
    else:
        write_split(out, _fineweb_ids(c), c["val_fraction"],
                    meta={"tokenizer": "gpt2", "vocab_size": 50257})
    return out


def _read_text(c):
    if c["input"]:
        if not os.path.isfile(c["input"]):
            raise UserError(f"--input={c['input']!r} does not exist")
        try:
            with open(c["input"], encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise UserError(f"--input={c['input']!r}: not UTF-8 text")
        if not text:
            raise UserError(f"--input={c['input']!r}: the file is empty")
        return text
    if c["dataset"] == "text":
        raise UserError("--dataset=text needs --input=FILE")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
            return r.read().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot download tiny shakespeare ({e}); pass --input=FILE with a local copy")


def _fineweb_ids(c):
    try:
        from datasets import load_dataset
    except ImportError:
        raise UserError("--dataset=fineweb_edu needs the optional 'datasets' "
                        "package: pip install datasets")
    from tqdm import tqdm
    enc = gpt2_encoding(c["tiktoken_file"])
    ds = load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train",
                      streaming=True)
    ids, bar = [], tqdm(total=c["tokens"], unit="tok", desc="fineweb_edu")
    for row in ds:
        doc = enc.encode_ordinary(row["text"]) + [enc.eot_token]
        ids.extend(doc)
        bar.update(len(doc))
        if len(ids) >= c["tokens"]:
            break
    bar.close()
    return ids[:c["tokens"]]


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__, needs=NEEDS)
    check_writable(c["data_dir"], "data_dir")
    prepare(c)


if __name__ == "__main__":
    run_cli(main)
