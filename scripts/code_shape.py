"""Prints the shape figures the "One readable step" issue tracks: files over 700 lines, function
bodies over 80 lines (docstring excluded) in earlywarn/ and integrations/, and the distinct
attributes the Watcher assigns.

    python scripts/code_shape.py [repo root]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def body_length(node: ast.AST) -> int:
    body = node.body
    start = body[0].lineno
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) \
            and len(body) > 1:
        start = body[1].lineno  # the docstring is not code
    return node.end_lineno - start + 1


def watcher_attributes(path: Path) -> set[str]:
    cls = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == "Watcher")
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def main(root: Path) -> None:
    big, long = [], []
    for d in ("earlywarn", "integrations"):
        for p in sorted((root / d).rglob("*.py")):
            if p.is_symlink() or any(part.is_symlink() for part in p.relative_to(root).parents if part != Path(".")):
                continue
            src = p.read_text()
            rel = p.relative_to(root)
            if src.count("\n") > 700:
                big.append((src.count("\n"), str(rel)))
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_length(node) > 80:
                    long.append((body_length(node), f"{rel}:{node.lineno} {node.name}"))
    print(f"files over 700 lines: {len(big)}")
    for n, f in sorted(big, reverse=True):
        print(f"  {n:5d}  {f}")
    print(f"function bodies over 80 lines: {len(long)}")
    for n, f in sorted(long, reverse=True):
        print(f"  {n:5d}  {f}")
    attrs = watcher_attributes(root / "earlywarn/guard/watcher.py")
    print(f"Watcher attributes assigned: {len(attrs)} ({', '.join(sorted(attrs))})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
