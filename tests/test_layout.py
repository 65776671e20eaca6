"""The package layout the README promises: the loop knows no backend, train/ never uses tools/,
model.py is only the architecture."""

import ast
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
    imports = _imports(PACKAGE / "model.py")
    ours = {name for name in imports if name.startswith("llm_trainer")}
    # config for its shape; the model folder (save_pretrained/from_pretrained) only lazily, inside methods
    assert ours <= {
        "llm_trainer.config",
        "llm_trainer.config.ModelConfig",
        "llm_trainer.checkpoint.model_folder",
        "llm_trainer.checkpoint.model_folder.save_model_folder",
        "llm_trainer.checkpoint.model_folder.load_model_folder",
    }, ours
    assert not any(name.startswith(("torch.distributed", "deepspeed")) for name in imports)


def test_only_the_launcher_module_reads_the_rank_from_the_environment():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name != "launcher.py":
            assert 'environ.get("RANK"' not in text and 'environ["RANK"]' not in text, path
