"""Every citation of the paper in the project (code, tests, README, docs/, results/RESULTS.md and
notes.md) names an item that exists in the paper's numbering (docs/paper.md), and one that grounds
what the project implements or measures (never its introduction, related work, limitations or lists
of benchmarks)."""
import os
import re

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project root
SKIP = {".git", "data", "__pycache__", ".pytest_cache"}
NUMBER = r"\d+(?:\.\d+)?"
LIST = rf"{NUMBER}(?:\s*(?:-|–|,|and|or|/)\s*{NUMBER}(?![\w.]))*"


def numbering():
    """docs/paper.md's table: {ref: where it may be cited}: True (anywhere), False (nowhere) or the
    set of files it may be cited in."""
    text = open(os.path.join(HERE, "docs", "paper.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (§\d+(?:\.\d+)?|App\. [A-Z](?:\.\d)?|Eq\. \d+|Fig\. \d+|Table \d+) \| .* \| "
                      r"(yes|no|where [^:]*: [^|]*) \|$", text, re.M)
    return {ref: cited == "yes" if cited in ("yes", "no") else set(cited.split(": ")[1].split())
            for ref, cited in rows}


def may_cite(where, path):
    return where is True or (isinstance(where, set) and path in where) or path == "docs/paper.md"


def expand(prefix, numbers):
    """'5, 13 and 14' -> [prefix 5, prefix 13, prefix 14]; '14-16' -> 14, 15, 16 (whole numbers)."""
    out = []
    for part in re.split(r"\s*(?:,|and|or|/)\s*", numbers):
        ends = re.split(r"\s*[-–]\s*", part)
        if len(ends) == 2 and all(e.isdigit() for e in ends):
            out += [f"{prefix}{n}" for n in range(int(ends[0]), int(ends[1]) + 1)]
        elif part:
            out.append(prefix + part)
    return out


def citations(text):
    """The paper references in a text, each as docs/paper.md writes it: §4.1, App. A.2, Eq. 7,
    Fig. 12, Table 17 (lists and ranges expanded)."""
    out = []
    for m in re.finditer(rf"§\s?({LIST})", text):
        out += expand("§", m.group(1))
    for m in re.finditer(rf"\bEqs?\.\s?({LIST})", text):
        out += expand("Eq. ", m.group(1))
    for m in re.finditer(rf"\b(?:Fig\.|Figs\.|Figures?)\s({LIST})", text):
        out += expand("Fig. ", m.group(1))
    for m in re.finditer(rf"\bTables?\s({LIST})", text):
        out += expand("Table ", m.group(1))
    letters = r"[A-Z](?:\.\d)?(?:\s*(?:-|–|,|and)\s*[A-Z](?:\.\d)?(?![\w]))*"
    for m in re.finditer(rf"\b(?:App\.|Appendix|Appendices)\s({letters})", text):
        for part in re.split(r"\s*(?:,|and)\s*", m.group(1)):
            ends = re.split(r"\s*[-–]\s*", part)
            if len(ends) == 2 and all(len(e) == 1 for e in ends):
                out += [f"App. {chr(c)}" for c in range(ord(ends[0]), ord(ends[1]) + 1)]
            else:
                out.append("App. " + part)
    return out


def project_texts():
    """(path, text) of every file whose words the project stands behind: its code and tests, README,
    docs/, results/RESULTS.md and results/notes.md (not the runs' own logs)."""
    for folder, dirs, files in os.walk(HERE):
        rel = os.path.relpath(folder, HERE)
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".") and not (rel == "." and d == "results")]
        for f in files:
            if f.endswith((".py", ".md", ".cff")):
                path = os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")
                yield path, open(os.path.join(folder, f), encoding="utf-8").read()
    for f in ("RESULTS.md", "notes.md"):
        path = os.path.join(HERE, "results", f)
        if os.path.isfile(path):
            yield "results/" + f, open(path, encoding="utf-8").read()


def test_citations_parser():
    assert citations("Eq. 14-16 and Eq. 9, (App. A.2), §4.1, Fig. 5, 13 and 14; Table 17") == [
        "§4.1", "Eq. 14", "Eq. 15", "Eq. 16", "Eq. 9", "Fig. 5", "Fig. 13", "Fig. 14", "Table 17", "App. A.2"]
    assert citations("§2-3, Figures 4 (and 7), App. A-C, Eq. 7, 11") == [
        "§2", "§3", "Eq. 7", "Eq. 11", "Fig. 4", "App. A", "App. B", "App. C"]


def test_the_numbering_is_the_papers():
    known = numbering()
    assert {f"Eq. {n}" for n in range(1, 23)} | {f"Fig. {n}" for n in range(1, 22)} <= set(known)
    assert {f"Table {n}" for n in range(1, 18)} | {f"§{n}" for n in range(1, 8)} <= set(known)
    assert known["§" + "6"] is False and known["§4.1"] is True and known["App. A.2"] is True
    five = known["Table " + "5"]
    assert not may_cite(five, "lab/claims.py") and may_cite(five, "lab/eval.py")


def test_every_citation_names_an_item_of_the_paper_that_grounds_it():
    known = numbering()
    unknown, uncitable = [], []
    for path, text in project_texts():
        for i, line in enumerate(text.splitlines(), 1):
            for ref in citations(line):
                if ref not in known:
                    unknown.append(f"{path}:{i}: {ref}")
                elif not may_cite(known[ref], path):
                    uncitable.append(f"{path}:{i}: {ref}")
    assert not unknown, f"citations of nothing in the paper: {unknown[:10]}"
    assert not uncitable, f"citations of what grounds nothing here (docs/paper.md: cited no): {uncitable[:10]}"
