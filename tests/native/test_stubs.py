"""python/lowwater/_native.pyi describes the extension as it is: same classes,
same public methods and properties, same module-level names."""

import ast
from pathlib import Path

import lowwater
from lowwater import _native

STUB = Path(lowwater.__file__).with_name("_native.pyi")


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                n.name
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("__")
            }
            out[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[""].add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            out[""].add(node.name)  # module functions (error_body, error_event)
    return out


def test_stub_matches_module():
    stub = _stub_names()
    runtime = {n for n in dir(_native) if not n.startswith("_")}
    assert stub[""] == runtime
    for cls, methods in stub.items():
        if not cls:
            continue
        public = {n for n in dir(getattr(_native, cls)) if not n.startswith("_")}
        public -= set(dir(Exception))  # inherited by the exception classes
        assert methods == public, cls


def test_public_api_reexports_the_extension():
    for name in lowwater.__all__:
        assert getattr(lowwater, name) is getattr(_native, name)
