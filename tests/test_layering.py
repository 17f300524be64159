"""The layers of the tree: the kernel and training packages import nothing from the app above them, neither modules
nor packages import each other in a cycle, and the activations and the error class have one home each, which every
layer shares."""
import ast
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from numba import njit

from cpu_offload import activation as activations
from cpu_offload import contract
from cpu_offload.activation import act
from cpu_offload.bridge import ColdFFN
from pjinfer.config import ACTIVATIONS as PER_ARCH
from pjinfer.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("cpu_offload", "pallas_kernels", "train")
# pjinfer's sub-packages; every module directly in pjinfer/ (config, progress, arguments) is a bottom-level module.
APP_PACKAGES = ("load", "runtime", "offline", "measure", "serve", "cli")


def imports(path: Path) -> set[str]:
    """Absolute module names `path` imports anywhere in it (inside functions too; relative imports resolved),
    except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = module_name(path).split(".")
    package = package if path.name == "__init__.py" else package[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a deferred import inside a function is still an arrow; a package's
    own __init__ is not counted as imported by its modules)."""
    modules = {module_name(p): p for p in sources("pjinfer", *LOWER)}

    def target(name: str) -> str | None:   # `from a.b import c`: the module a.b.c, or else a.b
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {t for i in imports(p) if (t := target(i)) and t != m and not m.startswith(t + ".")}
            for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its nodes in order, the first repeated at the end), or None."""
    done, stack = set(), []

    def visit(m):
        if m in stack:
            return stack[stack.index(m):] + [m]
        if m in done:
            return None
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if cycle := visit(n):
                return cycle
        stack.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        if cycle := visit(m):
            return cycle
    return None


def package_of(module: str) -> str:
    """pjinfer.runtime.engine -> pjinfer.runtime; pjinfer.config -> pjinfer.config (a bottom-level module is a node
    of its own); cpu_offload.bridge -> cpu_offload."""
    parts = module.split(".")
    if parts[0] == "pjinfer" and len(parts) > 1 and parts[1] in APP_PACKAGES:
        return ".".join(parts[:2])
    return module if parts[0] == "pjinfer" else parts[0]


def package_graph(top_level: bool) -> dict[str, set[str]]:
    """The module graph folded onto pjinfer's sub-packages and bottom-level modules, or onto the top-level packages."""
    fold = (lambda m: m.split(".")[0]) if top_level else package_of
    graph: dict[str, set[str]] = {}
    for m, targets in module_graph().items():
        for t in targets:
            if fold(m) != fold(t):
                graph.setdefault(fold(m), set()).add(fold(t))
    return graph


@pytest.mark.parametrize("package", LOWER)
def test_lower_layers_import_nothing_from_the_app(package):
    wrong = {}
    for path in sources(package):
        app = {m for m in imports(path) if m == "pjinfer" or m.startswith("pjinfer.")}
        if app:
            wrong[module_name(path)] = sorted(app)
    assert not wrong, f"lower layers importing from pjinfer: {wrong}"


def test_bottom_level_modules_import_no_other_pjinfer_module():
    bottom = [p for p in sorted((ROOT / "pjinfer").glob("*.py")) if p.name != "__init__.py"]
    assert {module_name(p) for p in bottom} >= {"pjinfer.config", "pjinfer.progress", "pjinfer.arguments"}
    wrong = {module_name(p): sorted(m for m in imports(p) if m.startswith("pjinfer"))
             for p in bottom if any(m.startswith("pjinfer") for m in imports(p))}
    assert not wrong, wrong


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("top_level", [False, True], ids=["pjinfer's packages", "top-level packages"])
def test_no_import_cycle_between_packages(top_level):
    graph = package_graph(top_level)
    assert graph, "no packages found"
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert package_of("pjinfer.runtime.engine") == "pjinfer.runtime" and package_of("pjinfer.config") == "pjinfer.config"
    assert {"cpu_offload._numba", "cpu_offload.activation.act"} <= imports(ROOT / "cpu_offload/kernels.py")


def test_modules_and_functions_stay_small():
    """No module over 500 lines and no function over 80, so each reads top to bottom."""
    big = []
    for path in sources("pjinfer", *LOWER, "tests"):
        text = path.read_text()
        if text.count("\n") > 500:
            big.append(f"{module_name(path)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                big.append(f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big


def test_every_form_of_each_activation_agrees():
    """JAX (model, Pallas), Numba (host kernels) and the numpy reference, on fresh random inputs."""
    assert {a for names in PER_ARCH.values() for a in names} <= set(activations.ACTIVATIONS)
    numba_act = njit(lambda g, u, code: np.array([act(g[i], u[i], code) for i in range(g.size)], np.float32))
    rng = np.random.default_rng(3)
    g, u = (rng.standard_normal(1001).astype(np.float32) * 4 for _ in range(2))
    for name, a in activations.ACTIVATIONS.items():
        want = activations.reference(name, g if a.gated else None, u)
        got_jax = np.asarray(activations.activate(name, jnp.asarray(g) if a.gated else None, jnp.asarray(u)))
        np.testing.assert_allclose(got_jax, want, rtol=2e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(numba_act(g, u, a.code), want, rtol=2e-5, atol=1e-5, err_msg=name)
        if a.exact_zero:
            assert (want[u < 0] == 0).all() if name == "relu" else (want[g < 0] == 0).all()
    with pytest.raises(ConfigError, match="unknown activation 'gelu'"):
        activations.get("gelu")


def test_host_kernels_refuse_with_the_projects_error():
    """cpu_offload refuses bad input with cpu_offload.contract.ConfigError (a ValueError), the very class the app
    raises and catches as pjinfer.config.ConfigError, so every caller reports it in one line the same way; a plain
    ValueError raised there would be the odd one out."""
    assert ConfigError is contract.ConfigError and issubclass(ConfigError, ValueError)
    plain = [module_name(p) for p in sources("cpu_offload") if "raise ValueError(" in p.read_text()]
    assert not plain, plain
    with pytest.raises(ConfigError, match="one w_up and one w_down_t per layer"):
        ColdFFN.from_dense([], [], [])


def test_a_changed_kernel_purges_the_cache_of_every_module_compiled_with_it(tmp_path, monkeypatch):
    """purge_stale_cache follows dependencies through the modules that named theirs: c names b, b names a; a change
    to a drops c's cached functions, and so does a change to _numba (the JIT options every kernel is compiled with);
    an unchanged tree keeps them."""
    import types

    from cpu_offload import ffi

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(type(ffi.lock._cache), "cache_path", property(lambda self: str(cache)))
    monkeypatch.setattr(ffi, "_DEPENDS", {})
    modules = {}
    for n in ("a", "b", "_numba"):
        (tmp_path / f"{n}.py").write_text("x = 1\n")
        modules[n] = types.ModuleType(f"cpu_offload.fake_{n}")
        modules[n].__file__ = str(tmp_path / f"{n}.py")
    monkeypatch.setattr(ffi, "_numba", modules["_numba"])
    entry = cache / "fake_c.f-1.py311.nbi"

    def purge():
        ffi.purge_stale_cache("fake_b", modules["a"])
        entry.write_bytes(b"")
        ffi.purge_stale_cache("fake_c", modules["b"])
        return entry.exists()

    assert not purge()                       # no stamp yet: purged
    assert purge()                           # nothing changed: kept
    (tmp_path / "a.py").write_text("x = 2\n")
    assert not purge()                       # a changed: c, compiled with b and so with a, purged
    assert purge()
    (tmp_path / "_numba.py").write_text("x = 2\n")
    assert not purge()                       # the JIT options' file changed: purged
    assert purge()
