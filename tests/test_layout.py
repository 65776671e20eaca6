"""The package layout the README promises: the loop knows no backend, train/ never uses tools/,
model.py is only the architecture."""

import ast
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llm_trainer"


def _imports(path: Path) -> set[str]:
    """Modules a file imports, as absolute dotted names (relative imports resolved against the package)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def test_train_never_imports_tools():
    for path in (PACKAGE / "train").glob("*.py"):
        assert not any(name.startswith("llm_trainer.tools") for name in _imports(path)), path.name


def test_nothing_below_the_api_imports_tools_and_the_pipeline_imports_no_train():
    """tools/ sits above the API; the pipeline sits below the Trainer, which calls it (Trainer.from_config)."""
    above_the_api = ("tools", "api.py", "cli.py", "__init__.py", "__main__.py")
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in above_the_api:
            continue
        assert not any(name.startswith("llm_trainer.tools") for name in _imports(path)), path
    assert not any(
        name.startswith(("llm_trainer.train", "llm_trainer.api")) for name in _imports(PACKAGE / "pipeline.py")
    )


def _code_words(path: Path) -> set[str]:
    """Names, attributes and string constants of a file's code (comments and docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id.lower())
        elif isinstance(node, ast.Attribute):
            words.add(node.attr.lower())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value.lower())
    return words


def test_the_loop_has_no_backend_branches():
    """Backends are behind Parallelism and the Checkpointer: the loop's code names none of them."""
    words = _code_words(PACKAGE / "train" / "trainer.py")
    for word in ("deepspeed", "fsdp", "ddp", "engine", "sharded", "distributeddataparallel", "save_file", "rmtree"):
        assert not any(word in w for w in words), word


def test_model_is_only_the_architecture():
    """model.py imports its config and the loss's tensor functions (loss.py, which imports nothing of ours)
    and nothing else of ours (model folders: checkpoint.model_folder)."""
    imports = _imports(PACKAGE / "model.py")
    ours = {name.rsplit(".", 1)[0] if name.startswith("llm_trainer.loss.") else name for name in imports}
    ours = {name for name in ours if name.startswith("llm_trainer")}
    assert ours <= {"llm_trainer.config", "llm_trainer.config.ModelConfig", "llm_trainer.loss"}, ours
    assert not any(name.startswith("llm_trainer") for name in _imports(PACKAGE / "loss.py"))
    assert not any(name.startswith(("torch.distributed", "deepspeed")) for name in imports)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(path: Path, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a file, at any depth (inside functions too), except those under
    `if TYPE_CHECKING:`, which never run (with `typing`, those too)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not typing:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports. `from package import name` is an edge to the
    submodule `name` when there is one, else to the package's `__init__` (which then counts as a
    module); the `__init__` files Python runs on the way to a submodule are not edges. `typing`: the
    imports under `if TYPE_CHECKING:` are edges too."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in _runtime_imports(path, typing):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                names = [f"{source}.{alias.name}" for alias in node.names]
            for name in names:
                while name and name not in modules:  # `module.attribute`: the module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search; grey = on the current path)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "grey"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "grey":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "black"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    """Each module depends only on modules below it, lazy imports inside functions included: a cycle
    is two modules that each need the other, and one of them should own what they share."""
    graph = _import_graph()
    assert "llm_trainer.checkpoint.local" in graph["llm_trainer.checkpoint.checkpointer"]  # the graph is real
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_closes_through_type_checking_imports():
    """An import made for type hints alone still says which module needs which: no cycle through them."""
    cycle = _find_cycle(_import_graph(typing=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The floors of the package, bottom first, as the README's "How the code is laid out" states them: a module
# imports modules of its own floor or of floors below (type-only imports included).
FLOORS = [
    ("errors", "logs", "launcher"),
    ("limits",),
    ("files",),
    ("tokenizer",),
    ("config", "config_aliases", "config_loader"),
    ("loss",),
    ("model", "generate"),
    ("checkpoint",),
    ("data", "parallel", "hf", "downstream"),
    ("resolve",),
    ("pipeline",),
    ("train",),
    ("api",),
    ("tools",),
    ("cli", "__main__"),
]
# The README's named exception: these two hf/ modules import nothing of ours but errors, and the tokenizer
# (and the data sources) use them although the rest of hf/ sits above.
SEAMS = {("llm_trainer.tokenizer", "llm_trainer.hf.fast_tokenizer")}


def _floor(module: str) -> int:
    """The floor of a module of the package (the package's own __init__ is the top: it exports the API)."""
    if module == "llm_trainer":
        return len(FLOORS)
    top = module.split(".")[1]
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_no_import_runs_back_up_the_floors():
    graph = _import_graph(typing=True)
    unplaced = [m for m in graph if m != "llm_trainer" and m.split(".")[1] not in {n for f in FLOORS for n in f}]
    assert not unplaced, f"modules on no floor (add them to FLOORS and the README): {unplaced}"
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _floor(target) > _floor(module) and (module, target) not in SEAMS
    ]
    assert not upward, "imports that climb: " + ", ".join(sorted(upward))
    assert _floor("llm_trainer.train.trainer") > _floor("llm_trainer.pipeline") > _floor("llm_trainer.files.atomic")


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_only_the_launcher_module_reads_the_rank_from_the_environment():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name != "launcher.py":
            assert 'environ.get("RANK"' not in text and 'environ["RANK"]' not in text, path


# The modules beside files/ at the bottom, which it may import (none of them imports files/: the
# cycle test says so).
FILES_MAY_IMPORT = {"llm_trainer.errors", "llm_trainer.logs", "llm_trainer.limits"}


def test_files_imports_nothing_above_it():
    """files/ is the ground floor: any module may use it, so it uses nothing of ours but errors, logs and
    limits."""
    graph = _import_graph()
    for module, edges in graph.items():
        if module == "llm_trainer.files" or module.startswith("llm_trainer.files."):
            above = {e for e in edges if not e.startswith("llm_trainer.files") and e not in FILES_MAY_IMPORT}
            assert not above, f"{module} imports {sorted(above)}"


def _lines(path: Path, matches: Callable[[ast.AST], bool]) -> list[int]:
    """The lines of a file's syntax nodes that `matches`."""
    return sorted(node.lineno for node in ast.walk(ast.parse(path.read_text())) if matches(node))


def _offenders(matches: Callable[[ast.AST], bool], allowed: Callable[[str], bool]) -> dict[str, list[int]]:
    """The package's modules, but those `allowed` (by their path in it), with lines that `matches`."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        if not allowed(where) and (lines := _lines(path, matches)):
            found[where] = lines
    return found


def _renames(node: ast.AST) -> bool:
    """A rename of a file or folder: os.replace / os.rename, and a path's `.rename(x)` or `.replace(x)`
    (one argument: `str.replace` takes two, `dataclasses.replace` keywords)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    name, owner = node.func.attr, node.func.value
    if isinstance(owner, ast.Name) and owner.id == "os":
        return name in ("replace", "rename", "renames")
    return name == "rename" or (name == "replace" and len(node.args) == 1 and not node.keywords)


def test_only_files_renames_into_place():
    """A rename is how a file or folder is committed; `files.atomic` says how (fsync, a fresh temporary
    name, an exchange for folders), so every module commits through it."""
    offenders = _offenders(_renames, lambda where: where.startswith("files/"))
    assert not offenders, f"renames (module: lines) {offenders}: use files.atomic"


def test_the_rename_finder_finds_them(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os, dataclasses\nos.replace(a, b)\np.rename(q)\ntmp.replace(path)\n"
        "s.replace('a', 'b')\ndataclasses.replace(c, x=1)\nd.replace(microsecond=0)\n"
    )
    assert _lines(source, _renames) == [2, 3, 4]


# Where a path is told apart from a URL: a setting in config.py (its validation and properties:
# `remote_output_dir`, `resume_url`, ...), any other path in files/buckets.py (`Location`, which
# readers and writers are given). Every other module works on what they decided.
MAY_ASK_IS_URL = {"config.py", "files/buckets.py"}


def _asks_is_url(node: ast.AST) -> bool:
    """A call of `is_url` (`is_url(x)`, `buckets.is_url(x)`) or an import of it (under any name)."""
    if isinstance(node, ast.Call):
        func = node.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "is_url"
    return isinstance(node, ast.ImportFrom) and any(alias.name == "is_url" for alias in node.names)


def test_only_config_and_buckets_ask_whether_a_path_is_a_url():
    """A module that branches on "is this a URL" again decides it its own way; it takes the decision
    from the config (a setting) or from `files.buckets.Location` (any other path) instead."""
    offenders = _offenders(_asks_is_url, lambda where: where in MAY_ASK_IS_URL)
    assert not offenders, f"asks is_url (module: lines) {offenders}: use buckets.Location"


def test_the_is_url_finder_finds_them(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from x.buckets import is_url as u\nfrom x import buckets\nbuckets.is_url(a)\nis_url(b)\n"
        "self.is_url\nbuckets.Location(c).url\n"
    )
    assert _lines(source, _asks_is_url) == [1, 3, 4]
