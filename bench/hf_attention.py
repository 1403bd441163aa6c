"""Attention time inside a transformers Llama-style model: fa2cpu (+ KVCache) against sdpa.

    python bench/hf_attention.py [--threads 2] [--prompt 2048] [--dtypes float32,bfloat16]
                                 [--layers 2] [--decode-steps 32] [--repeats 3] [--save PATH]

One random-initialised Llama-style model (hidden 2048, 16/4 heads, head dim 128 by default; no
download) is switched between ``attn_implementation="sdpa"`` (transformers' default DynamicCache)
and ``"fa2cpu"`` (fa2cpu.integrations.transformers.KVCache) with ``set_attn_implementation``, so
both run the same weights. The registered attention functions of both are wrapped with timers:
"attention" is the time spent inside them (fa2cpu's includes appending the new K/V into its cache;
sdpa's cache concatenation happens outside, in ``cache.update``, reported as "cache update").
Phases: prefill = one forward over the prompt (batch 1), decode = single-token forwards at
``prompt`` context. Runs alternate between the two implementations; each figure is the best
(minimum) over ``--repeats`` runs of that run's time (decode: the run's median step), because
other processes on a shared machine slow whole runs down (a 2-thread GEMM whose second thread is
descheduled waits for it) and the minimum is the least disturbed run.
End-to-end: decode tokens/s from the same loop (whole forward incl. lm_head) and ``generate()``
tokens/s including the prefill.
"""
import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--generate-tokens", type=int, default=16, help="new tokens of the generate() run (0: skip)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save", default=None, help="also write the report to this file")
    p.add_argument("--fa2cpu-cache", choices=("kvcache", "dynamic"), default="kvcache",
                   help="fa2cpu's cache: its KVCache (default) or transformers' DynamicCache, like sdpa")
    return p.parse_args(argv)


ARGS = parse_args()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))  # before torch / libgomp start
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import cache_utils  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

import fa2cpu  # noqa: E402
import fa2cpu.integrations.transformers as fa2hf  # noqa: E402
from fa2cpu.bench import long_dtype_arg  # noqa: E402

LINES = []
# transformers renamed the cache argument (past_key_values -> cache; 5.24 takes both, 5.17 only the old one).
import inspect  # noqa: E402
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


class Timers:
    """Seconds spent in wrapped functions, by (what, implementation, phase)."""

    def __init__(self):
        self.t = {}
        self.impl = None

    def add(self, key, dt):
        self.t[key] = self.t.get(key, 0.0) + dt

    def attention(self, fn, impl):
        def timed(module, query, *args, **kwargs):
            t0 = time.perf_counter()
            r = fn(module, query, *args, **kwargs)
            self.add(("attention", impl, "prefill" if query.shape[2] > 1 else "decode"), time.perf_counter() - t0)
            return r
        return timed

    def update(self, fn):
        """A cache's update, timed for the implementation running (run_once sets self.impl)."""
        def timed(layer, key_states, *args, **kwargs):
            t0 = time.perf_counter()
            r = fn(layer, key_states, *args, **kwargs)
            self.add(("update", self.impl, "prefill" if key_states.shape[2] > 1 else "decode"), time.perf_counter() - t0)
            return r
        return timed

    def take(self):
        t, self.t = self.t, {}
        return t


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_once(model, impl, ids, steps, cache_len, dtype, timers, kv):
    """Prefill + `steps` decode forwards; -> dict of times (s)."""
    model.set_attn_implementation(impl)
    timers.impl = impl
    if impl == "fa2cpu" and kv is not None:
        kv.reset()
        cache = kv
    else:
        cache = transformers.DynamicCache(config=model.config)
    timers.take()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, **{CACHE_KW: cache}, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t = timers.take()
        res = {"prefill_total": prefill,
               "prefill_attn": t.get(("attention", impl, "prefill"), 0.0),
               "prefill_update": t.get(("update", impl, "prefill"), 0.0)}
        nxt = out.logits[:, -1:].argmax(-1)
        step_total, step_attn, step_update = [], [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(nxt, **{CACHE_KW: cache})
            step_total.append(time.perf_counter() - t0)
            t = timers.take()
            step_attn.append(t.get(("attention", impl, "decode"), 0.0))
            step_update.append(t.get(("update", impl, "decode"), 0.0))
            nxt = out.logits[:, -1:].argmax(-1)
    res.update(decode_total=statistics.median(step_total), decode_attn=statistics.median(step_attn),
               decode_update=statistics.median(step_update))
    return res


def run_padded(model, impl, ids, mask, timers):
    """One forward of a left-padded batch (no cache): attention time (s)."""
    model.set_attn_implementation(impl)
    timers.take()
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    return timers.take().get(("attention", impl, "prefill"), 0.0)


def generate_rate(model, impl, ids, new_tokens, kv):
    model.set_attn_implementation(impl)
    kw = {CACHE_KW: kv} if impl == "fa2cpu" and kv is not None else {}
    if kw:
        kv.reset()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
        return new_tokens / (time.perf_counter() - t0)


def main():
    a = ARGS
    torch.set_num_threads(a.threads)
    fa2hf.register()
    timers = Timers()
    # Timed wrappers of both registered attention functions and of both caches' update.
    AttentionInterface.register("sdpa", timers.attention(sdpa_attention_forward, "sdpa"))
    AttentionInterface.register("fa2cpu", timers.attention(fa2hf.fa2cpu_attention_forward, "fa2cpu"))
    cache_utils.DynamicLayer.update = timers.update(cache_utils.DynamicLayer.update)
    fa2hf._KVLayer.update = timers.update(fa2hf._KVLayer.update)

    cmd = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    say(f"# bench/hf_attention.py — attention inside a transformers Llama-style model")
    say(f"command: {cmd}")
    say(f"cpu: {cpu_model()}; {os.cpu_count()} logical CPUs; threads {a.threads} "
        f"(torch {torch.get_num_threads()}, fa2cpu OpenMP max {fa2cpu._core.max_threads()})")
    say(f"fa2cpu {fa2cpu.__version__} ({fa2cpu.get_isa()}, usable {','.join(fa2cpu.available_isas())}), "
        f"torch {torch.__version__}, transformers {transformers.__version__}")
    say(f"load average at start (other processes share this machine): {os.getloadavg()[0]:.2f}")
    say(f"model: hidden {a.hidden}, {a.layers} layers, heads {a.heads}/{a.kv_heads}, head dim {a.hidden // a.heads}, "
        f"MLP {a.intermediate}, vocab {a.vocab}; batch 1, prompt {a.prompt}, {a.decode_steps} decode steps, "
        f"best of {a.repeats} alternating runs")
    say()
    header = (f"{'dtype':<9} {'phase':<8} {'attention ms/layer':>22} {'speedup':>8} "
              f"{'+cache update ms/layer':>26} {'speedup':>8} {'forward ms':>20}")
    rows, e2e = [], []
    for name in a.dtypes.split(","):
        name = long_dtype_arg(name)   # bf16 or bfloat16, ...
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
            max_position_embeddings=max(4096, 2 * a.prompt), bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
        cache_len = a.prompt + max(a.decode_steps, a.generate_tokens) + 1
        kv = fa2hf.KVCache(model.config, 1, cache_len, dtype=dtype) if a.fa2cpu_cache == "kvcache" else None
        ids = torch.randint(3, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
        run_once(model, "sdpa", ids[:, :64], 2, cache_len, dtype, timers, kv)    # warm-up
        run_once(model, "fa2cpu", ids[:, :64], 2, cache_len, dtype, timers, kv)
        runs = {"sdpa": [], "fa2cpu": []}
        for _ in range(a.repeats):
            for impl in ("sdpa", "fa2cpu"):
                runs[impl].append(run_once(model, impl, ids, a.decode_steps, cache_len, dtype, timers, kv))
        med = {impl: {k: min(r[k] for r in rs) for k in rs[0]} for impl, rs in runs.items()}
        # The padded case: batch 2 x prompt/2, the second sequence left-padded by prompt/4.
        half = a.prompt // 2
        pids, pmask = ids[:, :half].repeat(2, 1), torch.ones(2, half, dtype=torch.long)
        pmask[1, :half // 2] = 0
        pad = {"sdpa": [], "fa2cpu": []}
        for _ in range(a.repeats):
            for impl in pad:
                pad[impl].append(run_padded(model, impl, pids, pmask, timers))
        pad = {impl: min(v) for impl, v in pad.items()}
        L = a.layers
        for phase in ("prefill", "decode"):
            s, f = med["sdpa"], med["fa2cpu"]
            sa, fa_ = s[f"{phase}_attn"] / L * 1e3, f[f"{phase}_attn"] / L * 1e3
            su = (s[f"{phase}_attn"] + s[f"{phase}_update"]) / L * 1e3
            fu = (f[f"{phase}_attn"] + f[f"{phase}_update"]) / L * 1e3
            st, ft_ = s[f"{phase}_total"] * 1e3, f[f"{phase}_total"] * 1e3
            rows.append(f"{name:<9} {phase:<8} {sa:>9.3f} sdpa {fa_:>7.3f} fa {sa / fa_:>7.2f}x "
                        f"{su:>11.3f} sdpa {fu:>7.3f} fa {su / fu:>7.2f}x {st:>8.1f} sdpa {ft_:>7.1f} fa")
        sa, fa_ = pad["sdpa"] / a.layers * 1e3, pad["fa2cpu"] / a.layers * 1e3
        rows.append(f"{name:<9} {'padded':<8} {sa:>9.3f} sdpa {fa_:>7.3f} fa {sa / fa_:>7.2f}x")
        dec = {impl: 1.0 / med[impl]["decode_total"] for impl in med}
        line = (f"{name:<9} decode loop: sdpa {dec['sdpa']:.2f} tokens/s, fa2cpu {dec['fa2cpu']:.2f} tokens/s "
                f"({dec['fa2cpu'] / dec['sdpa']:.2f}x)")
        if a.generate_tokens:
            g = {impl: [] for impl in ("sdpa", "fa2cpu")}
            for _ in range(max(1, a.repeats // 2)):
                for impl in g:
                    g[impl].append(generate_rate(model, impl, ids, a.generate_tokens, kv))
            gm = {impl: max(v) for impl, v in g.items()}
            line += (f"; generate({a.prompt} + {a.generate_tokens}) incl. prefill: sdpa {gm['sdpa']:.2f}, "
                     f"fa2cpu {gm['fa2cpu']:.2f} tokens/s ({gm['fa2cpu'] / gm['sdpa']:.2f}x)")
        e2e.append(line)
        say(f"{name}: done"); del model, kv
    say()
    say(header)
    for r in rows:
        say(r)
    say()
    say("end-to-end (batch 1):")
    for line in e2e:
        say("  " + line)
    say()
    fa_cache = "KVCache" if a.fa2cpu_cache == "kvcache" else "DynamicCache"
    say(f"phases: prefill = 1 x {a.prompt} tokens with cache; decode = 1 token at {a.prompt}+ context "
        f"(fa2cpu: {fa_cache}, sdpa: DynamicCache, whose torch.cat is the 'cache update'); padded = 2 x {a.prompt // 2} "
        f"tokens, the second left-padded by {a.prompt // 4}, no cache (fa2cpu: packed sequences, varlen).")
    say(f"load average at end: {os.getloadavg()[0]:.2f}")
    say("speedup = sdpa time / fa2cpu time (> 1: fa2cpu faster). Goals (issue 9): prefill attention >= 1.3x, "
        "decode attention >= 1.5x.")
    if a.save:
        os.makedirs(os.path.dirname(os.path.abspath(a.save)), exist_ok=True)
        with open(a.save, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
