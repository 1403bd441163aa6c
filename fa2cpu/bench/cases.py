"""The benchmark's vocabulary: dtypes, modes, the default sweep, one attention problem (`Case`)
and its inputs in each implementation's natural layout."""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# One dtype table: short name -> NumPy dtype, and the long names accepted for each.
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16),
          "fp16": np.dtype(np.float16)}
DTYPE_LONG_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_ALIASES = {**{s: s for s in DTYPES}, **{long: s for s, long in DTYPE_LONG_NAMES.items()}}
# Quantized KV caches of decode (--kv-dtype): codes + one float32 scale per (token, kv head) of K and of V.
KV_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}

# (atol, rtol) of the benchmark's correctness check, |out - ref| <= atol + rtol*|ref|. Loose on
# purpose: it catches wrong answers, not rounding differences between implementations.
TOLERANCES = {"fp32": (1e-4, 1e-3), "fp16": (2e-3, 1e-2), "bf16": (1e-2, 5e-2)}

MODES = ("prefill", "decode", "varlen")
DEFAULT_MODES = ("prefill", "decode")
DEFAULT_DTYPES = ("fp32", "bf16")
DEFAULT_HEAD_DIM = 128
DECODE_GQA_GROUP = 4   # decode default: Hk = Hq / 4 (GQA, as in Llama-style models)

# Shapes per mode. "seqlen" is a ladder, smallest first: the default sweep runs the first length
# of every mode and then longer ones while the time budget (--budget-s) lasts. Prefill uses H=8
# (not the H=32 of bench/RESULTS.md) so that a 2-core machine gets past N=512 within a minute.
MODE_DEFAULTS = {
    "prefill": {"batch": 1, "heads": 8, "seqlen": (512, 1024, 2048)},
    "decode": {"batch": 8, "heads": 32, "seqlen": (2048, 8192)},
    "varlen": {"batch": 4, "heads": 8, "seqlen": (1024,)},
}


def dtype_name(text: str) -> str:
    """The short dtype name for 'fp32'/'float32', 'bf16'/'bfloat16', 'fp16'/'float16'."""
    try:
        return DTYPE_ALIASES[text]
    except KeyError:
        names = ", ".join(f"{s} ({long})" for s, long in DTYPE_LONG_NAMES.items())
        raise ValueError(f"unknown dtype {text!r} (choose from {names})") from None


def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs one head attends: all, or bottom-right causal (i sees j <= i + nk - nq)."""
    if not causal:
        return nq * nk
    rows = np.arange(nq, dtype=np.int64) + (nk - nq) + 1
    return int(np.clip(rows, 0, nk).sum())


@dataclass(frozen=True)
class Case:
    """One attention problem. Layout-free: each implementation gets it in its own natural layout."""
    mode: str
    dtype: str
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    seqlens: tuple[int, ...] | None = None   # varlen: per-sequence lengths (q and k alike)
    kv_dtype: str | None = None              # decode: "int8" / "fp8" quantized cache; None: dtype's

    @property
    def sequences(self) -> list[tuple[int, int]]:
        """(Nq, Nk) of every sequence in the batch."""
        if self.seqlens is not None:
            return [(n, n) for n in self.seqlens]
        return [(self.seqlen_q, self.seqlen_k)] * self.batch

    @property
    def flops(self) -> int:
        pairs = sum(visible_pairs(nq, nk, self.causal) for nq, nk in self.sequences)
        return 2 * (self.head_dim + self.head_dim_v) * self.heads_q * pairs

    @property
    def bytes(self) -> int:
        """Bytes of q, K, V read once and of the output written; a quantized cache's K/V bytes
        are its codes plus its float32 scales (one per token and kv head, for K and for V)."""
        tq = sum(nq for nq, _ in self.sequences)
        tk = sum(nk for _, nk in self.sequences)
        q_out = tq * self.heads_q * (self.head_dim + self.head_dim_v) * DTYPES[self.dtype].itemsize
        kv = tk * self.heads_kv * (self.head_dim + self.head_dim_v)
        if self.kv_dtype is None:
            return q_out + kv * DTYPES[self.dtype].itemsize
        return q_out + kv * KV_DTYPES[self.kv_dtype].itemsize + tk * self.heads_kv * 2 * 4

    @property
    def work(self) -> int:
        """What the time of this case grows with: bytes for decode, FLOPs otherwise."""
        return self.bytes if self.mode == "decode" else self.flops

    @property
    def score_bytes(self) -> int:
        """Largest fp32 score matrix the naive NumPy baseline materialises at once."""
        per_seq = max(nq * nk for nq, nk in self.sequences)
        count = 1 if self.seqlens is not None else self.batch
        return 4 * count * self.heads_q * per_seq

    @property
    def x_value(self) -> int:
        """The sequence length a plot puts on its x axis."""
        return self.seqlen_k if self.mode == "decode" else self.seqlen_q

    def label(self) -> str:
        heads = f"{self.heads_q}" if self.heads_q == self.heads_kv else f"{self.heads_q}/{self.heads_kv}"
        if self.seqlens is not None:
            n = f"{min(self.seqlens)}..{max(self.seqlens)}"
        elif self.seqlen_q == self.seqlen_k:
            n = f"{self.seqlen_q}"
        else:
            n = f"{self.seqlen_q}/{self.seqlen_k}"
        d = f"{self.head_dim}" if self.head_dim == self.head_dim_v else f"{self.head_dim}/{self.head_dim_v}"
        return f"B={self.batch} H={heads} N={n} D={d}" + (f" kv={self.kv_dtype}" if self.kv_dtype else "")


def varlen_lengths(batch: int, seqlen: int) -> tuple[int, ...]:
    """Deterministic ragged batch: lengths spread evenly over [seqlen/2, 3*seqlen/2]."""
    if batch == 1:
        return (seqlen,)
    return tuple(max(1, round(seqlen * (0.5 + i / (batch - 1)))) for i in range(batch))


def mode_lengths(args, mode: str) -> tuple[tuple[int, ...], str]:
    """The sequence lengths a mode sweeps and where they come from. --seqlen applies to the modes
    named with --mode; without --mode it applies to prefill (and varlen) only, so that it never
    silently changes the decode cache. For decode, --seqlen-k names the cache length."""
    if mode == "decode" and args.seqlen_k:
        return (args.seqlen_k,), "--seqlen-k"
    if args.seqlen and (args.mode_given or mode != "decode"):
        return tuple(args.seqlen), "--seqlen"
    return MODE_DEFAULTS[mode]["seqlen"], "default"


def mode_shape(args, mode: str) -> tuple[int, int, int]:
    """(batch, query heads, key/value heads) of a mode: the options given, else its defaults."""
    batch = args.batch or MODE_DEFAULTS[mode]["batch"]
    heads = args.heads or MODE_DEFAULTS[mode]["heads"]
    if args.kv_heads:
        return batch, heads, args.kv_heads
    gqa = mode == "decode" and heads % DECODE_GQA_GROUP == 0
    return batch, heads, heads // DECODE_GQA_GROUP if gqa else heads


def build_cases(args) -> list[Case]:
    """Every case the arguments ask for, mode by mode, in table order."""
    cases = []
    for mode in args.mode:
        batch, heads, kv_heads = mode_shape(args, mode)
        causals = (False,) if mode == "decode" else args.causal   # Nq=1 bottom-right sees every key
        kv_dtypes = (getattr(args, "kv_dtype", None) or [None]) if mode == "decode" else [None]
        for dtype in args.dtype:
            for n in mode_lengths(args, mode)[0]:
                for causal in causals:
                    for kv_dtype in kv_dtypes:
                        if mode == "prefill":
                            nq, nk, lengths = n, args.seqlen_k or n, None
                        elif mode == "decode":
                            nq, nk, lengths = 1, n, None
                        else:
                            nq, nk, lengths = n, n, varlen_lengths(batch, n)
                        cases.append(Case(mode, dtype, causal, batch, heads, kv_heads, nq, nk,
                                          args.head_dim, args.head_dim, lengths, kv_dtype))
    return cases


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """fa2cpu's natural layout: prefill bhsd, decode q (B,1,Hq,D) + caches (B,Nk,Hk,D),
    varlen packed (total, H, D) with cu_seqlens."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_seqlens: np.ndarray | None = None
    bhsd: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None   # see baseline_problems
    k_scale: np.ndarray | None = None    # decode with a quantized cache: (B, Nk, Hk) float32
    v_scale: np.ndarray | None = None


def uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Unit-variance uniform values (much faster to draw than normals for GiB-sized caches)."""
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * math.sqrt(3.0)
    return a if dtype == np.float32 else a.astype(dtype)


def make_inputs(case: Case, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    dt = DTYPES[case.dtype]
    b, hq, hk, d, dv = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v
    if case.mode == "prefill":
        return Inputs(uniform(rng, (b, hq, case.seqlen_q, d), dt),
                      uniform(rng, (b, hk, case.seqlen_k, d), dt),
                      uniform(rng, (b, hk, case.seqlen_k, dv), dt))
    if case.mode == "decode" and case.kv_dtype:
        return quantized_decode_inputs(case, rng)
    if case.mode == "decode":
        return Inputs(uniform(rng, (b, 1, hq, d), dt),
                      uniform(rng, (b, case.seqlen_k, hk, d), dt),
                      uniform(rng, (b, case.seqlen_k, hk, dv), dt))
    total = sum(case.seqlens)
    cu = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)
    return Inputs(uniform(rng, (total, hq, d), dt), uniform(rng, (total, hk, d), dt),
                  uniform(rng, (total, hk, dv), dt), cu)


def quantized_decode_inputs(case: Case, rng: np.random.Generator) -> Inputs:
    """Decode inputs with an int8 / float8 cache: uniform values quantized by the library's own
    append rule (fa2cpu.attention._quantize), one sequence at a time to bound the float32 temporaries."""
    from fa2cpu.attention import _quantize
    b, hk, nk = case.batch, case.heads_kv, case.seqlen_k
    code = KV_DTYPES[case.kv_dtype]
    q = uniform(rng, (b, 1, case.heads_q, case.head_dim), DTYPES[case.dtype])
    caches, scales = [], []
    for dim in (case.head_dim, case.head_dim_v):
        c, s = np.empty((b, nk, hk, dim), code), np.empty((b, nk, hk), np.float32)
        for i in range(b):
            c[i], s[i] = _quantize(uniform(rng, (nk, hk, dim), np.dtype(np.float32)), c, True)
        caches.append(c)
        scales.append(s)
    return Inputs(q, caches[0], caches[1], k_scale=scales[0], v_scale=scales[1])


def baseline_problems(case: Case, x: Inputs) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The inputs as contiguous bhsd (q, k, v) arrays, one triple per independent attention
    problem: the layout NumPy and torch are fastest with (strided K/V views make NumPy's matmul
    ~30x slower). Copied once per case, outside any timing; prefill inputs are not copied."""
    if x.bhsd is None:
        if case.mode == "prefill":
            views = [(x.q, x.k, x.v)]
        elif case.mode == "decode" and case.kv_dtype:   # the dequantized cache, float32
            k, v = (c.astype(np.float32) * s[..., None] for c, s in ((x.k, x.k_scale), (x.v, x.v_scale)))
            views = [tuple(a.transpose(0, 2, 1, 3) for a in (x.q, k, v))]
        elif case.mode == "decode":
            views = [tuple(a.transpose(0, 2, 1, 3) for a in (x.q, x.k, x.v))]
        else:
            cu = x.cu_seqlens
            views = [tuple(a[cu[i]:cu[i + 1]].transpose(1, 0, 2)[None] for a in (x.q, x.k, x.v))
                     for i in range(case.batch)]
        x.bhsd = [tuple(np.ascontiguousarray(a) for a in p) for p in views]
    return x.bhsd


def canonical(case: Case, outs: list[np.ndarray]) -> np.ndarray:
    """Join per-problem bhsd outputs into the canonical float32 layout used for comparisons:
    bhsd for prefill and decode, packed (total, Hq, Dv) for varlen."""
    if case.mode == "varlen":
        return np.concatenate([o[0].transpose(1, 0, 2) for o in outs]).astype(np.float32)
    return np.asarray(outs[0], dtype=np.float32)
