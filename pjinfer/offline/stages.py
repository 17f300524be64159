"""The offline pipeline's stages as the command line runs them: calibrate, profile, train predictors, solve.

Each stage reads what the previous ones stored in the bundle and adds its own, with its settings
and achieved figures in the manifest, and prints a per-layer table.
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from cpu_offload.activation import EXACT_ZERO
from pjinfer.config import THRESHOLD_INPUTS, ConfigError
from pjinfer.load.bundle import THRESHOLDS, Bundle, model_record
from pjinfer.offline import profile as prof
from pjinfer.offline import policy, teal
from pjinfer.runtime.engine import Engine
from pjinfer.runtime.model import KVCache
from train.predictor import fit_layer, n_params


def table(header: list[str], rows: list[list], out=print) -> None:
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    out("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        out("  ".join(_fmt(v).rjust(w) for v, w in zip(r, widths)))


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, (float, np.floating)) else str(v)


def run_profile(engine: Engine, bundle_path, *, text_file=None, tokens: int, sparsity: float | None,
                train_tokens: int, progress=None, out=print) -> Bundle:
    bundle = Bundle.create(bundle_path, model=model_record(engine.config, engine.source))
    ids = prof.calibration_ids(engine, text_file)
    stats, training = prof.profile(engine, ids, tokens=tokens, sparsity=sparsity, train_tokens=train_tokens,
                                   progress=progress)
    locality = stats.locality()
    sparsity_per_layer = stats.sparsity()
    tree = {"thresholds": stats.thresholds, "freq": stats.freq, "mass": stats.mass}
    record = {"text": str(text_file or "exllamav2 calibration set (wiki's evaluation slice left out)"),
              "tokens": stats.tokens, "target_sparsity": stats.target_sparsity, "activation": stats.activation,
              "train_tokens": int(training.inputs.shape[1]),
              "sparsity_mean": float(sparsity_per_layer.mean()), "locality80_mean": float(locality.mean()),
              "sparsity": sparsity_per_layer, "locality80": locality}
    bundle.save_stage("profile", tree, record, extra_files={
        "train_inputs.npy": lambda p: np.save(p, training.inputs),
        "train_labels.npy": lambda p: np.save(p, training.labels),
        "locality.png": lambda p: prof.plot(stats, p)})
    out(f"profiled {stats.tokens} tokens; sparsity {record['sparsity_mean']:.3f}, "
        f"{100 * record['locality80_mean']:.1f}% of neurons make 80% of activations (mean over layers)")
    table(["layer", "threshold", "sparsity", "locality80"],
          [[l, float(stats.thresholds[l]), float(sparsity_per_layer[l]), float(locality[l])]
           for l in range(len(locality))], out)
    out(f"wrote {bundle.path / 'profile'} and {bundle.path / 'profile' / 'locality.png'}")
    return bundle


def load_stats(bundle: Bundle) -> prof.ActivationStats:
    """The profile stage's statistics: thresholds [L], freq and mass [L, F], refused in one line when a key is
    missing or the shapes do not agree."""
    record = bundle.require("profile", "activation", "target_sparsity", "tokens")
    tree = bundle.load_stage("profile")
    try:
        thresholds, freq, mass = (np.asarray(tree[key]) for key in ("thresholds", "freq", "mass"))
    except KeyError as e:
        raise ConfigError(f"bundle {bundle.path}: the profile stage has no {e}") from None
    numbers = all(np.issubdtype(a.dtype, np.number) for a in (thresholds, freq, mass))
    if not numbers or freq.ndim != 2 or mass.shape != freq.shape or thresholds.shape != freq.shape[:1]:
        raise ConfigError(f"bundle {bundle.path}: the profile's thresholds {list(thresholds.shape)}, freq "
                          f"{list(freq.shape)} and mass {list(mass.shape)} do not agree")
    return prof.ActivationStats(record["activation"], record["target_sparsity"], thresholds, freq, mass,
                                record["tokens"])


def load_training_data(bundle: Bundle) -> prof.TrainingData:
    bundle.require("profile")
    d = bundle.path / "profile"
    try:
        inputs, labels = np.load(d / "train_inputs.npy", mmap_mode="r"), np.load(d / "train_labels.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"bundle {bundle.path}: cannot read predictor training data ({e})") from None
    return prof.TrainingData(inputs, labels, bundle.manifest["model"]["d_ff"])


def dense_bytes(engine: Engine, *, predictor_bytes: int, kv_tokens: int) -> dict:
    """What must sit on the accelerator before any FFN neuron: every weight that is not an FFN
    neuron row (attention, embeddings, head, norms, biases), the predictors, and a KV cache."""
    c = engine.config
    total = 4 * c.n_params
    neurons = c.n_layers * c.d_ff * neuron_bytes(engine)
    kv = KVCache.nbytes(c, kv_tokens)
    return {"weights": total - neurons, "predictors": predictor_bytes, "kv_cache": kv,
            "total": total - neurons + predictor_bytes + kv}


def neuron_bytes(engine: Engine) -> int:
    """One neuron: its gate (gated FFNs), up and down rows, plus its up bias (OPT), in float32."""
    c = engine.config
    rows = 3 if c.gated else 2
    return 4 * (rows * c.d_model + (0 if c.gated else 1))


def run_solve(engine: Engine, bundle_path, *, device_memory: int, kv_tokens: int, batch: int, hardware,
              out=print) -> Bundle:
    bundle = Bundle.open(bundle_path, source=engine.source)
    stats = load_stats(bundle)
    pred = bundle.require("predictors", "bytes", "layers")
    dense = dense_bytes(engine, predictor_bytes=pred["bytes"], kv_tokens=kv_tokens)
    budget = policy.neuron_budget(device_memory, dense["total"])
    nb = neuron_bytes(engine)
    ilp = policy.solve(stats.freq, nb, budget, batch=batch, hardware=hardware)
    topk = policy.topk_baseline(stats.freq, nb, budget)
    counts, topk_counts = ilp.per_layer_counts(), topk.per_layer_counts()
    ffn_total = stats.freq.size * nb
    record = {"device_memory": device_memory, "kv_tokens": kv_tokens, "dense_bytes": dense, "budget_bytes": budget,
              "neuron_bytes": nb, "batch": batch, "hardware": dict(vars(hardware)), "status": ilp.status,
              "solve_seconds": ilp.solve_seconds, "bytes_used": ilp.bytes_used,
              "ffn_share_on_device": ilp.bytes_used / ffn_total,
              "objective": ilp.objective, "coverage": ilp.coverage,
              "topk_objective": topk.objective, "topk_coverage": topk.coverage,
              "hot_per_layer": counts}
    bundle.save_stage("placement", {"hot": ilp.hot}, record)
    # The bundle's whole story per layer: profile, predictor, placement.
    prof_rec, layers = bundle.require("profile", "sparsity", "locality80"), pred["layers"]
    table(["layer", "sparsity", "locality80", "rank", "recall", "precision", "pred. sparsity", "hot (ilp)",
           "hot (top-k)", "mass on device"],
          [[l, float(prof_rec["sparsity"][l]), float(prof_rec["locality80"][l]), layers[l]["rank"],
            layers[l]["recall"], layers[l]["precision"], layers[l]["predicted_sparsity"], int(counts[l]),
            int(topk_counts[l]), float(stats.freq[l][ilp.hot[l]].sum() / max(stats.freq[l].sum(), 1e-12))]
           for l in range(len(counts))], out)
    gib = lambda b: f"{b / 2**20:.1f} MiB"
    out(f"device memory {gib(device_memory)}: dense part {gib(dense['total'])} (weights {gib(dense['weights'])}, "
        f"predictors {gib(dense['predictors'])}, KV cache {kv_tokens} tokens {gib(dense['kv_cache'])}); "
        f"neuron budget {gib(budget)}, used {gib(ilp.bytes_used)} = {100 * record['ffn_share_on_device']:.1f}% of the FFN")
    out(f"ILP ({ilp.status}, {ilp.solve_seconds:.2f} s): accelerator serves {100 * ilp.coverage:.1f}% of activations; "
        f"per-layer top-k with the same budget: {100 * topk.coverage:.1f}%")
    return bundle


def run_train(engine: Engine, bundle_path, *, recall: float, max_rank: int, epochs: int, progress=None,
              out=print) -> Bundle:
    if not 0 < recall < 1:
        raise ConfigError(f"--recall must be in (0, 1), got {recall}")
    bundle = Bundle.open(bundle_path, source=engine.source)
    training = load_training_data(bundle)
    c = engine.config
    states, layers = {}, []
    if progress:
        progress(0, c.n_layers)
    for l in range(c.n_layers):
        x, y = training.layer(l)
        predictor, m = fit_layer(x, y, recall_target=recall, max_rank=max_rank, epochs=epochs)
        states[str(l)] = nnx.to_pure_dict(nnx.state(predictor))
        layers.append({k: m[k] for k in ("rank", "recall", "precision", "predicted_sparsity", "true_sparsity",
                                         "capped", "seconds")} | {"params": n_params(predictor)})
        if progress:
            progress(l + 1, c.n_layers)
    params = sum(m["params"] for m in layers)
    record = {"recall_target": recall, "max_rank": max_rank, "epochs": epochs, "layers": layers,
              "ranks": [m["rank"] for m in layers], "params": params, "bytes": 4 * params + 4 * c.n_layers,
              "size_vs_model": params / c.n_params,
              "recall_min": min(m["recall"] for m in layers),
              "predicted_sparsity_mean": float(np.mean([m["predicted_sparsity"] for m in layers]))}
    bundle.save_stage("predictors", states, record)
    table(["layer", "rank", "recall", "precision", "pred. sparsity", "true sparsity", "seconds"],
          [[l, m["rank"] if not m["capped"] else f"{m['rank']}*", m["recall"], m["precision"],
            m["predicted_sparsity"], m["true_sparsity"], round(m["seconds"], 1)] for l, m in enumerate(layers)], out)
    out(f"predictors: {params / 1e6:.2f} M parameters = {100 * record['size_vs_model']:.1f}% of the model; "
        f"held-back recall >= {record['recall_min']:.3f} in every layer; predicted sparsity "
        f"{record['predicted_sparsity_mean']:.3f} on average (* = rank capped at {max_rank})")
    return bundle


def run_calibrate(engine, bundle_path, *, target: float, text_file=None, progress=None, out=print):
    """The `pjinfer calibrate` stage: fit, allocate, store in the bundle, print a per-layer table."""
    if not 0.0 <= target <= teal.MAX_TARGET:
        raise ConfigError(f"--target must be in [0, {teal.MAX_TARGET}], got {target}")
    bundle = Bundle.create(bundle_path, model=model_record(engine.config, engine.source))
    relu = engine.config.activation in EXACT_ZERO
    fitted = teal.calibrate(engine, prof.calibration_ids(engine, text_file), target=target, relu_family=relu,
                            progress=progress)
    save_calibration(bundle, engine, fitted, target=target, text_file=text_file, out=out)
    return bundle


def save_calibration(bundle, engine, fitted: dict, *, target: float, text_file=None, out=print) -> None:
    """Store a calibration (teal.calibrate's result) as the bundle's thresholds stage."""
    levels, shares = fitted["levels"], teal.weight_shares(engine.config)
    per_tensor = levels.mean(0)
    achieved = float((levels * shares).sum() / (shares.sum() * levels.shape[0]))
    record = {"text": str(text_file or "exllamav2 calibration set (wiki's evaluation slice left out)"),
              "target": target, "achieved_weighted": achieved,
              "achieved_per_tensor": dict(zip(THRESHOLD_INPUTS, map(float, per_tensor))),
              "levels": levels, "fit_tokens": fitted["fit_tokens"], "held_tokens": fitted["held_tokens"],
              "calibration_loss_dense": fitted["loss_dense"], "calibration_loss": fitted["loss"],
              "seconds": round(fitted["seconds"], 1)}
    bundle.save_stage(THRESHOLDS, {"thresholds": fitted["thresholds"]}, record)
    out(f"calibrated on {fitted['fit_tokens']} + {fitted['held_tokens']} held-back tokens in "
        f"{fitted['seconds']:.0f} s: weight-weighted sparsity {achieved:.3f} (target {target}); held-back loss "
        f"{fitted['loss']:.4f} (dense {fitted['loss_dense']:.4f})")
    table(["layer", *[f"{t} level" for t in THRESHOLD_INPUTS], *THRESHOLD_INPUTS],
          [[l, *map(float, levels[l]), *map(float, fitted["thresholds"][l])] for l in range(len(levels))], out)
    out(f"wrote {bundle.path / THRESHOLDS}")
