"""
The task files of evaluation: the JSONL schema of a task file and its checks, the builtin suites
(held-out items of prepare_data.py's synthetic makers, each labelled with its difficulty k), the
standard benchmarks converted to the schema, the paper's prompt templates (App. D), and how a
completion's answer is checked (App. E.1).

Task files are JSONL, one item a line:
    {"type": "mc", "context": "...", "choices": ["...", "..."], "answer": 1}
    {"type": "gen", "prompt": "...", "answer": "...", "cot": "... So the answer is X."}
Models without a tokenizer take "context_ids" / "choices_ids" / "prompt_ids" (and "answer_ids")
instead. Optional per item: "description" (the task's preamble, read from the first item),
"extract" ("answer_is": strict 'the answer is ...', the default; "prefix": the completion starts
with the answer, for models trained on raw text), "difficulty", "max_tokens", "answer_labels" (the
difficulty of each token of an answer of several).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.tasks ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os
import random
import re
import sys

from checkpoint import atomic_write
from configurator import UserError
from prepare_data import KINDS

# ----------------------------------------------------------------------------- task files

ITEM_KEYS = {"type", "context", "choices", "answer", "context_ids", "choices_ids", "prompt",
             "prompt_ids", "answer_ids", "cot", "description", "extract", "difficulty",
             "max_tokens", "kind",
             "answer_labels"}   # the schema's fields


def load_task(path):
    if not os.path.isfile(path):
        raise UserError(f"--task={path}: no such file")
    items = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"--task={path}: line {n} is not UTF-8 text (byte "
                                f"{raw[e.start]:#04x} at column {e.start + 1}); task files are "
                                "JSONL in UTF-8")
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--task={path}: line {n} is not JSON ({e.msg})")
            check_item(item, f"{path}:{n}")
            items.append(item)
    if not items:
        raise UserError(f"--task={path}: no items")
    return items


def check_item(item, where):
    """One task item, field by field, before any model runs: UserError naming the line and the field."""
    kind = item.get("type") if isinstance(item, dict) else None
    unknown = sorted(set(item) - ITEM_KEYS) if isinstance(item, dict) else []
    if unknown:
        raise UserError(f"--task {where}: unknown field {unknown[0]!r}; an item's fields: "
                        + ", ".join(sorted(ITEM_KEYS)))
    text = lambda v: isinstance(v, str)
    ids = lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, int)
                                                            and not isinstance(t, bool) and t >= 0
                                                              for t in v)
    if kind == "mc":
        texts = "context" in item and "choices" in item
        by_ids = "context_ids" in item and "choices_ids" in item
        n = len(item.get("choices") or item.get("choices_ids") or [])
        answer = item.get("answer")
        if not (texts or by_ids) or not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < n:
            raise UserError(f"--task {where}: an mc item needs context + choices (or context_ids + "
                            "choices_ids) and an answer index into the choices (an integer in "
                            f"0..{n - 1}), not {answer!r}")
        context, choices = (item["context"], item["choices"]) if texts else (item["context_ids"],
                                                                             item["choices_ids"])
        one = (lambda v: text(v) and v) if texts else ids
        ok = (text if texts else ids)(context) and isinstance(choices, list) and all(one(v) for v in choices)
        if not ok:
            raise UserError(f"--task {where}: an mc item's context is a string and its choices "
                            "non-empty strings (or context_ids / choices_ids: "
                            "non-empty lists of token ids)")
    elif kind == "gen":
        if not ("prompt" in item or "prompt_ids" in item) or not ("answer" in item
                                                                  or "answer_ids" in item):
            raise UserError(f"--task {where}: a gen item needs prompt (or prompt_ids) and answer "
                            "(or answer_ids)")
        prompt_ok = text(item["prompt"]) if "prompt" in item else item["prompt_ids"] == [] or ids(item["prompt_ids"])
        if not prompt_ok or not (text(item["answer"]) if "answer" in item
                                 else ids(item["answer_ids"])):
            raise UserError(f"--task {where}: a gen item's prompt and answer are strings (or "
                            "prompt_ids / answer_ids: lists of token ids, the answer's not empty; "
                            "an empty prompt is the start of a text)")
        if item.get("extract", "answer_is") not in ("answer_is", "prefix"):
            raise UserError(f"--task {where}: extract={item['extract']!r}; allowed: answer_is, prefix")
    else:
        raise UserError(f"--task {where}: type must be 'mc' or 'gen', not {kind!r}")


def builtin_items(kind, per_level, seed, max_k=4):
    """Held-out generation items from prepare_data.py's makers (another seed than the training
    text), difficulty 1..max_k, scored by the completion's first tokens (the models learn raw text,
    not a question format). kind "synthetic": k-hop chains and digit sums; "pointer", "hops" and
    "graded": look-ups that start after the query, the answer one token (the item up to its first
    labelled token); "graded_multi": the answer is the item's last tokens, every one labelled (each
    its own k: answer_labels), and the item's difficulty is the hardest, max_k."""
    rng = random.Random(seed + 10_000)
    makers = list(dict.fromkeys(KINDS[kind]))     # the dataset's item makers, each once
    multi = kind == "graded_multi"
    items, count = [], {}
    while len(items) < (1 if multi else max_k) * len(makers) * per_level:
        maker = rng.choice(makers)
        item = maker(rng, max_k)
        # the item up to its first answer
        first = next(i for i, (_, label) in enumerate(item) if label)
        answer = item[first:] if multi else item[first:first + 1]
        level = max(label for _, label in answer)
        key = (maker.__name__, level)
        if count.get(key, 0) >= per_level:
            continue
        count[key] = count.get(key, 0) + 1
        items.append({"type": "gen", "prompt": "\n" + "".join(piece for piece, _ in item[:first]),
                      "answer": "".join(piece for piece, _ in answer), "extract": "prefix",
                      "max_tokens": len(answer),
                      "difficulty": level,
                      "kind": {"_chain": "chain", "_digit_sum": "sum"}.get(maker.__name__, kind)})
        if multi:
            items[-1]["answer_labels"] = [label for _, label in answer]
    return items


# ----------------------------------------------------------------------------- standard benchmarks

def mmlu_item(r):
    letters = "ABCD"
    options = "".join(f"{letters[i]}. {c}\n" for i, c in enumerate(r["choices"]))
    return {"type": "mc", "context": r["question"].strip() + "\n" + options + "Answer:",
            "choices": [f" {l}" for l in letters[:len(r["choices"])]], "answer": int(r["answer"])}


def arc_item(r):
    return {"type": "mc", "context": f"Question: {r['question']}\nAnswer:",
            "choices": [f" {t}" for t in r["choices"]["text"]],
            "answer": r["choices"]["label"].index(r["answerKey"])}


def hellaswag_item(r):
    return {"type": "mc", "context": r["ctx"], "choices": [" " + e for e in r["endings"]],
            "answer": int(r["label"])}


def winogrande_item(r):
    """The blank filled by each option; the context is the sentence up to the blank."""
    before, after = r["sentence"].split("_", 1)
    return {"type": "mc", "context": before.rstrip(),
            "choices": [f" {r['option1']}{after}", f" {r['option2']}{after}"],
            "answer": int(r["answer"]) - 1}


def gsm8k_item(r):
    rationale, answer = r["answer"].split("####")
    rationale = re.sub(r"<<.*?>>", "", rationale).strip().replace("\n", " ")
    answer = answer.strip().replace(",", "")
    return {"type": "gen", "prompt": r["question"], "answer": answer, "cot": f"{rationale} So the "
            f"answer is {answer}."}


def bbh_item(r):
    return {"type": "gen", "prompt": r["input"], "answer": r["target"]}


BBH_TASKS = ["boolean_expressions", "causal_judgement", "date_understanding", "disambiguation_qa",
             "dyck_languages", "formal_fallacies", "geometric_shapes", "hyperbaton",
             "logical_deduction_five_objects",
             "logical_deduction_seven_objects", "logical_deduction_three_objects",
             "movie_recommendation", "multistep_arithmetic_two", "navigate", "object_counting",
             "penguins_in_a_table",
             "reasoning_about_colored_objects", "ruin_names",
             "salient_translation_error_detection", "snarks",
             "sports_understanding", "temporal_sequences", "tracking_shuffled_objects_five_objects",
             "tracking_shuffled_objects_seven_objects", "tracking_shuffled_objects_three_objects",
             "web_of_lies", "word_sorting"]
BENCHMARKS = {  # name: (datasets path, configs, split, row -> item in our schema)
    "mmlu": ("cais/mmlu", ["all"], "test", mmlu_item),
    "arc_challenge": ("allenai/ai2_arc", ["ARC-Challenge"], "test", arc_item),
    "hellaswag": ("Rowan/hellaswag", [None], "validation", hellaswag_item),
    "winogrande": ("allenai/winogrande", ["winogrande_xl"], "validation", winogrande_item),
    "gsm8k": ("openai/gsm8k", ["main"], "test", gsm8k_item),
    "bbh": ("lukaemon/bbh", BBH_TASKS, "test", bbh_item),
}


def convert(names, out):
    """Standard benchmarks through the `datasets` library (network), written as our JSONL tasks."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise UserError("--convert needs the optional datasets package (pip install "
                        "datasets) and the network")
    for name in names:
        path, configs, split, to_item = BENCHMARKS[name]
        for config in configs:
            try:
                rows = load_dataset(path, config, split=split)
            except Exception as e:
                # no network, no such dataset: the datasets library's many errors
                raise UserError(f"--convert={name}: cannot load {path} ({config}) with datasets "
                                f"({type(e).__name__}: {str(e)[:120]}); it needs the network")
            file = os.path.join(out, f"{name}_{config}.jsonl" if len(configs) > 1
                                else f"{name}.jsonl")
            write_lines(file, [json.dumps(to_item(r)) for r in rows])
            print(f"wrote {file} ({len(rows)} items)", file=sys.stderr)


def write_lines(path, lines):
    """A text file of lines, written atomically (an interrupted run leaves no half file)."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in lines)
    atomic_write(path, write)


# ----------------------------------------------------------------------------- prompts (App. D)

def shot_text(item):
    if item["type"] == "mc":
        return item["context"] + item["choices"][item["answer"]]
    answer = item.get("cot") or f"The answer is {item['answer']}."
    return f"Q: {item['prompt']}\nA: {answer}"


def gen_prompt_text(item, shots, chat):
    """Non-thinking: the task's description, k chain-of-thought exemplars, then the question, no
    chat template. Thinking (chat): zero-shot, as App. E.1's stored prompt."""
    desc = item.get("description", "")
    if chat:
        return ("Question: " + (desc + "\n\n" if desc else "") + item["prompt"]
                + "\n\nSolve the problem step by step. At the end, write "
                "exactly: the answer is <answer>.")
    head = (desc + "\n\n" if desc else "") + "".join(shot_text(s) + "\n\n" for s in shots)
    if item.get("extract") == "prefix":
        return head + item["prompt"]
    return head + f"Q: {item['prompt']}\nA:"


# ----------------------------------------------------------------------------- checking an answer

ANSWER_IS = re.compile(r"the answer is\s*:?\s*(.+?)\s*(?:$|\n|(?<=[^\s.])\.(?:\s|$))",
                       re.IGNORECASE)


def normalize(ans):
    """Harmless formatting only: surrounding whitespace, trailing punctuation, quotes, bold, $."""
    prev = None
    while prev != ans:
        prev, ans = ans, ans.strip().rstrip(".,;:!").strip("*`\"'$ ")
    return ans


def extract_answer(text):
    """Strict extraction (App. E.1): the last 'the answer is ...' in the text, up to the end of its
    sentence or line; None when there is no such phrase."""
    found = ANSWER_IS.findall(text)
    return normalize(found[-1]) if found else None


def is_correct(item, completion_text, completion_ids):
    if item.get("extract", "answer_is") == "prefix":
        if "answer_ids" in item:
            head = completion_ids[:len(item["answer_ids"])]
            return head == item["answer_ids"], head
        return completion_text.startswith(item["answer"]), completion_text[:len(item["answer"])]
    ans = extract_answer(completion_text)
    return ans is not None and ans == normalize(item["answer"]), ans


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.eval --builtin=... or --task=FILE.jsonl reads them; python "
            "prepare_data.py writes the datasets")
