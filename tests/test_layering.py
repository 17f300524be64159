"""The layers of the tree: kernel and training packages never import the app above them, and pjinfer's modules
import each other without a cycle at import time. The activations have one home that every layer shares."""
import ast
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("cpu_offload", "pallas_kernels", "train")
# Bottom-level pjinfer modules (they import no other pjinfer module): the lower layers may use these.
SHARED = {"pjinfer.config"}


def imports(path: Path) -> set[str]:
    """Absolute module names `path` imports anywhere in it (inside functions too), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", LOWER)
def test_lower_layers_import_no_app_module(package):
    wrong = {}
    for path in sources(package):
        app = {m for m in imports(path) if m.startswith("pjinfer")
               and m not in SHARED and not any(m.startswith(s + ".") for s in SHARED) and m != "pjinfer"}
        if app:
            wrong[module_name(path)] = sorted(app)
    assert not wrong, f"lower layers importing pjinfer's app modules: {wrong}"


def test_shared_modules_are_bottom_level():
    for name in SHARED:
        path = ROOT / (name.replace(".", "/") + ".py")
        inner = {m for m in imports(path) if m.startswith("pjinfer")}
        assert inner <= {"pjinfer.config", "pjinfer.config.ConfigError"} - {name}, (name, inner)


def test_no_import_cycle():
    """Between modules, counting imports inside functions too: a deferred import is still an arrow."""
    modules = {module_name(p): p for p in sources("pjinfer", *LOWER)}

    def target(name: str) -> str | None:   # `from a.b import c`: the module a.b.c, or else a.b
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {t for i in imports(p) if (t := target(i)) and t != m and not m.startswith(t + ".")}
             for m, p in modules.items()}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


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
    import jax.numpy as jnp
    from numba import njit

    from cpu_offload import activation as activations
    from cpu_offload.activation import act
    from pjinfer.config import ACTIVATIONS as PER_ARCH

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
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        activations.get("gelu")


def test_host_kernels_refuse_with_the_projects_error():
    """cpu_offload refuses bad input with config.ConfigError (a ValueError), so every caller reports it in one
    line the same way; a plain ValueError raised there would be the odd one out."""
    from cpu_offload.bridge import ColdFFN
    from pjinfer.config import ConfigError

    plain = [module_name(p) for p in sources("cpu_offload") if "raise ValueError(" in p.read_text()]
    assert not plain, plain
    with pytest.raises(ConfigError, match="one w_up and one w_down_t per layer"):
        ColdFFN.from_dense([], [], [])
