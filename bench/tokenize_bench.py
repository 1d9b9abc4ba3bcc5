"""prepare_data.py's tokenization: throughput with 1 and 2 workers, and peak memory against corpus size.

    .venv/bin/python -m bench.tokenize_bench [--mb 40] [--rounds 3] [--rss-mb 100 1000] [--dir /tmp]

A synthetic JSONL corpus (seeded words of a Zipf-like vocabulary, documents of 50 to 2,000 words) is tokenized with
a byte-level BPE of 32,768 ids trained here on its first 20 MB (the GPT-2 recipe; nothing is downloaded). Each
variant is a real `python prepare_data.py` process; the variants run in rounds, 1 then 2 workers, then 2 then 1, so
a loaded machine slows them alike, and each round's ratio is printed beside the medians. Throughput is the
tokenizing phase's (input MB/s and tokens/s, from the command's summary line); CPU time is the whole process tree's
(the command and its workers, from getrusage in a fresh parent per run); the 1-minute load average is printed at the
start of each run. Peak RSS is the largest single process of the tree, for a 100 MB and a 1 GB corpus.
Files are written under --dir and deleted at the end. Not a test: figures depend on the machine. docs/data.md holds
a run.
"""

import argparse
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"tokenized ([\d,.]+) MB in ([\d.]+) s with (\d+) workers: ([\d,.]+) MB/s, ([\d,]+) tokens/s")
BPE_VOCAB = 32_768
BPE_TRAIN_MB = 20


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    """About ``megabytes`` MB of JSONL: 20,000 distinct seeded documents, repeated in order as needed."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 10))) for _ in range(50_000)]
    # Zipf-like, as in natural text; cumulative once, or every draw would sum 50,000 weights again.
    cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))
    punctuation = [", ", ". ", " ", " ", " ", " ", "\n"]
    documents = []
    for i in range(20_000):
        picked = rng.choices(words, cum_weights=cumulative, k=rng.randint(50, 2_000))
        text = "".join(w + rng.choice(punctuation) for w in picked)
        documents.append(json.dumps({"id": i, "text": text.capitalize()}) + "\n")
    target, written = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < target:
            for line in documents:
                handle.write(line)
                written += len(line)
                if written >= target:
                    break


def train_tokenizer(corpus: Path, out: Path) -> None:
    def texts():
        seen = 0
        with open(corpus, encoding="utf-8") as handle:
            for line in handle:
                seen += len(line)
                if seen > BPE_TRAIN_MB * 1_000_000:
                    return
                yield json.loads(line)["text"]

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.save(str(out))


# Runs the command and reports its process tree's CPU time and largest RSS: a fresh parent per run, since a
# process's ru_maxrss of its children is the largest over every child it ever waited for.
MEASURE = (
    "import resource, subprocess, sys; result = subprocess.run(sys.argv[1:]); "
    "usage = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print(f'rusage {usage.ru_utime + usage.ru_stime} {usage.ru_maxrss}'); sys.exit(result.returncode)"
)
RUSAGE = re.compile(r"rusage ([\d.]+) (\d+)")


def run_prepare(corpus: Path, out: Path, tokenizer: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, sys.executable, str(REPO / "prepare_data.py"), f"input={corpus}"]
        + [f"out={out}", f"tokenizer={tokenizer}", f"workers={workers}", "val_fraction=0.001"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    match, usage = SUMMARY.search(result.stdout), RUSAGE.search(result.stdout)
    assert match and usage, result.stdout + result.stderr
    shutil.rmtree(out)
    return {
        "workers": workers,
        "mb": float(match[1].replace(",", "")),
        "tokenize_s": float(match[2]),
        "mb_per_s": float(match[4].replace(",", "")),
        "tokens_per_s": float(match[5].replace(",", "")),
        "wall_s": wall,
        "cpu_s": float(usage[1]),
        "peak_rss_mb": int(usage[2]) / 1024,  # KiB on Linux
        "load": load,
    }


def line(r: dict) -> str:
    return (
        f"  {r['workers']} worker(s): {r['mb_per_s']:6.2f} MB/s {r['tokens_per_s']:>10,.0f} tokens/s  tokenize "
        f"{r['tokenize_s']:6.1f} s  wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  load {r['load']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=40, help="corpus size of the throughput rounds, MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-mb", type=int, nargs="*", default=[100, 1000], help="corpus sizes of the RSS runs")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the corpora are written (then deleted)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokenize-bench-", dir=args.dir))
    try:
        corpus, tokenizer = work / "corpus.jsonl", work / "tokenizer.json"
        write_corpus(corpus, args.mb)
        train_tokenizer(corpus, tokenizer)
        print(f"corpus {corpus.stat().st_size / 1e6:.1f} MB JSONL, BPE of {BPE_VOCAB:,} ids, {os.cpu_count()} cores")
        rounds = []
        for i in range(args.rounds):
            order = (1, 2) if i % 2 == 0 else (2, 1)
            results = {w: run_prepare(corpus, work / "out", tokenizer, w) for w in order}
            rounds.append(results)
            ratio = results[2]["mb_per_s"] / results[1]["mb_per_s"]
            print(f"round {i + 1}: 2 workers / 1 worker = {ratio:.2f}x")
            for w in order:
                print(line(results[w]))
        for key in ("mb_per_s", "tokens_per_s", "cpu_s"):
            one, two = (statistics.median(r[w][key] for r in rounds) for w in (1, 2))
            print(f"median {key}: 1 worker {one:,.2f}, 2 workers {two:,.2f}, ratio {two / one:.2f}x")
        ratios = sorted(r[2]["mb_per_s"] / r[1]["mb_per_s"] for r in rounds)
        print(f"per-round ratios (2 / 1 workers, MB/s): {', '.join(f'{x:.2f}' for x in ratios)}")
        for megabytes in args.rss_mb:
            big = work / f"rss-{megabytes}.jsonl"
            write_corpus(big, megabytes, seed=1)
            result = run_prepare(big, work / "out", tokenizer, 2)
            big.unlink()
            print(f"{megabytes} MB corpus: peak RSS {result['peak_rss_mb']:.0f} MB (largest process)")
            print(line(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
