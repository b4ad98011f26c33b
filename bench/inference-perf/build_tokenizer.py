#!/usr/bin/env python3
"""Build the local byte-level BPE tokenizer inference-perf needs (no model hub is reachable).

  build_tokenizer.py OUT_DIR [--corpus FILE] [--vocab-size 2200]

inference-perf loads its tokenizer with `AutoTokenizer.from_pretrained(path)`; it uses it to
make prompts of an exact token length (the `random` data generator samples token ids uniformly
from the vocabulary, decodes them and trims/extends until the text re-tokenizes to the target)
and, unless told to trust the server's usage, to count output tokens.

fleet-sim does not tokenize: a prompt is `ceil(bytes / 4)` tokens (sim/src/text.rs), and the
project's loadgen writes exactly `4 x tokens` bytes. So the tokenizer must give ~4 bytes per
token on the text inference-perf generates with it, or the two tools would offer the fleet
different prompt lengths for the same trace. A byte-level BPE trained on inference-perf's own
Shakespeare corpus (ASCII only, shipped in the pinned wheel, so the result is reproducible)
gives, for uniformly random token ids re-tokenized: 2.8 bytes/token at 500 merges-vocab,
3.9 at 2,000, 4.0 at 2,200, 4.5 at 4,000, 5.2 at 8,000. 2,200 it is; the script measures the
figure again and writes it to OUT_DIR/build-info.json (the runner checks it against the
server-side prompt token counts too).

The alphabet is the training text's own (ASCII), not all 256 bytes: random sampling would
otherwise pick lone UTF-8 continuation bytes and decode them to U+FFFD.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

EOS = "<|endoftext|>"


def default_corpus():
    import inference_perf

    return Path(inference_perf.__file__).resolve().parent / "assets" / "shakespeare.txt"


def build(out_dir: Path, corpus: Path, vocab_size: int) -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False)
    tok.train([str(corpus)], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    # What AutoTokenizer needs to load tokenizer.json offline, no model config required.
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }, indent=1) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=1) + "\n")
    return {"vocab_size": tok.get_vocab_size(), "corpus": str(corpus),
            "corpus_sha256": hashlib.sha256(corpus.read_bytes()).hexdigest(),
            "tokenizer_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()}


def measure(out_dir: Path, samples: int = 40, target: int = 1155) -> dict:
    """Load it the way inference-perf does and measure bytes per token of its random prompts."""
    import numpy as np
    from inference_perf.config import CustomTokenizerConfig
    from inference_perf.datagen.datagen_utils import generate_random_exact_length_text, init_vocab_sampling
    from inference_perf.utils.custom_tokenizer import CustomTokenizer

    ct = CustomTokenizer(CustomTokenizerConfig(pretrained_model_name_or_path=str(out_dir)))
    _, _, valid = init_vocab_sampling(ct)
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(samples):
        text, _ = generate_random_exact_length_text(rng, valid, ct, target)
        ratios.append(len(text.encode()) / target)
    return {"tokenizer_class": type(ct.get_tokenizer()).__name__,
            "random_prompt_bytes_per_token": round(float(np.mean(ratios)), 4),
            "random_prompt_bytes_per_token_std": round(float(np.std(ratios)), 4),
            "measured_at_tokens": target, "samples": samples}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--corpus", help="training text (default: inference-perf's assets/shakespeare.txt)")
    ap.add_argument("--vocab-size", type=int, default=2200)
    args = ap.parse_args()
    out = Path(args.out_dir)
    info = build(out, Path(args.corpus) if args.corpus else default_corpus(), args.vocab_size)
    info.update(measure(out))
    (out / "build-info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"tokenizer: {out} ({info['tokenizer_class']}, vocab {info['vocab_size']}, "
          f"{info['random_prompt_bytes_per_token']} bytes/token on random prompts; fleet-sim assumes 4)")
    if abs(info["random_prompt_bytes_per_token"] - 4.0) > 0.15:
        print("warning: far from fleet-sim's 4 bytes/token; prompt loads will differ between the tools", file=sys.stderr)


if __name__ == "__main__":
    main()
