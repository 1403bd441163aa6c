"""Where a decode step's attention time goes inside a model: a random-init Llama (hidden 2048,
heads 16/4, head dim 128, 4 layers, bf16 and fp32) prefills 2048 tokens and decodes 16; per layer
(median of the last 8 steps, microseconds): the registered attention function (fa_attn / sdpa_attn)
and, for fa2cpu with KVCache, the prepared core call inside it (fa_step: the kernels and the
append; the difference is Python). `*_step_total`: a whole decode forward, ms. Two rounds.

    python bench/decode_anatomy.py 16
    OMP_WAIT_POLICY=active python bench/decode_anatomy.py 16   # OpenMP threads spin between ops
"""
import contextlib, os, sys, time, statistics
T = int(sys.argv[1]) if len(sys.argv) > 1 else 16
os.environ.setdefault("OMP_NUM_THREADS", str(T))
import torch, transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface
import fa2cpu.integrations.transformers as fa2hf
from fa2cpu.integrations import _hf_cache
torch.set_num_threads(T)
fa2hf.register()
acc = {}
def add(k, dt): acc.setdefault(k, []).append(dt)
def timed(fn, name):
    def f(module, query, *a, **kw):
        t0 = time.perf_counter(); r = fn(module, query, *a, **kw); add(name, time.perf_counter() - t0); return r
    return f
AttentionInterface.register("sdpa", timed(sdpa_attention_forward, "sdpa_attn"))
AttentionInterface.register("fa2cpu", timed(fa2hf.fa2cpu_attention_forward, "fa_attn"))
orig_make = _hf_cache._KVLayer._make_step
def make_step(self):
    st = orig_make(self)
    if st is False: return st
    def call(*a):
        t0 = time.perf_counter(); r = st(*a); add("fa_step", time.perf_counter() - t0); return r
    return call
_hf_cache._KVLayer._make_step = make_step
def main(fa2cpu_decode=None):
    """fa2cpu_decode(rnd, dtype, res): optional context manager around fa2cpu's timed decode steps
    that may add entries (rnd, name) -> value to res (bench/timeline/decode_model.py)."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                       num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                       max_position_embeddings=4096)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
        ids = torch.randint(3, 32000, (1, 2048), generator=torch.Generator().manual_seed(1))
        kv = fa2hf.KVCache(model.config, 1, 2048 + 40, dtype=dtype)
        res = {}
        for rnd in range(2):
            for impl in ("sdpa", "fa2cpu"):
                model.set_attn_implementation(impl)
                cache = kv if impl == "fa2cpu" else transformers.DynamicCache(config=model.config)
                if impl == "fa2cpu": kv.reset()
                hook = fa2cpu_decode(rnd, dtype, res) if fa2cpu_decode and impl == "fa2cpu" else contextlib.nullcontext()
                with torch.no_grad():
                    out = model(ids, past_key_values=cache, logits_to_keep=1)
                    nxt = out.logits[:, -1:].argmax(-1)
                    acc.clear(); steps = []
                    with hook:
                        for _ in range(16):
                            t0 = time.perf_counter(); out = model(nxt, past_key_values=cache); steps.append(time.perf_counter() - t0)
                            nxt = out.logits[:, -1:].argmax(-1)
                for k, v in acc.items():
                    res.setdefault((rnd, k), statistics.median(v[8:]) * 1e6)
                res[(rnd, impl + "_step_total")] = statistics.median(steps) * 1e3
        print(dtype, T, "threads:", {f"{k[1]}{k[0]}": round(v, 1) for k, v in sorted(res.items(), key=lambda x: x[0][1])}, flush=True)
        del model, kv


if __name__ == "__main__":
    main()
