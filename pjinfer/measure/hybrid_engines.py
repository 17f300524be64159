"""The engines pjinfer.measure.bench_hybrid compares, on a random Llama-2-7B-geometry model with a planted activation
trace (random weights: speed only, never accuracy):

- RandomModel: every matrix as random Q4_0 rows on the host; on the device, pallas_kernels.q4_rows' planes of the same
  numbers.
- firing_probabilities, draw: per-neuron firing probabilities following a power law, and each token's active set
  drawn from them (the planted predictor output).
- Hybrid: PowerInfer's neuron split. Attention, embedding, head and predictors on the device; every layer's hot
  neurons' rows in one device table, of which q4_hot_ffn reads the active ones; the cold ones' rows in one host
  table, of which cpu_offload.neuron_rows.NeuronRows (predicted_ffn's kernel on the file's Q4_0 rows) computes the
  active ones through jax.pure_callback; the two partial sums added on the device.
- LayerSplit: llama.cpp's -ngl. The first K layers whole on the device, the rest through one io_callback a token on
  the host decode (HostLayers: cpu_offload.decoder.HostDecoder, its float16 KV cache on the host). K = all: every
  layer on the device.

Each engine's run(n) generates n greedy tokens in one jitted loop. The predictor is computed, so its cost counts,
but the active sets come from the trace.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from tqdm import tqdm

from cpu_offload.neuron_rows import NeuronRows
from cpu_offload.blocks import AS_STORED, Q4_0, TYPES
from cpu_offload.decoder import HostDecoder
from cpu_offload.qtensor import QTensor
from pallas_kernels.q4_rows import Q4Planes, planes_from_blocks, q4_hot_ffn, q4_matvec
from pjinfer.config import ModelConfig
from pjinfer.measure.bench_scale import _centred_scales
from pjinfer.runtime.model import rope

ACTIVATION = "reglu"
DENSE = "xla"   # q4_matvec's form for the dense products: XLA's read faster than the Pallas kernel on an H100


@dataclasses.dataclass(frozen=True)
class Geometry:
    d: int
    layers: int
    heads: int
    ff: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


GEOMETRIES = {"7b": Geometry(4096, 32, 32, 11008, 32000),   # Llama-2-7B (no grouped-query attention)
              "tiny": Geometry(256, 4, 4, 384, 512)}


# ---------------------------------------------------------------------------------------------- the random model

def q4_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 rows [rows, cols / 32 * 18]: uniform nibbles, bench_scale's scales (values centred on 0)."""
    blocks = cols // TYPES[Q4_0].block
    out = np.frombuffer(rng.bytes(rows * blocks * TYPES[Q4_0].nbytes), np.uint8).reshape(rows, blocks, -1).copy()
    out[..., :2] = _centred_scales(rng, rows, cols, Q4_0)[..., :1].view(np.uint8)
    return out.reshape(rows, -1)


def q4_pack(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Q4_0 rows of nibbles q (uint8 [rows, cols], 0..15) with scales (float16 [rows, cols / 32]): ggml's block, the
    scale then 16 bytes, byte j holding element j (low nibble) and element j + 16 (high)."""
    rows, cols = q.shape
    q = q.reshape(rows, cols // 32, 2, 16)
    out = np.empty((rows, cols // 32, TYPES[Q4_0].nbytes), np.uint8)
    out[..., :2] = scales.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)
    out[..., 2:] = q[:, :, 0] | (q[:, :, 1] << 4)
    return out.reshape(rows, -1)


def down_pair(rng, d: int, ff: int) -> tuple[np.ndarray, np.ndarray]:
    """One random down projection as Q4_0 rows both ways, the same numbers: down [d, ff] (a row per output, the
    dense layout) and down_t [ff, d] (a row per neuron, PowerInfer's). Every 32 x 32 tile shares one scale, so a
    block along either axis holds one scale and both blockings are exact."""
    q = rng.integers(0, 16, (d, ff), dtype=np.uint8)
    tiles = _centred_scales(rng, d // 32, ff, Q4_0)[..., 0]                    # [d / 32, ff / 32]
    return q4_pack(q, np.repeat(tiles, 32, axis=0)), q4_pack(np.ascontiguousarray(q.T), np.repeat(tiles.T, 32, axis=0))


@dataclasses.dataclass
class RandomModel:
    """Every matrix as Q4_0 rows on the host: per layer wq, wk, wv, wo [d, d], gate and up [ff, d], and the down
    projection both ways (down_pair): down [d, ff] and down_t [ff, d]; embed, head [vocab, d]."""
    g: Geometry
    layers: list[dict]
    embed: np.ndarray
    head: np.ndarray

    @classmethod
    def random(cls, g: Geometry, seed: int = 0) -> "RandomModel":
        rng = np.random.default_rng(seed)
        shapes = {"wq": (g.d, g.d), "wk": (g.d, g.d), "wv": (g.d, g.d), "wo": (g.d, g.d), "gate": (g.ff, g.d),
                  "up": (g.ff, g.d)}
        layers = []
        for _ in tqdm(range(g.layers), desc="random Q4_0 layers", disable=None):
            layers.append({n: q4_rows(rng, *s) for n, s in shapes.items()})
            layers[-1]["down"], layers[-1]["down_t"] = down_pair(rng, g.d, g.ff)
        return cls(g, layers, q4_rows(rng, g.vocab, g.d), q4_rows(rng, g.vocab, g.d))


def planes(rows: np.ndarray, *, device=None) -> Q4Planes:
    return jax.device_put(planes_from_blocks(rows, Q4_0), device)


def nbytes(tree) -> int:
    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(tree)))


# ---------------------------------------------------------------------------------------------- the trace

def firing_probabilities(rng, layers: int, ff: int, active_share: float, hot_share: float,
                         hot_mass: float) -> np.ndarray:
    """[layers, ff] probabilities p = min(1, c r^-a) over each neuron's rank r (shuffled per layer), with a and c
    such that the mean is active_share and the top hot_share of neurons hold hot_mass of the sum."""
    rank = np.arange(1, ff + 1, dtype=np.float64)
    top = max(1, int(round(hot_share * ff)))

    def shaped(a):
        w = rank ** -a
        lo, hi = 0.0, 1.0 / w[-1]
        for _ in range(100):                       # c for the mean
            c = (lo + hi) / 2
            lo, hi = (c, hi) if np.minimum(1, c * w).mean() < active_share else (lo, c)
        return np.minimum(1, c * w)

    lo, hi = 0.0, 8.0
    for _ in range(60):                             # a for the skew
        a = (lo + hi) / 2
        p = shaped(a)
        lo, hi = (a, hi) if p[:top].sum() / p.sum() < hot_mass else (lo, a)
    p = shaped((lo + hi) / 2)
    return np.stack([p[rng.permutation(ff)] for _ in range(layers)])


def draw(rng, p: np.ndarray, tokens: int) -> np.ndarray:
    """Each token's active neurons: bool [tokens, layers, ff]."""
    return rng.random((tokens, *p.shape)) < p


def id_lists(active: np.ndarray, index: np.ndarray):
    """For each token and layer, the table rows of the active neurons that `index` ([layers, ff], -1 where a
    neuron is not in the table) holds: (ids int32 [tokens, layers, K] padded with 0, counts int32 [tokens, layers])."""
    chosen = active & (index >= 0)[None]
    counts = chosen.sum(axis=2).astype(np.int32)
    ids = np.zeros((*counts.shape, max(1, int(counts.max()))), np.int32)
    for t, l in np.ndindex(counts.shape):
        rows = index[l][chosen[t, l]]
        ids[t, l, :rows.size] = rows
    return ids, counts


def table_index(members: np.ndarray) -> np.ndarray:
    """[layers, ff] bool -> the row each member takes in a table of all layers' members (layer after layer), -1
    for the others."""
    index = np.full(members.shape, -1, np.int64)
    index[members] = np.arange(int(members.sum()))
    return index.astype(np.int32)


# ---------------------------------------------------------------------------------------------- host parts

class HostLayers:
    """Layers first..L-1 on the host decode (HostDecoder over the file's Q4_0 rows, float16 KV cache kept here), one
    call a token: x [d] at position pos -> x after those layers. Called from jax.io_callback (it writes its cache)."""

    def __init__(self, model: RandomModel, first: int, max_len: int):
        g = model.g
        self.n = g.layers - first
        config = ModelConfig(arch="llama", vocab_size=g.vocab, d_model=g.d, n_layers=self.n, n_heads=g.heads,
                             n_kv_heads=g.heads, head_dim=g.head_dim, d_ff=g.ff, activation=ACTIVATION,
                             max_seq_len=max_len, tie_embeddings=False)
        weights = {"lm_head": QTensor(Q4_0, (model.head,), g.d), "embed": QTensor(Q4_0, (model.embed,), g.d)}
        for i, layer in enumerate(model.layers[first:]):
            for name, key, cols in (("wq", "wq", g.d), ("wk", "wk", g.d), ("wv", "wv", g.d), ("wo", "wo", g.d),
                                    ("w_gate", "gate", g.d), ("w_up", "up", g.d), ("w_down_t", "down", g.ff)):
                weights[f"layers.{i}.{name}"] = QTensor(Q4_0, (layer[key],), cols)
            weights[f"layers.{i}.attn_norm.scale"] = np.ones(g.d, np.float32)
            weights[f"layers.{i}.ffn_norm.scale"] = np.ones(g.d, np.float32)
        self.decoder = HostDecoder(config, weights, AS_STORED)
        self.cpu = jax.devices("cpu")[0]
        shape = (1, max_len, g.heads, g.head_dim)
        self.k = [jax.device_put(np.zeros(shape, np.float16), self.cpu) for _ in range(self.n)]
        self.v = [jax.device_put(np.zeros(shape, np.float16), self.cpu) for _ in range(self.n)]
        self.run = jax.jit(self._layers, donate_argnums=(2, 3))

    def _layers(self, x, pos, ks, vs):
        ks, vs = list(ks), list(vs)
        for l in range(self.n):
            x, ks[l], vs[l] = self.decoder.layer(l, x, pos, ks[l], vs[l])
        return x, ks, vs

    def __call__(self, x, pos):
        x, self.k, self.v = self.run(jax.device_put(np.asarray(x, np.float32), self.cpu),
                                     jax.device_put(np.asarray(pos, np.int32), self.cpu), self.k, self.v)
        return np.asarray(x)


# ---------------------------------------------------------------------------------------------- the device step

def rmsnorm(x, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x) + eps)


def attention(g: Geometry, w, x, pos, k_cache, v_cache, interpret: bool):
    """One layer's attention for one token on the device: w holds wqkv and wo planes; caches [S, heads, hd] f16."""
    h = rmsnorm(x)
    qkv = q4_matvec(h, w["wqkv"], impl=DENSE, interpret=interpret)
    q, k, v = (a.reshape(1, 1, g.heads, g.head_dim) for a in jnp.split(qkv, 3))
    positions = jnp.reshape(pos, (1, 1))
    q, k = rope(q, positions, 10000.0)[0, 0], rope(k, positions, 10000.0)[0, 0]
    k_cache = jax.lax.dynamic_update_index_in_dim(k_cache, k.astype(jnp.float16), pos, 0)
    v_cache = jax.lax.dynamic_update_index_in_dim(v_cache, v[0, 0].astype(jnp.float16), pos, 0)
    scores = jnp.einsum("hd,shd->hs", q * g.head_dim ** -0.5, k_cache.astype(jnp.float32))
    scores = jnp.where(jnp.arange(k_cache.shape[0]) <= pos, scores, -jnp.inf)
    out = jnp.einsum("hs,shd->hd", jax.nn.softmax(scores, axis=-1), v_cache.astype(jnp.float32))
    return x + q4_matvec(out.reshape(-1), w["wo"], impl=DENSE, interpret=interpret), k_cache, v_cache


def embed_row(embed: Q4Planes, token):
    """One row of the Q4 embedding, dequantized (ggml's nibble order: low nibbles first in each block)."""
    qs = embed.qs[token].reshape(-1, 16)
    q = jnp.concatenate([qs & 15, qs >> 4], axis=1).astype(jnp.float32)
    return (q * embed.scale[token].astype(jnp.float32)[:, None]
            + embed.minimum[token].astype(jnp.float32)[:, None]).reshape(-1)


def stacked(trees):
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


class Engine:
    """One configuration on the device: ``weights`` (device arrays it reads), ``caches`` (its KV cache, donated to each
    run) and a jitted generate. run(n) generates n greedy tokens from token 0 at position 0 and returns the logits
    of the last step (blocking)."""

    name: str
    weights: tuple
    caches: jax.Array
    device_bytes: int
    _generate = None

    def run(self, n: int) -> np.ndarray:
        logits, self.caches = self._generate(self.weights, self.caches, jnp.int32(n))
        return np.asarray(logits)


def generate(weights, caches, n, *, step, interpret: bool):
    """n greedy tokens from token 0 at position 0 -> (the last step's logits, caches); weights = (what step reads,
    embed, head)."""
    layers, embed, head = weights

    def one(pos, carry):
        logits, caches = carry
        token = jnp.where(pos == 0, 0, jnp.argmax(logits)).astype(jnp.int32)
        x, caches = step(layers, embed_row(embed, token), pos, caches)
        return q4_matvec(rmsnorm(x), head, impl=DENSE, interpret=interpret), caches

    return jax.lax.fori_loop(0, n, one, (jnp.zeros(embed.qs.shape[0], jnp.float32), caches))


def jitted(step, interpret: bool):
    return jax.jit(lambda weights, caches, n: generate(weights, caches, n, step=step, interpret=interpret),
                   donate_argnums=1)


def device_attention(model: RandomModel) -> list[dict]:
    return [{"wqkv": planes(np.concatenate([l["wq"], l["wk"], l["wv"]])), "wo": planes(l["wo"])}
            for l in model.layers]


def new_caches(g: Geometry, layers: int, max_len: int):
    return jnp.zeros((2, layers, max_len, g.heads, g.head_dim), jnp.float16)


def layer_loop(g: Geometry, ffn, interpret: bool, unroll: bool = False):
    """The device layers as one scan (unrolled: one straight program): attention, then ffn(w, x, l) for the
    layer's FFN (added to x)."""
    def run(layers, x, pos, caches):
        def layer(carry, w):
            x, l, caches = carry
            x, k, v = attention(g, w["attn"], x, pos, caches[0, l], caches[1, l], interpret)
            caches = caches.at[0, l].set(k).at[1, l].set(v)
            return (x + ffn(w, rmsnorm(x), l), l + 1, caches), None
        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        (x, _, caches), _ = jax.lax.scan(layer, (x, 0, caches), layers, unroll=n if unroll else 1)
        return x, caches
    return run


class LayerSplit(Engine):
    """llama.cpp's -ngl: the first `on_device` layers whole on the device (dense), the rest through one io_callback a
    token on the host decode (HostLayers); embedding, head and the argmax on the device."""

    def __init__(self, model: RandomModel, on_device: int, max_len: int, attn, embed, head, interpret: bool,
                 unroll: bool = False):
        g = model.g
        self.name = "all on device" if on_device == g.layers else f"layer split (-ngl {on_device})"
        self.name += ", layers unrolled" if unroll else ""
        dev = [{"attn": attn[l], "ffn": {k: planes(model.layers[l][k]) for k in ("gate", "up", "down")}}
               for l in range(on_device)]
        layers = stacked(dev) if dev else None
        self.weights, self.caches = (layers, embed, head), new_caches(g, on_device, max_len)
        self.device_bytes = nbytes((self.weights, self.caches))
        host = HostLayers(model, on_device, max_len) if on_device < g.layers else None

        def dense_ffn(w, h, l):
            f = w["ffn"]
            gate, up = (q4_matvec(h, f[k], impl=DENSE, interpret=interpret) for k in ("gate", "up"))
            return q4_matvec(jax.nn.relu(gate) * up, f["down"], impl=DENSE, interpret=interpret)

        device_layers = layer_loop(g, dense_ffn, interpret, unroll)

        def step(layers, x, pos, caches):
            if layers is not None:
                x, caches = device_layers(layers, x, pos, caches)
            if host is not None:
                x = io_callback(host, jax.ShapeDtypeStruct((g.d,), jnp.float32), x, pos)
            return x, caches

        self._generate = jitted(step, interpret)


class Hybrid(Engine):
    """PowerInfer's hybrid: attention, embedding, head and predictors on the device; the hot neurons' rows of every
    layer in one device table (q4_hot_ffn reads the active ones), the cold ones' in one host table (NeuronRows through
    pure_callback), the two partial sums added on the device."""

    def __init__(self, model: RandomModel, hot: np.ndarray, trace: np.ndarray, max_len: int, attn, embed, head, *,
                 predictor_rank: int, threads: int, interpret: bool, unroll: bool = False, seed: int = 1):
        g = model.g
        self.name = "hybrid (ILP)" + (", layers unrolled" if unroll else "")
        pick = lambda key, members: np.concatenate([model.layers[l][key][members[l]] for l in range(g.layers)])
        table = {k: planes(pick(k, hot)) for k in ("gate", "up", "down_t")}
        cold = NeuronRows(*(QTensor(Q4_0, (pick(k, ~hot),), g.d) for k in ("gate", "up", "down_t")),
                          activation=ACTIVATION, threads=threads)
        hot_ids, hot_counts = id_lists(trace, table_index(hot))
        cold_ids, cold_counts = id_lists(trace, table_index(~hot))
        self.cold_share = float(cold_counts.sum() / max(1, cold_counts.sum() + hot_counts.sum()))
        rng = np.random.default_rng(seed)
        predictors = [{"fc1": jnp.asarray(rng.standard_normal((predictor_rank, g.d)) / np.sqrt(g.d), jnp.float16),
                       "fc2": jnp.asarray(rng.standard_normal((g.ff, predictor_rank)) / np.sqrt(predictor_rank),
                                          jnp.float16)} if predictor_rank else {} for _ in range(g.layers)]
        layers = stacked([{"attn": attn[l], "pred": predictors[l]} for l in range(g.layers)])
        ids = tuple(jnp.asarray(a) for a in (hot_ids, hot_counts, cold_ids, cold_counts))
        self.weights, self.caches = ((layers, table, ids), embed, head), new_caches(g, g.layers, max_len)
        self.device_bytes = nbytes((layers, table, embed, head, self.caches))   # the planted ids are not weights

        def ffn(tables, pos):
            table, (hot_ids, hot_counts, cold_ids, cold_counts) = tables
            t = pos % hot_ids.shape[0]

            def run(w, h, l):
                n_hot = hot_counts[t, l]
                if predictor_rank:   # computed so that its cost counts; its output is planted (module docstring)
                    score = w["pred"]["fc2"] @ jax.nn.relu(w["pred"]["fc1"] @ h.astype(jnp.float16))
                    n_hot = n_hot + (jnp.max(score) > 6e4).astype(jnp.int32)
                y_hot = q4_hot_ffn(h, table["gate"], table["up"], table["down_t"], hot_ids[t, l], n_hot,
                                   activation=ACTIVATION, interpret=interpret) if hot.any() else 0.0
                y_cold = jax.pure_callback(cold, jax.ShapeDtypeStruct((g.d,), jnp.float32), h, cold_ids[t, l],
                                           cold_counts[t, l])
                return y_hot + y_cold
            return run

        def step(weights, x, pos, caches):
            layers, table, ids = weights
            return layer_loop(g, ffn((table, ids), pos), interpret, unroll)(layers, x, pos, caches)

        self._generate = jitted(step, interpret)
