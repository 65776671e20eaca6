"""Within the packages: data/'s text/, format, batches/ and prepare/ import only downwards (lazy and
TYPE_CHECKING imports included, so there is no cycle of any kind); no module of the package uses
another's private names; each package's docstring names every module it holds. (Between the packages:
test_layout.py.)"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llm_trainer"
DATA = "llm_trainer.data"

# What each part of data/ may import of data/ (itself included): text/ and format stand alone,
# batches/ reads the format, prepare/ uses all of them (batches/: a store's streamed tokens).
MAY_IMPORT = {
    f"{DATA}.text": (f"{DATA}.text",),
    f"{DATA}.format": (),
    f"{DATA}.batches": (f"{DATA}.batches", f"{DATA}.format"),
    f"{DATA}.prepare": (f"{DATA}.prepare.", f"{DATA}.text", f"{DATA}.batches", f"{DATA}.format"),
}
# The layers above data/: what is built on it, never imported by it.
ABOVE = ("pipeline", "api", "cli", "__main__", "train", "tools", "parallel", "downstream", "hf", "checkpoint")
# Imports of a layer above that another change decides about: data.text.sources asks hf.hub whether the
# Hugging Face Hub is reachable (offline mode), and data.batches.stream checksums chunks as checkpoints do.
KNOWN_UPWARD = {"llm_trainer.hf.hub"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(module: str) -> list[tuple[str, str | None, ast.AST]]:
    """(imported module, imported name or None, node) for every import of a module, at any depth and
    under TYPE_CHECKING too; `from package import submodule` names the submodule."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.append((full, None, node) if full in MODULES else (source, alias.name, node))
    return found


def _part(module: str) -> str:
    """The part of data/ a module belongs to (the MAY_IMPORT key), or the module itself."""
    return next((part for part in MAY_IMPORT if module == part or module.startswith(part + ".")), module)


def test_data_imports_only_downwards():
    wrong = []
    for module in MODULES:
        if not module.startswith(DATA + "."):
            continue
        for target, _, node in _imports(module):
            if target.startswith(DATA + ".") or target == DATA:
                if not target.startswith(MAY_IMPORT[_part(module)]):
                    wrong.append(f"{module}:{node.lineno} imports {target}")
            elif target.startswith("llm_trainer.") and target.split(".")[1] in ABOVE and target not in KNOWN_UPWARD:
                wrong.append(f"{module}:{node.lineno} imports {target}, a layer above data/")
    assert not wrong, "\n".join(wrong)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _in(module: str, scope: str) -> bool:
    return module == scope or module.startswith(scope + ".")


def private_names_across_modules(scope: str) -> list[str]:
    """Every use of a module's private name (`_name`) by another module of the package, where either
    module is in `scope`: `from module import _name`, and `module._name` on a module imported by name."""
    found = []
    for module in MODULES:
        bound = {}  # local name -> the module of ours it names
        for target, name, node in _imports(module):
            if name is None and target in MODULES:
                alias = next(a for a in node.names if target.endswith("." + a.name) or target == a.name)
                if alias.asname or isinstance(node, ast.ImportFrom):
                    bound[alias.asname or alias.name] = target
            elif name is not None and _private(name) and target in MODULES and target != module:
                if _in(module, scope) or _in(target, scope):
                    found.append(f"{module}:{node.lineno} imports {target}.{name}")
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                target = bound.get(node.value.id)
                if target and target != module and (_in(module, scope) or _in(target, scope)):
                    found.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is one module's own: another module that needs it gets a public name."""
    found = private_names_across_modules("llm_trainer")
    assert not found, "\n".join(found)


def test_each_package_docstring_names_its_modules():
    for folder in sorted(path.parent for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE):
        package = folder.relative_to(PACKAGE).as_posix()
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        named = {  # a module line: its names (one or more, `x.py` or `x/`), then two spaces and what they are
            name.removesuffix(".py").rstrip("/")
            for line in docstring.splitlines()
            if "  " in line.strip()
            for name in line.strip().split("  ")[0].split()
        }
        held = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
            p.name for p in folder.iterdir() if (p / "__init__.py").is_file()
        }
        assert held <= named, (package, held - named)
