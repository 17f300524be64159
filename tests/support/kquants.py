"""A simple quantizer for llama.cpp's K types (Q4_K, Q5_K, Q6_K), for writing test files: the gguf package has
dequantizers for them but no quantizer. Not llama.cpp's search for the best scales (min-max per sub-block, then
the 6- or 8-bit sub-block scales rounded against the super-block's f16 d); any bytes it writes are valid blocks,
and tests/test_quants.py checks them against gguf's dequantizer."""
from __future__ import annotations

import numpy as np

QK = 256


def _f16(v):
    h = np.asarray(v, np.float32).astype(np.float16)
    return h, h.astype(np.float32)


def _ratio(num, den):
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def _q45_k(x, bits):
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    qmax = (1 << bits) - 1
    mn_f = np.maximum(-sub.min(-1), 0)                        # w = d sc q - dmin m, m >= 0
    scale_f = (sub.max(-1) + mn_f) / qmax
    d16, d = _f16(scale_f.max(-1) / 63)
    dm16, dmin = _f16(mn_f.max(-1) / 63)
    sc = np.clip(np.rint(_ratio(scale_f, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(mn_f, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_ratio(sub + (dmin[:, None] * m)[..., None], step[..., None])), 0, qmax).astype(np.uint8)
    scales = np.empty((nb, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(nb, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(nb, 128)
    parts = [d16.view(np.uint8).reshape(nb, 2), dm16.view(np.uint8).reshape(nb, 2), scales]
    if bits == 5:
        qh = np.zeros((nb, 32), np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(x):
    nb = x.shape[0]
    sub = x.reshape(nb, 16, 16)
    scale_f = np.abs(sub).max(-1) / 31
    d16, d = _f16(scale_f.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(scale_f, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_ratio(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    ql = np.empty((nb, 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = np.zeros((nb, 2, 32), np.uint8)
    for i in range(4):
        qh |= (q[:, :, i] >> 4) << (2 * i)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                           d16.view(np.uint8).reshape(nb, 2)], axis=1)


def quantize(w, kind: str) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, row bytes] blocks of kind (Q4_K, Q5_K, Q6_K)."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    if cols % QK:
        raise ValueError(f"{kind} rows need a multiple of {QK} elements, got {cols}")
    x = w.reshape(-1, QK)
    out = {"Q4_K": lambda: _q45_k(x, 4), "Q5_K": lambda: _q45_k(x, 5), "Q6_K": lambda: _q6_k(x)}[kind]()
    return out.reshape(rows, -1)
