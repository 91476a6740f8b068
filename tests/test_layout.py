"""The package's folders stand in layers (docs/layout.md): a part imports only the parts below it, and no import,
at the top of a module or inside a function, closes a circle. Old import paths still reach the same modules."""
from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LIBRARY = {"topology", "plan", "comm", "runtime", "cost", "checkpoint"}
# part -> the parts it may import (besides itself); docs/layout.md shows the same table.
MAY_IMPORT = {
    "topology": set(),
    "plan": {"topology"},
    "comm": {"topology"},
    "runtime": {"topology", "plan", "comm"},
    "cost": {"topology", "plan", "comm", "runtime"},
    "checkpoint": {"topology", "plan", "comm", "runtime"},
    "facade": LIBRARY,
    "cluster": set(),
    "train": LIBRARY | {"facade"},
    "bench": LIBRARY | {"facade", "train", "cluster"},
    "cli": LIBRARY | {"facade", "train", "bench", "cluster"},
    "hf": LIBRARY | {"facade"},
    "lightning": LIBRARY | {"facade"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "tiershard").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "_moved":
        return "facade"
    return parts[1]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every tiershard module ``module`` imports anywhere in its body (lazily, or only for type checking, too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known and n != module)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {m: imports(m, p, set(found)) for m, p in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_circle_and_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph()
    assert "tiershard.runtime.api" in edges["tiershard"]         # ts.shard, imported inside a function
    assert "tiershard.runtime.api" in edges["tiershard.checkpoint.sharded"]   # likewise
    assert "tiershard.plan" in edges["tiershard.cost.traffic"]                 # only for type checking


def test_no_import_circles():
    assert cycles(graph()) == []


def test_every_part_imports_only_the_parts_below_it():
    edges = graph()
    assert set(map(part, edges)) == set(MAY_IMPORT), "a new folder needs its row in MAY_IMPORT and docs/layout.md"
    wrong = sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                   if part(t) != part(m) and part(t) not in MAY_IMPORT[part(m)])
    assert wrong == []


def test_old_import_paths_reach_the_same_modules():
    """[Note: moved names]: each old path imports as the module at its new path, warning with the new path and
    the release that removes it, and the changelog lists it with that release."""
    from tiershard._moved import MOVED, REMOVED_IN

    changelog = (SRC.parent / "docs" / "changelog.md").read_text()
    for old, new in MOVED.items():
        assert f"| `{old}` | `{new}` | {REMOVED_IN} |" in changelog, f"docs/changelog.md must list {old}"
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                module = importlib.import_module(old)
            except ImportError as err:          # the Triton kernels need triton, at either path
                assert new.endswith("triton_kernels") and err.name == "triton", (old, err)
                continue
        assert module is importlib.import_module(new) and sys.modules[old] is module
        assert module.__spec__.name == new
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
            f"{old} moved to {new}: import it from there ({old} is removed in tiershard {REMOVED_IN})"]
    from tiershard.local import run_local
    from tiershard.models import GPT
    from tiershard.cost.clusters import preset
    from tiershard.cluster.local import run_local as new_run_local
    from tiershard.train.models import GPT as new_gpt
    from tiershard.cost.presets import preset as new_preset

    assert run_local is new_run_local and GPT is new_gpt and preset is new_preset


def test_documented_imports_use_the_current_paths():
    """Every tiershard import in a Python example of README.md and docs/ imports without a moved-path warning."""
    lines = set()
    for path in [SRC.parent / "README.md", *sorted((SRC.parent / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            lines |= {line.strip() for line in block.splitlines()
                      if re.match(r"(import|from) ", line.strip()) and "tiershard" in line}
    assert "from tiershard.cost import Job, ModelSpec, presets, rank_plans" in lines    # docs/cost-model.md
    for line in sorted(lines):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(line, {})
        assert not [w for w in caught if "moved to" in str(w.message)], line


def test_kernels_source_is_package_data():
    pyproject = (SRC.parent / "pyproject.toml").read_text()
    assert '"comm/codecs/*.c"' in pyproject
    from tiershard.comm.codecs import native

    assert "encode" in (Path(native.__file__).parent / "kernels.c").read_text()


def test_public_names():
    import tiershard as ts

    for name in ts.__all__:
        assert getattr(ts, name) is not None
    # Plan.auto is an ordinary method of Plan, and the cost model's auto_plan is what it runs
    from tiershard import cost, plan

    assert ts.Plan.auto.__module__ == "tiershard.plan" and "auto" in vars(ts.Plan)
    assert plan._planner() is cost.auto_plan


def test_the_emulated_cluster_split_keeps_its_names():
    """cluster/emulated.py was split by concern (docs/layout.md); every name it had still imports from it, as the
    same object as in the module that now holds it, and each module of cluster/ fits in one read."""
    from tiershard.cluster import check, counters, emulated, launch, netns

    homes = {netns: ("ClusterError", "parse_rate", "format_rate", "tbf_args", "tbf_burst", "check_name", "PREFIX",
                     "IFNAME", "NODE_NETNS_ENV", "STATE_DIR", "check_tiers", "up_commands", "shape_commands",
                     "require_root_and_tools", "namespaces_unavailable", "list_namespaces", "list_clusters"),
             launch: ("LaunchError", "RankResult", "rank_env"),
             counters: ("read_node_uplink", "ring_allreduce_tier_bytes", "ring_allreduce_nic_bytes"),
             check: ("allreduce_job", "summarize_allreduce")}
    for module, names in homes.items():
        for name in names:
            assert getattr(emulated, name) is getattr(module, name), name
    assert emulated._main is check.main
    for path in (SRC / "tiershard" / "cluster").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 450, f"{path.name} no longer fits in one read: split it"
