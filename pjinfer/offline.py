"""The offline pipeline's stages as the command line runs them: profile, train predictors, solve.

Each stage reads what the previous ones stored in the bundle and adds its own, with its settings
and achieved figures in the manifest, and prints a per-layer table.
"""
from __future__ import annotations

import numpy as np

from pjinfer import loader
from pjinfer import profile as prof
from pjinfer.bundle import Bundle
from pjinfer.engine import Engine


def model_record(engine: Engine) -> dict:
    c = engine.config
    return {"source": engine.source, "identity": loader.model_identity(loader.Path(engine.source)),
            "name": c.name, "arch": c.arch, "activation": c.activation, "n_layers": c.n_layers, "d_ff": c.d_ff,
            "d_model": c.d_model}


def open_bundle(engine: Engine, path) -> Bundle:
    """The bundle at `path`, checked against the engine's model."""
    bundle = Bundle.open(path)
    bundle.check_model(model_record(engine)["identity"])
    return bundle


def table(header: list[str], rows: list[list], out=print) -> None:
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    out("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        out("  ".join(_fmt(v).rjust(w) for v, w in zip(r, widths)))


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, (float, np.floating)) else str(v)


def run_profile(engine: Engine, bundle_path, *, text_file=None, tokens: int, sparsity: float | None,
                train_tokens: int, progress=None, out=print) -> Bundle:
    bundle = Bundle.create(bundle_path, model=model_record(engine))
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
    record = bundle.require("profile")
    tree = bundle.load_stage("profile")
    return prof.ActivationStats(record["activation"], record["target_sparsity"], np.asarray(tree["thresholds"]),
                                np.asarray(tree["freq"]), np.asarray(tree["mass"]), record["tokens"])


def load_training_data(bundle: Bundle) -> prof.TrainingData:
    bundle.require("profile")
    d = bundle.path / "profile"
    try:
        inputs, labels = np.load(d / "train_inputs.npy", mmap_mode="r"), np.load(d / "train_labels.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise prof.ConfigError(f"bundle {bundle.path}: cannot read predictor training data ({e})") from None
    return prof.TrainingData(inputs, labels, bundle.manifest["model"]["d_ff"])
