"""The sparse bundle: everything the offline pipeline produced for one model, in one directory.

    DIR/manifest.json      model identity and hash, settings, achieved figures, per stage
    DIR/profile/           orbax: thresholds, per-neuron frequency and mass; beside it the
                           predictor training data (train_inputs.npy float16, train_labels.npy
                           packed bits), which only `train-predictors` reads, and locality.png,
                           the activation-frequency figure
    DIR/predictors/        orbax: one predictor state per layer (trained, or imported from a PowerInfer GGUF)
    DIR/placement/         orbax: which neurons are hot (live on the accelerator)
    DIR/thresholds/        orbax: input-sparsity thresholds [layers, 4] (pjinfer.offline.teal; the weights
                           they run on: pjinfer.runtime.backends' BACKENDS, bundle_rule)

Every stage writes into a temporary directory and renames it into place, and the manifest is
replaced atomically after it, so a failed or interrupted stage leaves the previous bundle intact.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from flax import nnx

from pjinfer.config import THRESHOLD_INPUTS, ConfigError
from pjinfer.load.loader import model_identity
from train.predictor import INPUTS, Predictor

FORMAT = 1
MANIFEST = "manifest.json"
THRESHOLDS = "thresholds"   # the stage of input-sparsity thresholds (pjinfer.offline.teal)


def model_record(config, source) -> dict:
    """What a bundle records of the model it was made for; its identity is checked whenever it is opened."""
    c = config
    return {"source": str(source), "identity": model_identity(Path(source)), "name": c.name, "arch": c.arch,
            "activation": c.activation, "n_layers": c.n_layers, "d_ff": c.d_ff, "d_model": c.d_model}


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


class Bundle:
    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest

    # ------------------------------------------------------------ opening
    @classmethod
    def create(cls, path, *, model: dict) -> "Bundle":
        """A new bundle for `model` (source, identity, name, arch, n_layers, d_ff), or the existing one
        at `path` when it was made for the same model."""
        path = Path(path)
        if (path / MANIFEST).exists():
            bundle = cls.open(path)
            bundle.check_model(model["identity"])
            return bundle
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"{path} exists and is not a pjinfer bundle; choose a new directory")
        return cls(path, {"format": FORMAT, "model": model, "stages": {}})  # written with its first stage

    @classmethod
    def open(cls, path, *, source=None) -> "Bundle":
        """The bundle at path; with source (a model path), checked to have been made for that model."""
        path = Path(path)
        file = path / MANIFEST
        if not path.exists():
            raise ConfigError(f"bundle {path} does not exist")
        if not file.exists():
            raise ConfigError(f"{path} is not a pjinfer bundle (no {MANIFEST}); build one with `make bundle`")
        try:
            manifest = json.loads(file.read_text())
        except ValueError as e:   # not JSON, or not UTF-8
            raise ConfigError(f"bundle manifest {file} is corrupt ({' '.join(str(e).split())[:200]})") from None
        problem = _manifest_problem(manifest)
        if problem:
            raise ConfigError(f"bundle manifest {file} is corrupt ({problem})")
        bundle = cls(path, manifest)
        if source is not None:
            bundle.check_model(model_identity(Path(source)))
        return bundle

    def check_model(self, identity: str) -> None:
        made_for = self.manifest["model"]
        if made_for.get("identity") != identity:
            raise ConfigError(f"bundle {self.path} was made for another model ({made_for.get('name')}, "
                              f"hash {made_for.get('identity')}); this model's hash is {identity}")

    def require(self, stage: str, *keys: str) -> dict:
        """The manifest's record of `stage`, which must hold `keys`; refused in one line naming the command that
        makes the stage when it is absent or lacks one."""
        if stage not in self.manifest["stages"]:
            raise ConfigError(f"bundle {self.path} has no {stage} yet; run `pjinfer {_MAKES[stage]} --bundle {self.path}`")
        record = self.manifest["stages"][stage]
        missing = [key for key in keys if key not in record]
        if missing:
            raise ConfigError(f"bundle {self.path}: the {stage} record lacks {', '.join(missing)}; run "
                              f"`pjinfer {_MAKES[stage]} --bundle {self.path}` again")
        return record

    # ------------------------------------------------------------ what the runtime reads
    def thresholds(self, config) -> np.ndarray:
        """The input-sparsity thresholds, float32 [n_layers, len(THRESHOLD_INPUTS)]."""
        return self.stage_array(THRESHOLDS, "thresholds", (config.n_layers, len(THRESHOLD_INPUTS)), np.float32)

    def placement(self, config) -> np.ndarray:
        """The placement: bool [n_layers, d_ff], True for a neuron held on the accelerator."""
        return self.stage_array("placement", "hot", (config.n_layers, config.d_ff), bool)

    def predictors(self, config) -> list:
        """One train.predictor.Predictor per layer, as the predictors stage stored them (trained by
        `train-predictors`, or imported from a PowerInfer file by `import-powerinfer`: the record's "reads")."""
        record = self.require("predictors")
        ranks, reads = record.get("ranks"), record.get("reads", "ffn_in")
        if not isinstance(ranks, list) or len(ranks) != config.n_layers or \
                not all(_is_int(r) and 0 < r <= config.d_ff for r in ranks) or reads not in INPUTS:
            raise ConfigError(f"bundle {self.path}: the predictors record needs {config.n_layers} ranks in "
                              f"1..{config.d_ff} and reads in {', '.join(INPUTS)}")
        tree = self.load_stage("predictors")
        out = []
        for l, rank in enumerate(ranks):
            predictor = Predictor(config.d_model, config.d_ff, int(rank), rngs=nnx.Rngs(0), reads=reads)
            state = nnx.state(predictor)
            _check_same_shapes(nnx.to_pure_dict(state), tree.get(str(l)), f"bundle {self.path}: predictor {l}")
            nnx.replace_by_pure_dict(state, tree[str(l)])
            nnx.update(predictor, state)
            out.append(predictor)
        return out

    # ------------------------------------------------------------ stages
    def save_stage(self, stage: str, tree: dict, record: dict, *, extra_files: dict | None = None) -> None:
        """Write `tree` with orbax as DIR/stage, then record its settings and figures in the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / stage
        tmp = self.path / f".{stage}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with _checkpointer() as ckpt:
                ckpt.save(tmp.resolve() / "state", tree)
            for name, write in (extra_files or {}).items():
                write(tmp / name)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.manifest["stages"][stage] = record
        self._write_manifest()

    def load_stage(self, stage: str) -> dict:
        """The stage's orbax tree (a dict). A stage the manifest lists whose directory is missing, lies outside
        the bundle (a link), or does not restore is refused in one line."""
        self.require(stage)
        state = (self.path / stage / "state").resolve()
        if not state.is_relative_to(self.path.resolve()):
            raise ConfigError(f"bundle {self.path}: {stage} points outside the bundle, to {state}")
        if not state.is_dir():
            raise ConfigError(f"bundle {self.path}: the manifest lists {stage}, but {self.path / stage / 'state'} "
                              f"is missing; run `pjinfer {_MAKES[stage]} --bundle {self.path}` again")
        try:
            with _checkpointer() as ckpt:
                tree = ckpt.restore(state)
        except Exception as e:  # orbax and tensorstore raise many kinds; all mean the same to a user
            raise ConfigError(f"bundle {self.path}: cannot read {stage} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else 'corrupt'})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"bundle {self.path}: {stage} holds a {type(tree).__name__}, not a tree of arrays")
        return tree

    def stage_array(self, stage: str, key: str, shape: tuple, dtype) -> np.ndarray:
        """Array `key` of the stage as `dtype`, refused in one line unless it has `shape`, is bool where `dtype` is
        (a number otherwise) and holds finite values."""
        tree = self.load_stage(stage)
        try:
            value = np.asarray(tree[key])
        except KeyError:
            raise ConfigError(f"bundle {self.path}: {stage} has no {key!r}") from None
        kind_ok = value.dtype == bool if np.dtype(dtype) == bool else np.issubdtype(value.dtype, np.number)
        if value.shape != shape or not kind_ok:
            raise ConfigError(f"bundle {self.path}: {stage} {key} is {value.dtype} {list(value.shape)}, the model "
                              f"needs {np.dtype(dtype).name} {list(shape)}")
        if value.dtype != bool and not np.isfinite(value).all():
            raise ConfigError(f"bundle {self.path}: {stage} {key} holds values that are not finite")
        return value.astype(dtype)

    def _write_manifest(self) -> None:
        tmp = self.path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1, default=_jsonable))
        os.replace(tmp, self.path / MANIFEST)


_MAKES = {"profile": "profile", "predictors": "train-predictors", "placement": "solve", "thresholds": "calibrate"}


def _manifest_problem(manifest) -> str | None:
    """What makes a parsed manifest unusable, or None: the format, a model record with its identity, and a stage
    record (an object) for each of the known stages it lists."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != FORMAT:
        return f"format {json.dumps(manifest.get('format'))[:40]}, this pjinfer reads {FORMAT}"
    model, stages = manifest.get("model"), manifest.get("stages")
    if not isinstance(model, dict) or not isinstance(model.get("identity", ""), str):
        return "its model record is not an object with a string identity"
    if not isinstance(stages, dict):
        return "its stages are not an object"
    for name, record in stages.items():
        if name not in _MAKES:
            return f"unknown stage {name[:40]!r} (known: {', '.join(_MAKES)})"
        if not isinstance(record, dict):
            return f"the {name} record is not an object"
    return None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_same_shapes(want: dict, got, where: str) -> None:
    """`got` (a restored tree) has the keys of `want` (a pure state dict), leaf by leaf with the same shapes."""
    if not isinstance(got, dict) or set(got) != set(want):
        raise ConfigError(f"{where} holds {sorted(got) if isinstance(got, dict) else type(got).__name__}, "
                          f"not {sorted(want)}")
    for key, value in want.items():
        if isinstance(value, dict):
            _check_same_shapes(value, got[key], f"{where} {key}")
        elif np.shape(got[key]) != np.shape(value):
            raise ConfigError(f"{where} {key} is {list(np.shape(got[key]))}, the model needs {list(np.shape(value))}")


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"cannot store {type(x).__name__} in a manifest")
