"""The codebase as a tutorial: one concern per file stated in its first docstring line, no import
cycle (function-level imports included), no library module importing a script, no test module
importing another, and a README whose "Read the code" table names functions that exist, whose
docstrings name the paper's equation, and tests that exist."""
import ast
import importlib
import inspect
import os
import re

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project root
LIBRARY = {"model", "ragged", "kernels", "serve_depthbatch", "modes", "checkpoint", "run_folder", "tokenizer", "api",
           "configurator",
           "server", "objectives", "metrics",
           "engine.build", "engine.contract", "engine.scheduler", "engine.rows", "engine.shared_head", "engine.request",
           "engine.slots", "engine.slot_pass", "engine.graphs", "engine.serving", "engine.speculative",
           "lab.tasks", "lab.claims", "lab.difficulty", "lab.stats", "lab.figures", "lab.report", "lab.gpu_counts",
           "lab.ouro_code", "lab.ouro_way", "lab.cost_model", "lab.harness", "lab.ladder_claims",
           "prepare_data"}     # a script too, but first the definition of the synthetic data, which lab/tasks.py reads
MAX_FILE, MAX_FUNCTION = 600, 60          # lines: a file is read top to bottom, a function at one glance
SCRIPTS = {"train", "sample", "lab.eval", "lab.bench", "lab.bench_kernels", "lab.bench_gpu",
           "lab.bench_engine", "lab.bench_speculative", "lab.reproduce", "lab.export_ouro", "lab.ladder", "lab.soak"}
MAX_ROOT = 20                             # .py files at the root: the paper's files and what they import
WIDE, MAX_WIDE_SHARE = 100, 0.05          # columns; the share of the project's lines past them (nanoGPT's: 3-6%)
PACKAGES = ("lab.", "engine.")            # the folders of modules: the lab, and the engine's fast path


def source_files():
    """{module name: its file}: the root's modules and scripts, the lab's (lab.X), and the tests
    (tests/, test_ragged.py)."""
    out = {}
    for folder, prefix in ((HERE, ""), (os.path.join(HERE, "tests"), ""), (os.path.join(HERE, "lab"), "lab."),
                           (os.path.join(HERE, "engine"), "engine.")):
        out.update({prefix + f[:-3]: os.path.join(folder, f) for f in os.listdir(folder)
                    if f.endswith(".py") and f != "__init__.py"})
    return out


def modules():
    return sorted(source_files())


def imports_of(name):
    """Project modules that `name` imports anywhere in its source (top level or inside a function);
    `from lab import x` and `from lab.x import y` are lab.x (and so for engine/)."""
    tree = ast.parse(open(source_files()[name], encoding="utf-8").read())
    mine, out = set(modules()), set()
    packaged = lambda m: m if m.startswith(PACKAGES) else m.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {packaged(a.name) for a in node.names} & mine
        elif isinstance(node, ast.ImportFrom) and node.module in ("lab", "engine"):
            out |= {f"{node.module}.{a.name}" for a in node.names} & mine
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {packaged(node.module)} & mine
    return out


def test_the_root_holds_the_paper_and_imports_nothing_of_the_lab():
    """At most MAX_ROOT .py files at the root, the user's named files among them; none of them imports
    lab/ (the lab imports the root, never the other way)."""
    root = [m for m in modules() if "." not in m and os.path.dirname(source_files()[m]) == HERE]
    assert len(root) <= MAX_ROOT, sorted(root)
    assert {"model", "ragged", "kernels", "objectives", "train", "sample", "serve_depthbatch", "prepare_data",
            "test_ragged", "server"} <= set(root)
    for m in root:
        assert not {d for d in imports_of(m) if d.startswith("lab.")}, f"{m}.py imports the lab"
        assert "import lab" not in open(source_files()[m], encoding="utf-8").read(), m


def test_every_module_is_in_one_group_and_states_its_concern():
    for name in modules():
        if name.startswith("test_") or name == "conftest":
            continue
        assert name in LIBRARY | SCRIPTS, f"{name}.py: a library module or a script?"
        doc = ast.get_docstring(ast.parse(open(source_files()[name], encoding="utf-8").read()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{name}.py has no first docstring line stating its concern"


def test_no_import_cycle_and_libraries_import_no_script():
    graph = {m: imports_of(m) for m in modules()}
    for lib in LIBRARY:
        assert not graph[lib] & SCRIPTS, f"{lib}.py imports the script(s) {graph[lib] & SCRIPTS}"
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph[m]:
            assert state.get(d) != "open", "import cycle: " + " -> ".join(path + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [m])


def test_no_test_module_imports_another():
    for name in modules():
        if name.startswith("test_"):
            others = {d for d in imports_of(name) if d.startswith("test_")}
            assert not others, f"{name}.py imports {others}: shared helpers belong in conftest.py"


def refs(text):
    """The paper references in a text: {'Eq. 7', 'Eq. 9', 'App. A.2', '§5', ...}; ranges expanded."""
    out = set()
    for m in re.finditer(r"Eq\. ?(\d+(?:\s*(?:-|–|,|/|and|or)\s*(?:Eq\. ?)?\d+)*)", text):
        parts = re.split(r"\s*(,|/|and|or)\s*(?:Eq\. ?)?", m.group(1))
        for p in parts:
            if "-" in p or "–" in p:
                a, b = re.split(r"\s*[-–]\s*", p)
                out |= {f"Eq. {n}" for n in range(int(a), int(b) + 1)}
            elif p.strip().isdigit():
                out.add(f"Eq. {int(p)}")
    out |= set(re.findall(r"App\. [A-Z](?:\.\d)?", text)) | set(re.findall(r"§\d+", text))
    return out


def read_the_code_rows(paper_only=False):
    """The rows of the README's "Read the code" tables: [idea, paper, code, lines, checked by,
    reference]. paper_only: the paper's tables, not the one on going fast (the engine package)."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    section = text.split("## Read the code", 1)[1].split("\n## ", 1)[0]
    if paper_only:
        section = section.split("**Going fast", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| idea") and "---" not in r]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows]


def resolve(ref):
    """'file.py:Class.method' -> the object."""
    path, name = ref.split(":")
    obj = importlib.import_module(path[:-3].replace("/", "."))
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_refs_parser():
    assert refs("Eq. 14-16 and Eq. 9 or Eq. 10, (App. A.2), §5") == {"Eq. 14", "Eq. 15", "Eq. 16", "Eq. 9",
                                                                    "Eq. 10", "App. A.2", "§5"}
    assert refs("Eq. 7, 11") == {"Eq. 7", "Eq. 11"}


def test_read_the_code_names_real_functions_that_cite_their_equation_and_real_tests():
    rows = read_the_code_rows()
    assert len(rows) >= 20
    tests = set()
    for name in modules():
        if name.startswith("test_"):
            tests |= set(re.findall(r"^def (test_\w+)", open(source_files()[name]).read(), re.M))
    for idea, paper, code, lines, checked, reference in rows:
        cited = refs(paper)
        assert cited, f"row {idea!r}: no paper reference"
        for ref in re.findall(r"`([\w./]+\.py:[\w.]+)`", code):
            doc = resolve(ref).__doc__ or ""
            assert cited & refs(doc), f"{ref}: its docstring cites none of {sorted(cited)}"
        for ref in re.findall(r"`([\w./]+\.py:[\w.]+)`", reference):
            resolve(ref)
        for test in re.findall(r"`(test_\w+)`", checked):
            assert test in tests, f"row {idea!r}: no test {test}"


def test_equations_doc_covers_what_the_code_implements():
    text = open(os.path.join(HERE, "docs", "equations.md"), encoding="utf-8").read()
    want = {f"Eq. {n}" for n in [1, 2, 3, 4, 7, 9, 10, 11] + list(range(14, 23))} | {"App. A.2"}
    assert want <= refs(text), sorted(want - refs(text))


def test_no_tracked_text_points_outside_the_project():
    outside = "../" + "shared"
    for folder, dirs, files in os.walk(HERE):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("data", "out", "__pycache__")]
        for f in files:
            if f.endswith((".py", ".md", ".txt")) or f == "run":
                path = os.path.join(folder, f)
                assert outside not in open(path, encoding="utf-8", errors="replace").read(), path


def test_read_the_code_visits_each_file_once_references_first():
    """The reading path is one pass per file (no file comes back after another), and a reference
    that has a row of its own is read before the rows checked against it."""
    rows = read_the_code_rows()
    files = [re.search(r"`([\w./]+\.py):", code).group(1) for _, _, code, _, _, _ in rows]
    visits = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(visits) == len(set(visits)), visits
    named = lambda text: set(re.findall(r"`([\w./]+\.py:[\w.]+)`", text))
    in_table, seen = set().union(*(named(code) for _, _, code, _, _, _ in rows)), set()
    for _, _, code, _, _, reference in rows:
        for ref in named(reference) & in_table:
            assert ref in seen, f"{ref} is read after a row checked against it"
        seen |= named(code)


def test_sizes_and_places():
    """No project file over MAX_FILE lines, no function over MAX_FUNCTION; the tests live under
    tests/ (test_ragged.py beside ragged.py, as the design names it); a license at the root."""
    for name, path in source_files().items():
        if name.startswith("test_") or name == "conftest":
            assert os.path.dirname(path).endswith("tests") or name == "test_ragged", path
            continue
        text = open(path, encoding="utf-8").read()
        assert len(text.splitlines()) <= MAX_FILE, f"{name}.py: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= MAX_FUNCTION, f"{name}.py:{node.name} is {n} lines"
    assert os.path.isfile(os.path.join(HERE, "LICENSE"))


def test_lines_stay_narrow():
    """At most MAX_WIDE_SHARE of the root's and the lab's lines pass WIDE columns (ruff stops any at 120):
    code read side by side with the paper fits beside it."""
    lines = [line for name, path in source_files().items() if not name.startswith("test") and name != "conftest"
             for line in open(path, encoding="utf-8").read().splitlines()]
    wide = sum(len(line) > WIDE for line in lines)
    assert wide <= MAX_WIDE_SHARE * len(lines), f"{wide} of {len(lines)} lines over {WIDE} columns"


READ_BUDGET = 2100     # lines a newcomer reads to reach the paper's ideas (nanoGPT's model.py and train.py: ~640)


def lines_of(ref):
    """'file.py:Name' -> (first, last) line of its source."""
    source, first = inspect.getsourcelines(resolve(ref))
    return first, first + len(source) - 1


def test_read_the_code_gives_each_functions_lines():
    """Every code cell's line range is its function's, as the code stands."""
    for idea, _, code, lines, _, _ in read_the_code_rows():
        ref = re.search(r"`([\w./]+\.py:[\w.]+)`", code).group(1)
        assert lines == "%d-%d" % lines_of(ref), f"row {idea!r}: {ref} is at lines {lines_of(ref)}, not {lines}"


def test_the_paper_is_read_in_about_2100_lines():
    """Following the README's reading order, a reader reads each file of the paper's tables from its top
    to the end of the last function the tables name in it: at most READ_BUDGET lines in all."""
    ends = {}
    for _, _, code, _, _, _ in read_the_code_rows(paper_only=True):
        for ref in re.findall(r"`([\w./]+\.py:[\w.]+)`", code):
            path = ref.split(":")[0]
            ends[path] = max(ends.get(path, 0), lines_of(ref)[1])
    assert sum(ends.values()) <= READ_BUDGET, ends


RUNNERS = {"serve_depthbatch": ["EagerRunner"], "engine.slots": ["SlotRunner"], "engine.contract": ["Runner"],
           "engine.shared_head": ["SharedHead"], "engine.rows": ["Group", "RowsView"]}
SEQ_FIELDS = {"table", "real", "block_evals", "n", "released"}


def class_source(module, name):
    tree = ast.parse(open(source_files()[module], encoding="utf-8").read())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def test_runners_never_see_the_host():
    """A runner is built from what it uses and answers the host's questions: no runner names the Engine,
    holds it (self.e) or reaches its scheduler; eviction happens in one place (Engine._evict, the one
    caller of the scheduler's evict, called by the host alone); nothing outside ragged.py writes a
    RaggedSeq's fields (table, real, block_evals, n), in place or not."""
    for module, classes in RUNNERS.items():
        for name in classes:
            for node in ast.walk(class_source(module, name)):
                if isinstance(node, ast.Name):
                    assert node.id != "Engine", f"{module}.{name} names the Engine"
                if isinstance(node, ast.Attribute):
                    assert node.attr not in ("e", "scheduler", "_evict", "evict", "_make_room"), \
                        f"{module}.{name} reaches the host: .{node.attr}"
    evictions = []
    for module, path in source_files().items():
        if module.startswith("test") or module == "conftest":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in ("evict", "_evict"):
                evictions.append((module, ast.unparse(node.func)))
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            if call and node.func.attr.endswith("_"):
                targets = targets + [node.func.value]
            for t in targets:
                for part in ast.walk(t):
                    if isinstance(part, ast.Attribute) and part.attr in SEQ_FIELDS and "seq" in ast.unparse(part.value):
                        assert module == "ragged", f"{module}.py writes a RaggedSeq's {part.attr}: {ast.unparse(t)}"
    assert sorted(evictions) == [("serve_depthbatch", "self._evict"), ("serve_depthbatch", "self._evict"),
                                 ("serve_depthbatch", "self.scheduler.evict")], evictions
