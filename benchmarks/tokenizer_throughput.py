"""Tokenizer throughput of one process, to set against the forward pass's tokens per second.

Tokenizes WikiText-103 sentences with the real GPT-2 tokenizer through ffkv's corpus reader
(`CorpusReader`: sentence splitting, `encode_batch` per chunk, the same path as `ffkv index` with
`--tokenizer-workers 0`) and with the bare tokenizer's batch call on pre-split text.

    python benchmarks/tokenizer_throughput.py [--sentences 20000] [--threads]
"""

from __future__ import annotations

import argparse
import os
import time

from common import corpus_file, shared_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=20000)
    parser.add_argument("--threads", action="store_true",
                        help="let the Rust tokenizer use its thread pool (default: one thread, as a forked worker)")
    args = parser.parse_args()
    if not args.threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import transformers as tf

    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.models.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(tf.AutoTokenizer.from_pretrained(str(shared_data() / "tokenizers" / "gpt2")))
    path = corpus_file(args.sentences)
    spec = CorpusSpec(source=str(path), unit="sentence", max_examples=args.sentences)
    start = time.perf_counter()
    examples = list(CorpusReader(spec, tokenizer))
    reader_s = time.perf_counter() - start
    n_tokens = sum(len(e.token_ids) for e in examples)
    texts = [e.text for e in examples]
    start = time.perf_counter()
    bare = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    bare_s = time.perf_counter() - start
    print(f"{len(examples):,} sentences, {n_tokens:,} tokens; load average {os.getloadavg()[0]:.1f}; "
          f"tokenizer threads {'on' if args.threads else 'off'}")
    print(f"ffkv corpus reader (read, split, tokenize): {n_tokens / reader_s:,.0f} tok/s ({reader_s:.2f} s)")
    print(f"bare encode_batch on the split sentences: {bare / bare_s:,.0f} tok/s ({bare_s:.2f} s)")


if __name__ == "__main__":
    main()
