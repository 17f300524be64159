"""`pjinfer import-powerinfer`: a PowerInfer GGUF's own predictors, and its neuron placement when it has one, as a
bundle's predictors and placement stages, so the sparse engine (pjinfer.runtime.sparse) runs the file the way
PowerInfer would pick its neurons.

PowerInfer's predictor is fc2 relu(fc1 h) >= t on the residual stream h (pjinfer.load.powerinfer); it is stored as
a train.predictor.Predictor that reads the residual: down = fc1^T, up = fc2^T with a zero bias, and the cutoff the
float32 number just below t (the normal one below zero when t is 0: XLA on the CPU flushes subnormals to zero), so
that its `logits > cutoff` is `score >= t` for every float32 score.
"""
from __future__ import annotations

from pathlib import Path


from pjinfer.config import ConfigError
from pjinfer.load import powerinfer
from pjinfer.load.bundle import Bundle, model_record
from pjinfer.load.loader import gguf_header
from pjinfer.offline.stages import table


def read(model: Path, gpu_index=None):
    """Everything the import writes, read and checked first: (config, Predictors, placement or None, where the
    placement came from). The placement is the GPU index's (the one given, else PowerInfer's cache
    MODEL.generated.gpuidx beside the file), else the model file's own gpu_idx tensors."""
    reader, config = gguf_header(model)
    predictors = powerinfer.read_predictors(reader, config, model)
    if config.activation not in ("reglu", "drelu"):
        raise ConfigError(f"{model.name} is a {reader.fields.get('general.architecture')} model ({config.activation}): "
                          "PowerInfer's predictors go with its ReLU-family llama and bamboo files")
    index = powerinfer.gpu_index_path(model, gpu_index)
    if index is not None:
        return config, predictors, powerinfer.read_gpu_index(index, config), index
    hot = powerinfer.read_placement(reader, config, model)
    return config, predictors, hot, None if hot is None else model


def run_import(model, bundle_path, *, gpu_index=None, out=print) -> Bundle:
    """Check the file (and GPU index) completely, then write the bundle's predictors stage and, when there is a
    placement, its placement stage; print a per-layer table."""
    model = Path(model)
    config, predictors, hot, hot_from = read(model, gpu_index)
    bundle = Bundle.create(bundle_path, model=model_record(config, model))
    params = [int(a.size + b.size + b.shape[0]) for a, b in zip(predictors.fc1, predictors.fc2)]  # with up's bias
    layers = [{"rank": r, "params": p, "recall": None, "precision": None, "predicted_sparsity": None}
              for r, p in zip(predictors.ranks, params)]
    record = {"source": f"PowerInfer predictors in {model.name}", "reads": "residual",
              "sparse_threshold": predictors.threshold, "ranks": predictors.ranks, "layers": layers,
              "params": sum(params), "bytes": 4 * sum(params) + 4 * config.n_layers, "size_vs_model": sum(params) / config.n_params}
    states = {str(l): powerinfer.predictor_state(a, b, predictors.threshold)
              for l, (a, b) in enumerate(zip(predictors.fc1, predictors.fc2))}
    bundle.save_stage("predictors", states, record)
    counts = None if hot is None else hot.sum(axis=1)
    if hot is not None:
        bundle.save_stage("placement", {"hot": hot}, {
            "source": f"PowerInfer gpu_idx in {hot_from.name}", "hot_per_layer": counts,
            "ffn_share_on_device": float(hot.mean())})
    table(["layer", "rank", "hot"], [[l, r, "-" if counts is None else int(counts[l])]
                                     for l, r in enumerate(predictors.ranks)], out)
    out(f"imported {config.n_layers} PowerInfer predictors ({sum(params) / 1e6:.2f} M parameters, neuron active when "
        f"its score >= {predictors.threshold:g}) into {bundle.path / 'predictors'}")
    if hot is None:
        out(f"{model.name} has no neuron placement (no gpu_idx tensors, no {model.name}{powerinfer.GPU_INDEX_SUFFIX});"
            f" run `pjinfer profile` and `pjinfer solve` on {bundle.path}, or give --gpu-index")
    else:
        out(f"placement from {hot_from.name}: {100 * hot.mean():.1f}% of the FFN neurons hot; wrote "
            f"{bundle.path / 'placement'}")
    return bundle
