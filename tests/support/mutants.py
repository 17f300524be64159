"""`make mutants`: a check that the test suite can fail.

Each fault below is one deliberate bug, applied as a plain text substitution to a copy of the source tree in a
temporary directory. Only the test files that should catch it run against that copy (pytest -x: the first failure
is enough). A fault is *caught* when those tests fail, *missed* when they pass. The script prints one line per
fault and exits 1 if any fault is missed; 2 if a fault's target text is no longer in the source exactly once
(the code moved on: update the fault, do not drop it), so a stale fault never passes silently.

    python tests/support/mutants.py              # every fault
    python tests/support/mutants.py --list       # their names
    python tests/support/mutants.py -k top-p     # the faults whose name contains "top-p"

Not collected by pytest (its name does not start with test_).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    path: str          # relative to the repository root
    old: str           # must occur exactly once in the file
    new: str
    tests: tuple       # test files (or node ids) that must catch it


FAULTS = [
    Fault("the sparse path never skips (every neuron predicted active)", "pjinfer/runtime/sparse.py",
          "        return self.predictor.active(x)\n",
          "        return jnp.ones((x.shape[0], self.hot_ids.shape[0] + self.cold_ids.shape[0]), bool)\n",
          ("tests/test_sparse.py",)),
    Fault("the host attention scale is off by one head dimension (1/sqrt(hd + 1))", "cpu_offload/attention.py",
          "np.float32(1.0 / np.sqrt(hd))", "np.float32(1.0 / np.sqrt(hd + 1))",
          ("tests/test_attention.py", "tests/test_host_decode.py")),
    Fault("the float-input Q4_1 GEMV reads each block's m from its d", "cpu_offload/q4.py",
          "m = half_splat(builder, builder.add(p, I64(2))) if kind", "m = half_splat(builder, p) if kind",
          ("tests/test_host_decode.py::test_q4_gemv_matches_numpy_on_its_rows_only",)),
    Fault("Q4_K/Q5_K's scales 4-7 take their top bits from the mins' word", "cpu_offload/q8_dot.py",
          "sc_hi = b.or_(mask(q2, 0x0F0F0F0F), top(q0))", "sc_hi = b.or_(mask(q2, 0x0F0F0F0F), top(q1))",
          ("tests/test_quants.py",)),
    Fault("the host prompt form puts every prompt token at the start position", "cpu_offload/batched_decode.py",
          "slots[t], poss[t], seqs[t] = t, start + t, 0", "slots[t], poss[t], seqs[t] = t, start, 0",
          ("tests/test_batched_decode.py",)),
    Fault("the placement ILP ignores the memory budget", "pjinfer/offline/policy.py",
          "<= budget_bytes // neuron_bytes", "<= 2**62",
          ("tests/test_policy.py",)),
    Fault("an imported PowerInfer predictor reads the FFN's input, not the residual stream",
          "pjinfer/runtime/sparse.py", "            return self.predictor.active(residual)\n",
          "            return self.predictor.active(x)\n", ("tests/test_powerinfer.py",)),
    Fault("an imported PowerInfer predictor keeps score > t where PowerInfer keeps score >= t",
          "pjinfer/load/powerinfer.py", "    cutoff = np.nextafter(np.float32(threshold), np.float32(-np.inf))\n",
          "    cutoff = np.float32(threshold)\n", ("tests/test_powerinfer.py",)),
    Fault("the sampler ignores top-p", "pjinfer/runtime/sampling.py",
          "cutoff = jnp.maximum(cutoff, jax.lax.cond(top_p < 1, lambda: _nucleus(keys, weights, top_p, cutoff),",
          "cutoff = jnp.maximum(cutoff, jax.lax.cond(top_p < 2, lambda: lowest,",
          ("tests/test_sampling.py",)),
    Fault("the Pallas threshold decode reads o's every input (its threshold ignored)", "pjinfer/runtime/gathered.py",
          "gathered_product(heads, self.wo_t[...], self.t_o, self.interpret)",
          "gathered_product(heads, self.wo_t[...], None, self.interpret)",
          ("tests/test_pallas_thresholds.py",)),
    Fault("the gather kernel skips the last partly filled block of active inputs", "pallas_kernels/gather.py",
          "lax.div(count + (block_k - 1), block_k)", "lax.div(count, block_k)",
          ("tests/test_pallas_kernels.py",)),
    Fault("SwiGLU's vector form leaves the last 16 neurons of each full pass to nobody", "cpu_offload/activation.py",
          "            i += 16\n", "            i += 32\n", ("tests/test_activation.py",)),
    Fault("SwiGLU's exp drops the low part of ln 2 in its range reduction", "cpu_offload/activation.py",
          "    r = call(\"fma\", n, const(-_LN2_LO), r)\n", "", ("tests/test_activation.py",)),
    Fault("the decoders' scratch comes from plain np.zeros (rows off cache lines)", "cpu_offload/qtensor.py",
          "    out = aligned_empty(shape, dtype)\n    out[...] = 0\n", "    out = np.zeros(shape, dtype)\n",
          ("tests/test_batched_decode.py::test_the_decoders_scratch_starts_on_cache_lines",)),
    Fault("SentencePiece joins the lowest-scoring pair first", "pjinfer/load/spm.py",
          "heapq.heappush(queue, (-self.scores[token], left, right, joined))",
          "heapq.heappush(queue, (self.scores[token], left, right, joined))", ("tests/test_tokenizer_vocab.py",)),
    Fault("SentencePiece decode keeps the leading space encode put there", "pjinfer/load/spm.py",
          "pieces[0] = pieces[0][1:]", "pass", ("tests/test_tokenizer_vocab.py",)),
    Fault("SentencePiece text after a special token gets no leading space", "pjinfer/load/tokenizer.py",
          "after_special, at = True, match.end()", "after_special, at = False, match.end()",
          ("tests/test_tokenizer_vocab.py",)),
    Fault("Llama-3's BPE merges words that are whole tokens", "pjinfer/load/tokenizer.py",
          "ignore_merges=pre in _WHOLE_WORDS_FIRST", "ignore_merges=False", ("tests/test_tokenizer_vocab.py",)),
    Fault("the layer split swaps every block for the host's, whatever K", "pjinfer/runtime/host.py",
          "HostBlock(b, decoder, i) if i >= first else b", "HostBlock(b, decoder, i) if i >= 0 else b",
          ("tests/test_layer_split.py",)),
    Fault("--offload-layers accepts one layer past the model", "pjinfer/runtime/backends.py",
          "not 0 <= k <= n:", "not 0 <= k <= n + 1:",
          ("tests/test_layer_split.py::test_bad_splits_are_refused_in_one_line_before_loading",)),
    Fault("the PowerInfer hybrid drops its cold neurons' sums", "pjinfer/runtime/powerinfer_hybrid.py",
          "y = y + jax.pure_callback(", "y = y + 0 * jax.pure_callback(", ("tests/test_powerinfer_hybrid.py",)),
    Fault("Q4_1x16 drops the m terms of a block's second group", "cpu_offload/q4_groups.py",
          "acc = b.call(fma, [m, _splat(b, b.add(g, I64(4)), F32), acc])", "acc = acc",
          ("tests/test_batched_decode.py",)),
    Fault("an idle team's workers never sleep longer than the first sleep", "cpu_offload/team.py",
          "min(SLEEP_MAX_US, SLEEP_US << min(rounds - YIELDS, 5))", "SLEEP_US",
          ("tests/test_host_decode.py::test_an_idle_team_costs_almost_no_cpu",)),
]

IGNORE = shutil.ignore_patterns(".git", ".venv", "out", ".pytest_cache", "*.egg-info", "build")


def check(fault: Fault, tree: Path) -> str:
    """The file's text; ValueError unless the fault's target occurs in it exactly once."""
    text = (tree / fault.path).read_text()
    count = text.count(fault.old)
    if count != 1:
        raise ValueError(f"{fault.path}: the target text of fault {fault.name!r} occurs {count} times "
                         f"(expected once): {fault.old!r}")
    return text


def apply(fault: Fault, tree: Path) -> None:
    """Substitute the fault's text in the copy at `tree`."""
    (tree / fault.path).write_text(check(fault, tree).replace(fault.old, fault.new))


def run(fault: Fault, workdir: Path) -> tuple[bool, str, float]:
    """(caught, last line of pytest's output, seconds) for one fault, in a fresh copy of the tree."""
    tree = workdir / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    # copy2 keeps modification times, so Numba's on-disk caches stay valid for every file but the mutated one.
    shutil.copytree(ROOT, tree, symlinks=True, ignore=IGNORE)
    if (ROOT / ".venv" / "share").is_dir():   # data `make setup` put there (llama.cpp's vocabulary test files)
        (tree / ".venv").mkdir()
        (tree / ".venv" / "share").symlink_to(ROOT / ".venv" / "share")
    apply(fault, tree)
    env = {**os.environ, "PYTHONPATH": str(tree), "NUMBA_THREADING_LAYER": os.environ.get("NUMBA_THREADING_LAYER",
                                                                                           "workqueue")}
    where = subprocess.run([sys.executable, "-c", "import pjinfer, cpu_offload; print(pjinfer.__file__); "
                            "print(cpu_offload.__file__)"], cwd=tree, env=env, capture_output=True, text=True)
    if where.returncode or any(not line.startswith(str(tree)) for line in where.stdout.split()):
        raise RuntimeError(f"the copy's packages are not the ones imported: {where.stdout} {where.stderr}")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *fault.tests],
                            cwd=tree, env=env, capture_output=True, text=True)
    lines = [l for l in result.stdout.splitlines() if l.strip()]
    summary = next((l for l in reversed(lines) if " passed" in l or " failed" in l or "error" in l),
                   lines[-1] if lines else result.stderr.strip()[-200:]).strip("= ")
    first = next((l.split(" - ")[0] for l in lines if l.startswith(("FAILED", "ERROR"))), None)
    return result.returncode != 0, summary + (f"; {first}" if first else ""), time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", help="only the faults whose name contains this text")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    faults = [f for f in FAULTS if not args.k or args.k in f.name]
    if args.list or not faults:
        for f in FAULTS:
            print(f"{f.name}  [{f.path}; {', '.join(f.tests)}]")
        return 0 if faults else 2
    for fault in faults:  # every target is checked before anything runs
        try:
            check(fault, ROOT)
        except ValueError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
    missed = []
    with tempfile.TemporaryDirectory(prefix="pjinfer-mutants-") as tmp:
        for fault in faults:
            caught, summary, seconds = run(fault, Path(tmp))
            print(f"{'caught' if caught else 'MISSED'}  {fault.name}  ({', '.join(fault.tests)}: {summary}; "
                  f"{seconds:.0f} s)", flush=True)
            if not caught:
                missed.append(fault.name)
    print(f"{len(faults) - len(missed)} of {len(faults)} faults caught" + (f"; missed: {', '.join(missed)}"
                                                                          if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
