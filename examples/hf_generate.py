"""Greedy generation with a Llama-style transformers model on fa2cpu, against transformers' sdpa.

The model is random-initialised from a LlamaConfig (nothing is downloaded). fa2cpu runs as
``attn_implementation="fa2cpu"`` with its preallocated ``KVCache`` (in-place K/V append, left
padding dropped from the cache); sdpa runs with transformers' default DynamicCache. Prints the
tokens/s of both and, in float32, asserts that the greedy outputs are token-identical.

    python examples/hf_generate.py                                  # ~1.1B-parameter-wide, 2 layers
    python examples/hf_generate.py --dtype bfloat16 --prompt 1024 --new-tokens 64 --batch 4
"""
import argparse
import copy
import inspect
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import fa2cpu  # noqa: E402
import fa2cpu.integrations.transformers as fa2hf  # noqa: E402
from fa2cpu.bench import long_dtype_arg  # noqa: E402
from fa2cpu.bench.cli import positive_int  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=positive_int, default=2048)
    p.add_argument("--intermediate", type=positive_int, default=None, help="MLP width (default 2.75 x hidden)")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--prompt", type=positive_int, default=256, help="prompt length (longest sequence)")
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=2, help="sequences; rows after the first are left-padded")
    p.add_argument("--dtype", type=long_dtype_arg, default="float32",
                   help="float32, bfloat16, float16 (or fp32, bf16, fp16)")
    p.add_argument("--paged", action="store_true", help="paged KVCache (blocks of --block-size)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=None, help="torch and fa2cpu threads (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}, which must divide --hidden {args.hidden}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab, max_position_embeddings=max(4096, args.prompt + args.new_tokens),
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fa2hf.register()
    # from_config sets the implementation on the config it gets: one copy per model.
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                         dtype=dtype).eval()
    fa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="fa2cpu",
                                                       dtype=dtype).eval()
    fa.load_state_dict(sdpa.state_dict())

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, args.batch):  # left padding, as generate() expects for batches
        pads = (b * args.prompt) // (2 * args.batch)
        mask[b, :pads] = 0
        ids[b, :pads] = config.pad_token_id
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, pad_token_id=config.pad_token_id)
    cache = fa2hf.KVCache(fa.config, max_batch_size=args.batch, max_cache_len=args.prompt + args.new_tokens,
                          dtype=dtype, paged=args.paged, block_size=args.block_size)
    print(f"Llama-style: hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
          f"vocab {args.vocab}, {args.dtype}; batch {args.batch} x prompt {args.prompt} (left-padded), "
          f"{args.new_tokens} new tokens; torch threads {torch.get_num_threads()}, fa2cpu {fa2cpu.get_isa()}")

    # generate() takes the cache as cache= (transformers 5.24) or past_key_values= (5.17: no cache= yet).
    cache_kw = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"
    results = {}
    with torch.no_grad():
        for name, model, kw in (("sdpa", sdpa, {}), ("fa2cpu", fa, {cache_kw: cache})):
            model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False,
                           pad_token_id=config.pad_token_id)  # warm-up
            if kw:
                cache.reset()
            t0 = time.perf_counter()
            out = model.generate(ids, **gen, **kw)
            elapsed = time.perf_counter() - t0
            results[name] = (out, elapsed)
            tokens = args.batch * args.new_tokens
            print(f"{name:>7}: {tokens / elapsed:8.1f} tokens/s  ({elapsed:.2f} s for {tokens} tokens incl. prefill)")
    (a, ta), (b, tb) = results["sdpa"], results["fa2cpu"]
    same = torch.equal(a, b)
    new_a, new_b = a[:, args.prompt:], b[:, args.prompt:]
    agree = (new_a == new_b).float().mean().item()
    print(f"speedup fa2cpu / sdpa: {ta / tb:.2f}x; new tokens agreeing: {agree:.1%}; token-identical: {same}")
    if dtype == torch.float32:
        assert same, "fp32 greedy outputs differ between sdpa and fa2cpu"
    return {"token_identical": same, "sdpa_s": ta, "fa2cpu_s": tb}


if __name__ == "__main__":
    main()
