"""The `ffkv` command: a thin layer that parses options and calls the library.

Every problem surfaces as one line `ffkv: error: ...` with the exit status of its kind
(`ffkv.errors.EXIT_CODES`, printed by `ffkv --help`): the input 2, the file system 1
(read-only, full, permission), a damaged run 3; Ctrl-C as one line that claims only what
was saved, and exit status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import re
import sys
import warnings
from typing import Callable, Sequence

from ffkv import __version__, threads
from ffkv.allocator import keep_freed_memory
from ffkv.demo import DEMO_N_EVAL, LEFT_OUT
from ffkv.errors import (EXIT_CODES, DamagedRun, FfkvError, FfkvWarning, Interrupted, StorageError, command_line,
                         one_line)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    """Register the function that runs a subcommand."""
    def wrap(fn):
        COMMANDS[name] = fn
        return fn
    return wrap


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _layer_number(text: str) -> int:
    """A layer as the command line counts them, from 1, in the digits 0-9 (`ffkv.memories.address.whole_number`)."""
    from ffkv.memories.address import whole_number

    try:
        value = whole_number(text, "expected a layer from 1")
    except FfkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a layer from 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="ffkv-tiny",
                   help="ffkv-tiny (embedded), a local Hugging Face or fairseq model directory, a GGUF file "
                        "(pip install 'ffkv[gguf]'), or a hub id (default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="float32 is the exact reference (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")


def _add_corpus_options(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("corpus")
    g.add_argument("--corpus", required=required, default=None,
                   help="a text/WikiText/JSONL/Parquet file or folder, or hf:<dataset id>[:<config>]")
    g.add_argument("--format", default="auto", choices=("auto", "text", "wikitext", "jsonl", "parquet", "hf"),
                   help="how to read --corpus (default: %(default)s, from the file names)")
    g.add_argument("--unit", default="sentence", choices=("sentence", "line", "document", "window"),
                   help="what one example is (default: %(default)s, as in the paper)")
    g.add_argument("--window", type=_positive_int, default=128,
                   help="tokens per example with --unit window (default: %(default)s)")
    g.add_argument("--text-field", default="text",
                   help="text column of JSONL/Parquet/datasets sources (default: %(default)s)")
    g.add_argument("--split", default="all", choices=("all", "train", "heldout"),
                   help="for sources without splits of their own: a deterministic hash split (default: %(default)s)")
    g.add_argument("--hf-split", default="train", help="split of a Hugging Face dataset (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="shuffle seed: with --max-examples, a random subset")
    g.add_argument("--max-examples", type=_positive_int, default=None, help="use at most this many examples")
    g.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="truncate each example (default: 512, or the model's positions when fewer)")
    g.add_argument("--encoding", default="utf-8",
                   help="text encoding of text, WikiText and JSONL files (default: %(default)s; e.g. latin-1)")


def _corpus_spec(args: argparse.Namespace, source: str):
    from ffkv.corpus import CorpusSpec
    from ffkv.corpus.spec import DEFAULT_MAX_TOKENS

    return CorpusSpec(source=source, format=args.format, unit=args.unit, window=args.window,
                      text_field=args.text_field, split=args.split, hf_split=args.hf_split,
                      shuffle_seed=args.seed, max_examples=args.max_examples,
                      max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, encoding=args.encoding)


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N, got {text!r}")
    return i, n


class _LazyHelp(str):
    """A help text made only when a help page is printed (the experiments' list imports them: seconds)."""

    def __new__(cls, make: Callable[[], str]) -> "_LazyHelp":
        text = super().__new__(cls, "(the registered experiments)")
        text.make = make
        return text

    def __mod__(self, params) -> str:
        return self.make() % params


def _only_help() -> str:
    from ffkv.experiments.registry import only_help

    return only_help().replace("%", "%%")


def _add_experiment_options(p: argparse.ArgumentParser) -> None:
    """Each registered experiment's own options (`Experiment.options`, the fields with a "flag"), in a group named
    after it; `_experiment_options` reads them back."""
    from dataclasses import MISSING, fields

    from ffkv.experiments.registry import experiments

    for name, experiment in experiments().items():
        flagged = [f for f in fields(experiment.options) if "flag" in f.metadata] if experiment.options else []
        if not flagged:
            continue
        g = p.add_argument_group(f"{name} (--only {name})")
        for f in flagged:
            kind = _positive_int if f.metadata.get("positive") else (int if f.type in (int, "int") else None)
            g.add_argument(f.metadata["flag"], dest=f"option:{name}:{f.name}", type=kind,
                           metavar=f.metadata["flag"].lstrip("-").upper().replace("-", "_"),
                           default=None if f.default is MISSING else f.default, help=f.metadata.get("help"))


def _experiment_options(args: argparse.Namespace) -> dict[str, dict]:
    """experiment name -> its options as the command line gave them (`_add_experiment_options`)."""
    options: dict[str, dict] = {}
    for dest, value in vars(args).items():
        if dest.startswith("option:"):
            _, name, field = dest.split(":", 2)
            options.setdefault(name, {})[field] = value
    return options


#: The commands that take ``--plugin FILE.py`` (an experiment from outside the package).
PLUGIN_COMMANDS = ("analyze", "report", "serve")


def _plugins_named(argv: Sequence[str]) -> list[str]:
    """The files `ffkv analyze ... --plugin FILE.py` names, read before the parser is built (their experiments and
    options join it)."""
    named = []
    for i, arg in enumerate(argv):
        if arg == "--plugin" and i + 1 < len(argv):
            named.append(argv[i + 1])
        elif arg.startswith("--plugin="):
            named.append(arg.split("=", 1)[1])
    return named


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a line it refuses is one line: the error, the nearest command for a mistyped one, and
    where the options are listed (not the whole usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        chosen = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if chosen:
            typed, names = chosen.group(1), re.findall(r"'([^']*)'", chosen.group(2))
            near = difflib.get_close_matches(typed, names, n=1, cutoff=0.6)
            message = f"{typed!r} is not a command of {self.prog}" + (f" (did you mean {near[0]}?)" if near else "") \
                + f"; the commands: {', '.join(names)}"
        self.exit(2, f"{self.prog}: error: {message} (options: `{self.prog} --help`)\n")


def build_parser(experiments: bool = True) -> argparse.ArgumentParser:
    """The command line. `experiments`: give `ffkv analyze` the registered experiments' own options (imports
    them: seconds; `main` asks only when the command is analyze)."""
    parser = _Parser(
        prog="ffkv",
        description="Read transformer feed-forward layers as key-value memories (Geva et al. 2021).",
        epilog="Start with `ffkv demo`. Each command has its own --help. Layers in pages, reports and "
               "messages count from 1; the run's tables count from 0.\n\nexit status:\n"
               + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ffkv {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _index_parser(sub)
    _status_parser(sub)
    _merge_parser(sub)
    _analyze_parser(sub, experiments)
    _intervene_parser(sub)
    _prune_parser(sub)
    _compare_parser(sub)
    _annotate_parser(sub)
    _train_parser(sub)
    _train_dictionary_parser(sub)
    _demo_parser(sub)
    _report_parser(sub)
    _explain_parser(sub)
    _score_parser(sub)
    _serve_parser(sub)
    _locate_parser(sub)
    _attribute_parser(sub)
    for name, command_parser in sub.choices.items():
        if name not in NO_THREADS:
            command_parser.add_argument(
                "--threads", type=_thread_count, default=None, metavar="N",
                help=f"CPU threads for the model's work (default: {THREADS_DEFAULT}; {threads.ENV} sets it too)")
    return parser


#: Commands that do no model work: they choose no thread count (`ffkv.threads`).
NO_THREADS = ("status", "annotate", "report")
THREADS_DEFAULT = "the cores this process may use, less those other work keeps busy when it starts"


def _thread_count(text: str) -> int:
    try:
        return threads.parse_count(text, "--threads")
    except FfkvError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _index_parser(sub) -> None:
    """`ffkv index`'s arguments."""
    p = sub.add_parser("index", help="find the top trigger examples of every key in every layer",
                       description="One streaming pass over a corpus: for every layer and key, the top-k "
                                   "examples whose prefixes activate the key most (the paper's Section 3.1; docs/definitions.md).")
    _add_model_options(p)
    _add_corpus_options(p, required=True)
    p.add_argument("--out", required=True, help="run directory to create (or to resume)")
    p.add_argument("--top-k", type=_positive_int, default=50, help="trigger examples per key (default 50)")
    p.add_argument("--mode", default="example", choices=("example", "prefix"),
                   help="example: one prefix per example per key (paper); prefix: every prefix competes")
    p.add_argument("--sign", default=None, choices=("positive", "both"),
                   help="positive: each key's largest coefficients (the paper's trigger examples); both: also its most "
                        "negative ones, top-k of each (default: both when the model's coefficients can be negative: "
                        "gated, GELU, SiLU; positive for ReLU)")
    p.add_argument("--control-keys", type=int, default=None, metavar="N",
                   help="random control memories per layer, indexed in the same pass: each key-side finding of "
                        "`ffkv analyze` is set beside them (0: none; default: 256)")
    p.add_argument("--control-seed", type=int, default=0, help="seed of the control's random key directions "
                                                               "(default: %(default)s)")
    p.add_argument("--dictionary", default=None, metavar="PATH",
                   help="a sparse dictionary (transcoder or SAE: a sparsify or SAELens folder, an .npz, or a folder "
                        "of them, one per layer) whose latents are indexed in the same pass, one direction (their "
                        "activations are never negative), with --control-keys random control latents per layer: "
                        "latent_trigger_examples.parquet, latent_control_trigger_examples.parquet")
    p.add_argument("--batch-size", type=_positive_int, default=32,
                   help="examples per forward pass; speed and memory only, never the result (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=16384,
                   help="cap on padded tokens per batch (default 16384)")
    p.add_argument("--tokenizer-workers", type=int, default=None,
                   help="processes tokenizing ahead of the model (default: up to 4 on a GPU, 0 on a CPU)")
    p.add_argument("--checkpoint-seconds", type=_seconds, default=300.0,
                   help="save a resumable checkpoint this often (default 300)")
    p.add_argument("--resume", action="store_true",
                   help="continue an unfinished run in --out (interrupted, failed or killed) with the same options")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                   help="index only shard I of N (0-based); join the N runs with `ffkv merge`")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar (examples done, total, time left)")
    p.epilog = ("Several processes or machines: `torchrun --nproc-per-node N -m ffkv.cli index ...` "
                "(Gloo on CPU, NCCL on GPU), or --shard i/n on each machine, then `ffkv merge`.")


def _status_parser(sub) -> None:
    """`ffkv status`'s arguments."""
    p = sub.add_parser("status", help="is a run complete, running (alive?), interrupted or failed; is it whole",
                       description="The state of each run: running (pid, host, heartbeat; alive or not), "
                                   "interrupted, failed (with the error) or complete, and what to do next; for a "
                                   "complete run, its analyses (and those skipped, with why), and every table, "
                                   "figure, label table and explorer lookup file damaged, missing or out of date "
                                   "and an analyze that did not finish, each with the command that rewrites it. "
                                   "Exit status 3 when any is (a missing or out-of-date explorer folder aside: "
                                   "`ffkv serve` builds it), and for a run that stopped before it was complete "
                                   "(interrupted or failed); 0 when every run is whole, or being written by a "
                                   "live process.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--verify", action="store_true",
                   help="also hash every table and explorer lookup file and compare it with the hash recorded when "
                        "it was written, and read the sparse dictionary the run was indexed with again against its "
                        "recorded hashes (reads every byte; without it, sizes, rows and columns are compared and the "
                        "dictionary's files are looked for; figures, being small, are always hashed)")


def _merge_parser(sub) -> None:
    """`ffkv merge`'s arguments."""
    p = sub.add_parser("merge", help="join the runs of `ffkv index --shard i/n` into one run",
                       description="Merge shard runs exactly: the result is the run one process would have written.")
    p.add_argument("shards", nargs="+", help="the shard run directories")
    p.add_argument("--out", required=True, help="the merged run directory to create")


def _analyze_parser(sub, experiments: bool) -> None:
    """`ffkv analyze`'s arguments."""
    p = sub.add_parser("analyze", help="run the paper's experiments on a run (Geva et al. 2021, sections 3-5 of "
                                       "the paper) and the studies beyond it, each beside its null",
                       description="Adds metrics/NAME.parquet and figures/NAME.{png,svg} per experiment "
                                   "(the paper's Sections 3-5; beyond the paper: docs/definitions.md).")
    p.add_argument("run", help="a complete run directory")
    p.add_argument("--only", default=None, help=_LazyHelp(_only_help))
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="also run the experiment FILE.py declares (EXPERIMENT = Experiment(...); docs/extending.md): "
                        "its code runs, as you ask by naming it (repeatable)")
    p.add_argument("--eval-corpus", default=None,
                   help="held-out examples for composition/refinement (default: the run's corpus, held-out split; where "
                        "that corpus is the model's own training text, as ffkv-tiny's, the text it never saw)")
    p.add_argument("--eval-split", default=None, choices=("all", "train", "heldout"),
                   help="split of --eval-corpus (default: all for a given corpus, heldout for the run's)")
    p.add_argument("--n-eval", type=_positive_int, default=4000, help="held-out examples (default 4000, as the paper)")
    p.add_argument("--projection", default=None, choices=("default", "paper", "identity", "final-norm"),
                   help="default: ffkv's (docs/definitions.md; identity for values, sub-updates and Figure 8; final normalization for "
                        "residuals and every vector of Figures 9-11); paper: the released code's (identity "
                        "everywhere, the raw residual); identity or final-norm: that one for every vector")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="load the model in this dtype (default: the run's)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sampled keys, held-out positions and corpus samples (default: %(default)s)")
    _add_dictionary_at(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress lines and bars")
    if experiments:
        _add_experiment_options(p)
    p.epilog = ("Several processes: `torchrun --nproc-per-node N -m ffkv.cli analyze RUN ...` (Gloo on CPU, NCCL "
                "on GPU with --device cuda) shares the forward passes; the tables equal one process's.")


def _add_dictionary_at(p) -> None:
    """--dictionary of a command that reads a run: where the dictionary it was indexed with lies now."""
    p.add_argument("--dictionary", default=None, metavar="PATH",
                   help="where the sparse dictionary the run was indexed with lies now, if its files moved (any "
                        "path `ffkv index --dictionary` reads; checked to be the same files)")


def _intervene_parser(sub) -> None:
    """`ffkv intervene`'s arguments."""
    p = sub.add_parser("intervene", help="switch memories off, scale or set them, and measure the change on a corpus",
                       description="Rewrite memory coefficients at every position and report, over held-out "
                                   "examples, the change in perplexity and in the probability mass of a token set, "
                                   "with n and 95% intervals (paired per-example differences, mean ± 1.96·s/√n). "
                                   "Memories are LAYER:KEY with LAYER counted from 1, as the explorer and the report "
                                   "show them, and KEY the 0-based memory index (the explorer's /memory/LAYER/KEY); "
                                   "in a run indexed with --dictionary, a latent is tLAYER:LATENT (a transcoder's) or "
                                   "sLAYER:LATENT (an SAE's): the layer's output becomes the dictionary's "
                                   "reconstruction from the edited latents plus its error term.")
    p.add_argument("run", help="a complete run directory")
    p.add_argument("--set", dest="set_", action="append", default=[], metavar="L:K=VALUE",
                   help="set memory K of layer L (from 1) to the coefficient VALUE at every position (repeatable)")
    p.add_argument("--off", action="append", default=[], metavar="L:K", help="switch memory L:K off, m = 0 (repeatable)")
    p.add_argument("--scale", action="append", default=[], metavar="L:K=F", help="multiply m of memory L:K by F (repeatable)")
    p.add_argument("--eval-corpus", default=None,
                   help="the evaluation text (default: the run's corpus, held-out split; where that corpus is the "
                        "model's own training text, as ffkv-tiny's, the text it never saw), read with the run's unit")
    p.add_argument("--eval-split", default=None, choices=("all", "train", "heldout"),
                   help="split of --eval-corpus (default: all for a given corpus, heldout for the run's)")
    p.add_argument("--n-eval", type=_positive_int, default=1000, help="evaluation examples, a seeded subset (default: %(default)s)")
    p.add_argument("--tokens", default=None,
                   help='the token set S, comma-separated single tokens (e.g. " Lord, God") or ids; default: the '
                        "intervened values' own top 10 tokens each")
    p.add_argument("--out", default=None, help="also write the result atomically to FILE.json or FILE.parquet")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the evaluation subset (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _prune_parser(sub) -> None:
    """`ffkv prune`'s arguments."""
    p = sub.add_parser("prune", help="write a smaller model without the keys a criterion removes (beyond the paper)",
                       description="Remove the same share of keys from every FF layer of the run's model, chosen by "
                                   "a criterion (docs/definitions.md), and write the smaller model in its original "
                                   "format with its tokenizer; it is loaded back and checked to give the masked "
                                   "model's logits before --out appears.")
    p.add_argument("run", help="a complete run directory (its manifest names the model)")
    p.add_argument("--criterion", required=True,
                   help="activation_frequency, value_norm, contribution, redundancy, census (needs `ffkv analyze "
                        "RUN --only census`) or random")
    p.add_argument("--share", required=True, type=_share, help="share of each layer's keys to remove, in [0, 1)")
    p.add_argument("--out", required=True, help="the model folder to create (must not exist)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the corpus sample and the random criterion, as `ffkv analyze --seed` (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")


def _compare_parser(sub) -> None:
    """`ffkv compare`'s arguments."""
    p = sub.add_parser("compare", help="which memories two models share: correlate every key pair on one corpus "
                                       "(beyond the paper: Gurnee et al. 2024)",
                       description="Run both runs' models on run A's examples and correlate, per layer, every key "
                                   "of A with every key of B over all token positions (streamed: memory does not "
                                   "grow with the corpus). Writes keys.parquet (each key's best match, its "
                                   "correlation, a random rotation's best and the excess), layers.parquet (the share "
                                   "with excess above 0.5, n and 95% intervals) and compare.json. The runs must have "
                                   "read the same corpus with the same options and tokenizer.")
    p.add_argument("run_a", help="a complete run directory")
    p.add_argument("run_b", help="a complete run directory on the same corpus (RUN_A itself to compare its latents "
                                 "with its neurons)")
    p.add_argument("--of", default="neurons", choices=("neurons", "latents"),
                   help="run A's memories compared: its model's neurons, or the latents of the dictionary it was "
                        "indexed with (default: %(default)s)")
    p.add_argument("--against", default=None, choices=("neurons", "latents"),
                   help="run B's memories they are matched to (default: the same kind as --of)")
    p.add_argument("--out", default=None, help="the folder the tables go to (default: RUN_A/compare, or "
                                               "RUN_A/compare_OF_AGAINST with latents on a side)")
    p.add_argument("--max-examples", type=_positive_int, default=2000,
                   help="examples of run A's corpus read, in order (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random rotation (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _annotate_parser(sub) -> None:
    """`ffkv annotate`'s arguments."""
    p = sub.add_parser("annotate", help="human labels of key patterns: export a sample, import the labels",
                       description="The paper's human workflow (Section 3.2): export top prefixes of sampled keys to CSV, "
                                   "label them (shallow / semantic / both / none), import; `ffkv analyze --only "
                                   "patterns` then reports agreement with the automatic labels.")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    q = verbs.add_parser("export", help="write a CSV sample of keys to label",
                         description="A CSV of seeded random keys per layer with their top prefixes and an empty "
                                     "label column; each row names its memory as LAYER:KEY (the column memory, e.g. 3:17), "
                                     "layers counted from 1 as everywhere ffkv shows one.")
    q.add_argument("run", help="a complete run directory")
    q.add_argument("--out", required=True, help="CSV file to write")
    q.add_argument("--keys-per-layer", type=_positive_int, default=10,
                   help="keys sampled per layer (default: %(default)s, as the paper)")
    q.add_argument("--top", type=_positive_int, default=25, help="prefixes per key (the paper's experts read 25)")
    q.add_argument("--seed", type=int, default=0, help="seeds the sample of keys (default: %(default)s)")
    q = verbs.add_parser("import", help="read a labelled CSV into RUN/annotations/labels.parquet",
                         description="Store the labels of a filled-in `ffkv annotate export` CSV in the run.")
    q.add_argument("run", help="the run the CSV was exported from")
    q.add_argument("labels", help="the labelled CSV")
    q.add_argument("--annotator", default="", help="who labelled")


def _train_parser(sub) -> None:
    """`ffkv train`'s arguments."""
    p = sub.add_parser("train", help="train ffkv's own small LM (the shape of the paper's model)",
                       description="Seeded, resumable training with held-out perplexity against a unigram baseline.")
    p.add_argument("--corpus", default="default", help="text file, one example per line (default: the embedded KJV)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 1500)")
    p.add_argument("--seed", type=int, default=None, help="training seed (default: 0)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _train_dictionary_parser(sub) -> None:
    """`ffkv train-dictionary`'s arguments."""
    p = sub.add_parser("train-dictionary", help="train a TopK transcoder per FF layer on a corpus, in sparsify's "
                                                "layout, with its fidelity (FVU, dead latents, loss recovered)",
                       description="Stream the corpus's train split once and train, per chosen FF layer, a TopK "
                                   "transcoder from the FF input (after its norm) to the FF output (Gao et al. 2024, "
                                   "sparsify's recipe); write OUT/layers.L.mlp/{cfg.json,sae.safetensors} (sparsify's "
                                   "layout), then measure on the held-out split the fraction of variance unexplained, "
                                   "the dead latents and the loss recovered when the transcoder replaces the layer, "
                                   "against mean ablation (OUT/fidelity.parquet, OUT/training.json). Checkpointed "
                                   "atomically; --resume after Ctrl-C or kill -9 ends with the same weights. Layers "
                                   "count from 1.")
    _add_model_options(p)
    _add_corpus_options(p, required=True)
    p.set_defaults(device="auto", unit="window", split="train")
    p.add_argument("--layers", required=True, metavar="L,L,...", help="the FF layers, from 1 (e.g. 1,15,30)")
    p.add_argument("--out", required=True, help="the folder of the transcoders (created; or the one to --resume)")
    width = p.add_mutually_exclusive_group()
    width.add_argument("--expansion-factor", type=_positive_int, default=32,
                       help="latents per model dimension (default: %(default)s, sparsify's)")
    width.add_argument("--latents", type=_positive_int, default=None, metavar="N",
                       help="exactly N latents a layer, for a width that is no multiple of the model's (e.g. 24576 "
                            "for SmolLM2's 576); instead of --expansion-factor")
    p.add_argument("-k", "--k", type=_positive_int, default=32, help="latents firing per token (default: %(default)s)")
    p.add_argument("--skip", action="store_true", help="a skip transcoder: add a linear path x·W_skipᵀ to the output")
    p.add_argument("--tokens", type=_positive_int, default=1_000_000,
                   help="training tokens per layer; the last step may pass it (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=32,
                   help="examples per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam's peak step size (default: sparsify's, 2e-4/sqrt(latents/16384)); it warms up over "
                        "the first 5%% of the tokens and decays linearly to 0")
    p.add_argument("--init-seed", type=int, default=0, help="seeds the encoders' initialisation (default: %(default)s)")
    p.add_argument("--eval-tokens", type=_positive_int, default=50_000,
                   help="held-out tokens the fidelity is measured on (default: %(default)s)")
    p.add_argument("--save-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the written transcoders; the fidelity is measured on them (default: %(default)s)")
    p.add_argument("--checkpoint-seconds", type=_seconds, default=300.0,
                   help="save a resumable checkpoint this often (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue the unfinished training in --out, same options")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.epilog = ("Training reads the corpus's train split (--split train, the hash split of ffkv's corpus options), "
                "the fidelity its held-out split. --device auto: cuda when there is one, else cpu.")


def _demo_parser(sub) -> None:
    """`ffkv demo`'s arguments."""
    p = sub.add_parser("demo", help="the whole job on the embedded model ffkv-tiny and its corpus",
                       description="Index the embedded corpus with ffkv-tiny, run every analysis but those it leaves "
                                   "out to keep it short (it names them; --all runs them too), write the report.")
    p.add_argument("--out", default="runs/demo", help="run directory (default: %(default)s)")
    p.add_argument("--all", action="store_true", dest="every_step",
                   help=f"also run the analyses the demo leaves out ({', '.join(LEFT_OUT)})")
    p.add_argument("--n-eval", type=_positive_int, default=DEMO_N_EVAL,
                   help="held-out verses for the analyses of the paper's Section 5 (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress lines and bars")


def _report_parser(sub) -> None:
    """`ffkv report`'s arguments."""
    p = sub.add_parser("report", help="write RUN/report.html: every figure next to the paper's finding",
                       description="One self-contained HTML file (figures embedded, opens offline).")
    p.add_argument("run", help="a run directory")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="also read the experiment FILE.py declares (docs/extending.md): its title, findings and "
                        "columns; its code runs, as you ask by naming it (repeatable)")
    p.add_argument("--explorer-url", default=None,
                   help="where `ffkv serve` runs, for links into the explorer (default: links relative to the report "
                        "as the explorer serves it, from its Report link, on any port)")


def _explain_parser(sub) -> None:
    """`ffkv explain`'s arguments."""
    p = sub.add_parser("explain", help="one sentence per memory from a language model (Bills et al. 2023)",
                       description="Show a language model each chosen memory's top trigger examples (even ranks; "
                                   "each token's activation marked 0-10) and its value's top tokens, and store its "
                                   "one-sentence explanation in RUN/metrics/explanations.parquet (both directions "
                                   "of a signed model, each on its own). With --latents, the latents of the "
                                   "dictionary the run was indexed with instead (kind latent; their control latents "
                                   "with --controls). Resumable: what is stored is never asked again. Layers count "
                                   "from 1 (docs/explain.md).")
    _add_llm_options(p, "--explainer")
    p.add_argument("--layers", default=None, metavar="L,L,...", help="layers to sample from, from 1 (default: all)")
    p.add_argument("--memories", default=None, metavar="L:K,...",
                   help="explain these memories (layer from 1, key from 0) instead of a sample; a latent of the "
                        "run's dictionary is tL:J (a transcoder's) or sL:J (an SAE's)")
    p.add_argument("--latents", action="store_true",
                   help="sample the latents of the dictionary the run was indexed with (--dictionary), among those "
                        "that fired, instead of the neurons: --sample per dictionary layer of --layers, and "
                        "--controls control latents")
    p.add_argument("--sample", type=_positive_int, default=10, help="memories per layer, seeded (default: %(default)s)")
    p.add_argument("--controls", type=int, default=0, metavar="N",
                   help="also explain N random control memories per layer, the baseline (default: %(default)s)")
    p.add_argument("--direction", default="both", choices=("both", "positive", "negative"),
                   help="which directions of a signed model's memories (default: %(default)s, each on its own)")
    p.add_argument("--projection", default=None, choices=("default", "paper", "identity", "final-norm"),
                   help="the value projection whose top tokens are shown (default: the run's default, identity)")


def _score_parser(sub) -> None:
    """`ffkv score`'s arguments."""
    p = sub.add_parser("score", help="score the stored explanations by simulation on held-out text",
                       description="A simulator sees only an explanation and predicts the memory's activation 0-10 "
                                   "at every token of held-out texts (odd-rank trigger examples and random windows, "
                                   "never shown to the explainer); the score is the correlation with the true "
                                   "coefficients. Baselines: shuffled explanations and the control memories'. "
                                   "Writes RUN/metrics/explanation_scores*.parquet (docs/explain.md).")
    _add_llm_options(p, "--simulator")
    p.add_argument("--layers", default=None, metavar="L,L,...", help="score only these layers, from 1 (default: all)")
    p.add_argument("--top-examples", type=int, default=5,
                   help="held-out top-activating examples per explanation (default: %(default)s)")
    p.add_argument("--random-examples", type=int, default=5,
                   help="random windows of the corpus per explanation (default: %(default)s)")


def _serve_parser(sub) -> None:
    """`ffkv serve`'s arguments."""
    p = sub.add_parser("serve", help="explore a run in the browser: memories, search, trace, intervene, annotate",
                       description="The explorer at http://HOST:PORT/: the overview, every layer's keys, every "
                                   "memory (value under a chosen projection, activation histogram, trigger examples "
                                   "with per-token coefficients, JSON export), search, trace a prompt at any "
                                   "position, switch memories off and generate, annotate. Layers count from 1.")
    p.add_argument("run", help="a run directory")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="also read the experiment FILE.py declares (docs/extending.md): its title, findings and "
                        "columns; its code runs, as you ask by naming it (repeatable)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default: %(default)s, this machine only); any other address "
                        "prints a warning and requires an access token")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a further host name to answer to, besides loopback and --host (repeatable; requests "
                        "naming any other host are refused, which stops DNS rebinding)")
    p.add_argument("--token", default=None,
                   help="the access token to require (default beyond loopback: a random one, printed in the URL)")
    p.add_argument("--no-token", action="store_true",
                   help="require no access token even beyond loopback (anyone who can reach the port gets in)")
    _add_dictionary_at(p)


def _locate_parser(sub) -> None:
    """`ffkv locate`'s arguments."""
    p = sub.add_parser("locate", help="causal tracing: which layers and memories carry a fact (Meng et al. 2022)",
                       description="Corrupt the subject's input embeddings with Gaussian noise (3 standard deviations "
                                   "of the embeddings, seeded, several draws averaged) and restore, per layer and "
                                   "token, the hidden state, the FF output and the attention output (a window of "
                                   "layers): the indirect effect on p(answer) of each, as tables and heatmaps; then "
                                   "single memories restored at the best FF layer, with the `ffkv intervene` command "
                                   "that switches them off (docs/causal.md, docs/definitions.md).")
    _add_model_options(p)
    p.add_argument("--run", default=None, help="trace the model of this run (instead of --model); the printed "
                                               "`ffkv intervene` commands name it")
    p.add_argument("--facts", default=None, help="a JSONL file: one object per line with prompt, subject and "
                                                 "optionally answer (or attribute)")
    p.add_argument("--prompt", default=None, help="one prompt (with --subject)")
    p.add_argument("--subject", default=None, help="the subject: a substring of --prompt made of whole tokens")
    p.add_argument("--answer", default=None, help="the answer that continues --prompt (default: the model's own "
                                                  "top prediction)")
    p.add_argument("--out", required=True, help="folder for the tables (Parquet), locate.json and figures/")
    p.add_argument("--samples", type=_positive_int, default=10, help="noise draws per cell (default: %(default)s)")
    p.add_argument("--noise", type=float, default=3.0,
                   help="noise standard deviation in multiples of the embeddings' (default: %(default)s)")
    p.add_argument("--window", type=_positive_int, default=None,
                   help="layers restored together for FF and attention outputs (default: round(10*L/48), "
                        "ROME's 10 of 48 in proportion)")
    p.add_argument("--seed", type=int, default=0, help="seeds the noise (default: %(default)s)")
    p.add_argument("--candidates", type=_positive_int, default=256,
                   help="memories whose single restoration is measured (default: %(default)s)")
    p.add_argument("--top-memories", type=_positive_int, default=10,
                   help="memories listed and named in the intervene command (default: %(default)s)")
    p.add_argument("--layer", type=_layer_number, default=None,
                   help="trace the memories of this layer (from 1; default: the FF layer with the largest "
                        "indirect effect)")
    p.add_argument("--position", type=int, default=None,
                   help="trace the memories at this token position (from 0; e.g. the subject's last token, "
                        "ROME's early site; default: the one with the largest FF indirect effect)")
    p.add_argument("--dictionary", default=None,
                   help="also trace the latents of this sparse dictionary at the memories' cell, where it has one "
                        "(any path `ffkv index --dictionary` reads); a --run indexed with one traces its latents by "
                        "itself (PATH: where its files lie now, if they moved)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _attribute_parser(sub) -> None:
    """`ffkv attribute`'s arguments."""
    p = sub.add_parser("attribute", help="per-memory attribution of the loss or a token over a corpus, "
                                         "checked against switching memories off",
                       description="Gradient x coefficient and integrated gradients (over the coefficient scale "
                                   "0 to 1, --steps points) of every memory for a target summed over a corpus, "
                                   "Spearman's rank correlation of each with the exact effect of switching memories "
                                   "off (--check of them), and the vocabulary projection of the values' gradients "
                                   "(the Backward Lens) (docs/causal.md, docs/definitions.md).")
    _add_model_options(p)
    _add_corpus_options(p, required=True)
    p.add_argument("--run", default=None, help="attribute in the model of this run (instead of --model)")
    p.add_argument("--target", default="loss",
                   help='"loss" (default), or a token: one token as it reads in text (e.g. " Paris") or its id')
    p.add_argument("--measure", default="logprob", choices=("logprob", "logit"),
                   help="for a token target: its log-probability or its logit (default: %(default)s)")
    p.add_argument("--positions", default="all", choices=("all", "last"),
                   help="every position of each example, or its last (default: %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="integrated-gradients points; 0: none (default: %(default)s)")
    p.add_argument("--check", type=int, default=32,
                   help="memories switched off exactly for the rank correlation; 0: none (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="examples per pass (default: %(default)s)")
    p.add_argument("--top", type=_positive_int, default=10, help="memories printed (default: %(default)s)")
    p.add_argument("--dictionary", default=None,
                   help="also attribute to the latents of this sparse dictionary (any path `ffkv index --dictionary` "
                        "reads); a --run indexed with one attributes to its latents by itself (PATH: where its files "
                        "lie now, if they moved)")
    p.add_argument("--out", required=True, help="folder for attribute_memories.parquet, attribute_lens.parquet "
                                                "(with latents also attribute_latents.parquet and "
                                                "attribute_latent_lens.parquet) and attribute.json")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _tool_model(args: argparse.Namespace):
    """The model of --run (its manifest's id and dtype) or of --model."""
    from ffkv.models import load_model

    if args.run is None:
        return load_model(args.model, dtype=args.dtype, device=args.device)
    from ffkv.store.run import RunDir

    manifest = RunDir(args.run).require_complete()
    return load_model(manifest.model.id, dtype=manifest.model.dtype, device=args.device)


def _tool_latents(args: argparse.Namespace, loaded):
    """The latents a tool reads beside the neurons: those of the dictionary --run was indexed with (from
    --dictionary, if its files moved), else of --dictionary; None without either."""
    from ffkv.memories.sets import Latents

    recorded = None
    if args.run is not None:
        from ffkv.store.run import RunDir

        recorded = RunDir(args.run).manifest().index.get("dictionary")
    if recorded:
        return Latents.of_run(loaded.view, recorded, args.dictionary, args.run)
    if args.dictionary is None:
        return None
    from ffkv.dictionaries import open_dictionary

    return Latents(loaded.view, open_dictionary(args.dictionary))


@command("locate")
def _locate(args: argparse.Namespace) -> int:
    from ffkv.tools.locate import Fact, LocateOptions, locate, read_facts, to_text, write_locate

    if (args.facts is None) == (args.prompt is None):
        raise FfkvError("give --facts FILE.jsonl, or --prompt with --subject")
    if args.prompt is not None and args.subject is None:
        raise FfkvError("--prompt needs --subject (a substring of the prompt)")
    facts = read_facts(args.facts) if args.facts else [Fact(args.prompt, args.subject, args.answer)]
    options = LocateOptions(samples=args.samples, noise=args.noise, window=args.window, seed=args.seed,
                            candidates=args.candidates, top_memories=args.top_memories,
                            layer=None if args.layer is None else args.layer - 1, position=args.position)
    loaded = _tool_model(args)
    options.validate(loaded.view.n_layers)
    tracings = locate(loaded, facts, options, progress=not args.no_progress, latents=_tool_latents(args, loaded))
    for t in tracings:
        print(to_text(t, args.top_memories, args.run))
    write_locate(tracings, args.out, options, loaded.model_id)
    print(f"tables and heatmaps written to {args.out} (figures/locate_fact_I.png)")
    return 0


@command("attribute")
def _attribute(args: argparse.Namespace) -> int:
    from ffkv.corpus import iter_examples
    from ffkv.tools.attribute import AttributeOptions, Target, attribute
    from ffkv.tools.intervene import token_ids

    loaded = _tool_model(args)
    token = None
    if args.target != "loss":
        token = int(args.target) if args.target.strip().isdigit() else token_ids(loaded, [args.target])[0]
    target = Target(token=token, measure=args.measure, positions=args.positions)
    options = AttributeOptions(steps=args.steps, check=args.check, batch_size=args.batch_size)
    spec = _corpus_spec(args, args.corpus)
    result = attribute(loaded, lambda: iter_examples(spec, loaded.tokenizer), target, options,
                       progress=not args.no_progress, total=args.max_examples, corpus=spec.to_dict(),
                       latents=_tool_latents(args, loaded))
    print(result.to_text(args.top))
    result.write(args.out)
    print(f"tables written to {args.out}")
    return 0


@command("analyze")
def _analyze(args: argparse.Namespace) -> int:
    from ffkv.experiments import analyze

    done = analyze(args.run, only=args.only, eval_corpus=args.eval_corpus, eval_split=args.eval_split,
                   n_eval=args.n_eval, projection=args.projection,
                   progress=not args.no_progress, device=args.device, dtype=args.dtype, seed=args.seed,
                   options=_experiment_options(args), dictionary_at=args.dictionary)
    if os.environ.get("RANK", "0") == "0":  # one line for a torchrun job
        ran = [name for name, info in done.items() if not info.get("skipped")]
        print(f"analyses written to {args.run}/metrics and {args.run}/figures: {', '.join(ran) or 'none'}")
        for name, info in done.items():
            if info.get("skipped"):
                print(f"skipped {name}: {info['skipped']}")
    return 0


@command("compare")
def _compare(args: argparse.Namespace) -> int:
    import pandas as pd

    from ffkv.tools.compare import compare_runs
    from ffkv.tools.matches import EXCESS_CUT

    folder = compare_runs(args.run_a, args.run_b, out=args.out, max_examples=args.max_examples, seed=args.seed,
                          device=args.device, progress=not args.no_progress, of=args.of, against=args.against)
    layers = pd.read_parquet(folder / "layers.parquet")
    what = "keys" if args.of == "neurons" else "latents"
    for row in layers.itertuples():
        print(f"layer {row.layer + 1}: {row.universal_share:.2%} of {row.n_keys} {what} with excess correlation > "
              f"{EXCESS_CUT:g} [{row.universal_share_ci_low:.2%}, {row.universal_share_ci_high:.2%}]; mean best "
              f"correlation {row.mean_correlation:.3f}, rotation {row.mean_rotation_correlation:.3f}")
    print(f"written: {folder}/keys.parquet, {folder}/layers.parquet")
    return 0


@command("intervene")
def _intervene(args: argparse.Namespace) -> int:
    from ffkv.api import Run, intervene
    from ffkv.memories.address import edit_ref, parse_edits

    run = Run(args.run)
    edits = parse_edits(args.off, args.scale, args.set_, n_layers=run.n_layers, d_m=run.d_m,
                        latents=run.layout.latents)
    if not edits:
        raise FfkvError("no intervention given: use --off L:K, --scale L:K=FACTOR or --set L:K=VALUE")
    if args.device != "cpu":
        from ffkv.models import load_model

        run = Run(args.run, load_model(run.manifest.model.id, dtype=run.manifest.model.dtype, device=args.device))
    result = intervene(run, set={str(edit_ref(e)): e.value for e in edits if e.op == "set"},
                       off=[str(edit_ref(e)) for e in edits if e.op == "off"],
                       scale={str(edit_ref(e)): e.value for e in edits if e.op == "scale"},
                       eval_corpus=args.eval_corpus, eval_split=args.eval_split, n_eval=args.n_eval,
                       tokens=args.tokens, seed=args.seed, out=args.out, progress=not args.no_progress)
    print(result.to_text())
    if args.out:
        print(f"written: {args.out}")
    return 0


@command("prune")
def _prune(args: argparse.Namespace) -> int:
    from ffkv.tools.prune import prune

    out = prune(args.run, args.criterion, args.share, args.out, seed=args.seed, device=args.device)
    print(f"pruned model written to {out} ({args.criterion}, {args.share:.0%} of each layer's keys removed; "
          "see ffkv_pruning.json there)")
    return 0


@command("annotate")
def _annotate(args: argparse.Namespace) -> int:
    if args.verb == "export":
        from ffkv.tools.annotate import export_sample

        path = export_sample(args.run, args.out, keys_per_layer=args.keys_per_layer, top=args.top, seed=args.seed)
        print(f"sample for annotation written: {path}")
    else:
        from ffkv.tools.annotate import import_labels

        n = import_labels(args.run, args.labels, annotator=args.annotator)
        print(f"imported {n} labels into {args.run}/annotations/labels.parquet")
    return 0


@command("train")
def _train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ffkv.models.train import TrainOptions, train

    options = TrainOptions()
    if args.steps is not None:
        options = replace(options, steps=args.steps)
    if args.seed is not None:
        options = replace(options, seed=args.seed)
    result = train(args.corpus, args.out, options, resume=args.resume, num_threads=args.threads,
                   progress=not args.no_progress, command="ffkv " + " ".join(sys.argv[1:]))
    print(f"held-out perplexity {result['heldout_perplexity']:.2f} "
          f"(unigram baseline {result['unigram_perplexity']:.2f}); model in {args.out}")
    return 0


@command("train-dictionary")
def _train_dictionary(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from ffkv.corpus import iter_examples
    from ffkv.models import load_model
    from ffkv.tools.train_dictionary import TrainDictionaryOptions, train_dictionaries

    if args.split != "train":
        raise FfkvError("train-dictionary trains on the corpus's train split and measures on its held-out split: "
                        "leave --split as it is")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = _layer_list(args.layers)
    options = TrainDictionaryOptions(layers=tuple(dict.fromkeys(layers)), expansion_factor=args.expansion_factor,
                                     k=args.k, skip=args.skip, tokens=args.tokens, batch_size=args.batch_size,
                                     lr=args.lr, seed=args.init_seed, eval_tokens=args.eval_tokens,
                                     save_dtype=args.save_dtype, latents=args.latents)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    spec = _corpus_spec(args, args.corpus)
    if loaded.max_positions is not None and args.max_tokens is None:
        spec = replace(spec, max_tokens=min(spec.max_tokens, loaded.max_positions))
    heldout = replace(spec, split="heldout", max_examples=None, shuffle_seed=None)
    result = train_dictionaries(loaded, lambda: iter_examples(spec, loaded.tokenizer),
                                lambda: iter_examples(heldout, loaded.tokenizer), options, args.out,
                                resume=args.resume, checkpoint_seconds=args.checkpoint_seconds,
                                progress=not args.no_progress, corpus=spec.to_dict(),
                                command="ffkv " + " ".join(sys.argv[1:]))
    print(result.to_text())
    print(f"written: {args.out}/<hookpoint>/ (sparsify layout), {args.out}/fidelity.parquet, {args.out}/training.json")
    return 0


@command("demo")
def _demo(args: argparse.Namespace) -> int:
    from ffkv.demo import run_demo

    run_demo(args.out, n_eval=args.n_eval, progress=not args.no_progress, every_step=args.every_step)
    return 0


def _add_llm_options(p: argparse.ArgumentParser, flag: str) -> None:
    p.add_argument("run", help="a complete run directory")
    p.add_argument(flag, dest="backend", required=True, metavar="BACKEND",
                   help="openai:URL#MODEL (a chat-completions server; key from $FFKV_LLM_API_KEY or "
                        "$OPENAI_API_KEY) or local:PATH (a transformers model directory or a GGUF file)")
    p.add_argument("--concurrency", type=_positive_int, default=4, help="requests at once: to a server in parallel, to a local model as one batch (default: %(default)s)")
    p.add_argument("--timeout", type=_seconds, default=60.0, help="seconds per request (default: %(default)s)")
    p.add_argument("--retries", type=int, default=2, help="retries of a failed request (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="where a local model and the run's model run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the samples and the shuffle (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _layer_list(text: str | None, what: str = "--layers") -> list[int] | None:
    from ffkv.memories.address import whole_number

    if text is None:
        return None
    said = f"{what} takes layers from 1, comma-separated (e.g. 1,15,30): each must be an integer"
    return [whole_number(x, said, text) - 1 for x in text.split(",") if x.strip()]


def _memory_list(text: str | None) -> list:
    """--memories as the library takes it: (layer, key) of a neuron, or a `LatentRef` (tL:J, sL:J); layers from 0.
    Whether they exist is the library's to say, against the run."""
    from ffkv.memories.address import LatentRef, latent_kind, quoted, whole_number

    out: list = []
    said = "--memories takes L:K pairs (layer from 1, key from 0), or tL:J / sL:J for a latent"
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind = latent_kind(item)
        layer, sep, key = (item[1:] if kind else item).partition(":")
        if not sep:
            raise FfkvError(f"{said}, got {quoted(item)}")
        layer, key = (whole_number(part, f"{said}, each number an integer", item) for part in (layer, key))
        pair = (layer - 1, key)
        out.append(LatentRef(*pair, kind) if kind else pair)
    return out


def _run_model(args: argparse.Namespace):
    """The run's model on --device (None on the CPU: the tool loads it itself)."""
    if args.device == "cpu":
        return None
    from ffkv.models import load_model
    from ffkv.store.run import RunDir

    model = RunDir(args.run).require_complete().model
    return load_model(model.id, dtype=model.dtype, device=args.device)


@command("explain")
def _explain(args: argparse.Namespace) -> int:
    from ffkv.tools.explain import explain
    from ffkv.tools.llm_backends import open_backend

    if args.controls < 0:
        raise FfkvError("--controls must be 0 or more")
    backend = open_backend(args.backend, concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
                           device=args.device)
    rows = explain(args.run, backend, layers=_layer_list(args.layers), memories=_memory_list(args.memories),
                   sample=args.sample, controls=args.controls, seed=args.seed, direction=args.direction,
                   latents=args.latents, projection=args.projection,
                   loaded=_run_model(args), progress=not args.no_progress)
    spent = int(rows["prompt_tokens"].sum() + rows["completion_tokens"].sum()) if len(rows) else 0
    print(f"explanations written: {len(rows)} rows in {args.run}/metrics/explanations.parquet "
          f"({spent:,} tokens spent in all)")
    return 0


@command("score")
def _score(args: argparse.Namespace) -> int:
    from ffkv.tools.llm_backends import open_backend
    from ffkv.tools.score import score

    backend = open_backend(args.backend, concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
                           device=args.device)
    _, layers = score(args.run, backend, top_examples=args.top_examples, random_examples=args.random_examples,
                      seed=args.seed, layers=_layer_list(args.layers), loaded=_run_model(args),
                      progress=not args.no_progress)
    several = layers["explainer"].nunique() > 1
    for r in layers.itertuples():
        by = f" by {r.explainer}" if several else ""
        print(f"layer {r.layer + 1}{by}: score {r.score:.3f} [{r.score_ci_low:.3f}, {r.score_ci_high:.3f}] "
              f"(n {r.n_score}); shuffled {r.shuffled:.3f} [{r.shuffled_ci_low:.3f}, {r.shuffled_ci_high:.3f}]; "
              f"own - shuffled {r.score_minus_shuffled:.3f} [{r.score_minus_shuffled_ci_low:.3f}, "
              f"{r.score_minus_shuffled_ci_high:.3f}]; "
              f"control {r.control:.3f} [{r.control_ci_low:.3f}, {r.control_ci_high:.3f}] (n {r.n_control})")
    from ffkv.experiments.explanations import LATENTS
    from ffkv.store.run import RunDir

    run = RunDir(args.run)
    latents = run.read_metric(LATENTS) if run.has_metric(LATENTS) else None
    for r in (latents.itertuples() if latents is not None else ()):
        by = f" by {r.explainer}" if several or latents["explainer"].nunique() > 1 else ""
        print(f"layer {r.layer + 1} latents ({r.dictionary}){by}: score {r.score_latents:.3f} "
              f"[{r.score_latents_ci_low:.3f}, {r.score_latents_ci_high:.3f}] (n {r.n_score_latents}); shuffled "
              f"{r.shuffled_latents:.3f}; control latents {r.control_latents:.3f} (n {r.n_control_latents}); own - "
              f"shuffled, latents minus neurons {r.excess_latents_minus_neurons:+.3f} "
              f"[{r.excess_latents_minus_neurons_ci_low:+.3f}, {r.excess_latents_minus_neurons_ci_high:+.3f}]")
    print(f"scores written: {args.run}/metrics/explanation_scores.parquet and explanation_scores_by_layer.parquet"
          + (" and explanation_scores_latents.parquet" if latents is not None else ""))
    return 0


@command("report")
def _report(args: argparse.Namespace) -> int:
    from ffkv.report import write_report

    print(f"report written: {write_report(args.run, explorer_url=args.explorer_url)}")
    return 0


@command("serve")
def _serve(args: argparse.Namespace) -> int:
    from ffkv.explorer import serve

    if args.no_token and args.token:
        raise FfkvError("give --token or --no-token, not both")
    serve(args.run, host=args.host, port=args.port, allow_hosts=tuple(args.allow_host), token=args.token,
          require_token=False if args.no_token else None, dictionary_at=args.dictionary,
          stop_process_on_signal=args.whole_process)
    return 0


@command("status")
def _status(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ffkv.dictionaries import file_problems
    from ffkv.store.state import run_state

    code = 0
    for path in args.runs:
        state = run_state(path, verify=args.verify)
        recorded = state.manifest.index.get("dictionary")
        if state.status == "complete" and recorded:
            state = replace(state, problems=[*state.problems, *file_problems(recorded, args.verify)],
                            dictionary_verified=args.verify)
        print("\n".join(state.lines()), flush=True)
        if state.damaged:
            code = DamagedRun.exit_code
    return code


@command("index")
def _index(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ffkv.indexing.distributed import build_index_distributed
    from ffkv.indexing.excluded import sentence as excluded_sentence
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
    from ffkv.indexing.preflight import check_output, fit_positions
    from ffkv.models import load_model
    from ffkv.parallel import launched_by_torchrun, local_device

    spec = _corpus_spec(args, args.corpus)
    controls = {} if args.control_keys is None else {"control_keys": args.control_keys}
    options = IndexOptions(top_k=args.top_k, mode=args.mode, sign=args.sign, control_seed=args.control_seed, **controls)
    batching = BatchOptions(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
                            checkpoint_seconds=args.checkpoint_seconds, tokenizer_workers=args.tokenizer_workers)
    options.validate()
    batching.validate()
    check_output(Path(args.out))  # before the model loads: a run that cannot be written stops at once
    dictionary = None
    if args.dictionary is not None:  # a damaged file stops before the model loads too
        from ffkv.dictionaries import open_dictionary
        dictionary = open_dictionary(args.dictionary)
    loaded = load_model(args.model, dtype=args.dtype, device=local_device(args.device))
    spec = fit_positions(loaded, spec, strict=args.max_tokens is not None)
    if launched_by_torchrun():
        run = build_index_distributed(loaded, spec, args.out, options, batching, resume=args.resume,
                                      progress=not args.no_progress, dictionary=dictionary)
    else:
        run = build_index(loaded, spec, args.out, options, batching, resume=args.resume,
                          progress=not args.no_progress, shard=args.shard, dictionary=dictionary)
    manifest = run.manifest()
    if launched_by_torchrun() and os.environ.get("RANK", "0") != "0":
        return 0
    print(f"indexed {manifest.counts['examples']:,} examples ({manifest.counts['tokens']:,} tokens) "
          f"in {manifest.timings['index_seconds']:.1f} s -> {run.path}")
    left_out = excluded_sentence(manifest)
    if left_out:
        print(left_out)
    return 0


@command("merge")
def _merge(args: argparse.Namespace) -> int:
    from ffkv.indexing.merge import merge_runs

    run = merge_runs(args.shards, args.out)
    counts = run.manifest().counts
    print(f"merged {len(args.shards)} shards: {counts['examples']:,} examples -> {run.path}")
    return 0


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; an unknown option is refused by its own command's parser (its usage, not the
    top level's), with the nearest option it has: ``--top_k`` -> did you mean --top-k?"""
    args, extras = parser.parse_known_args(argv)
    if not extras:
        return args
    chosen = parser
    for dest in ("command", "verb"):  # down the subcommands the line named
        sub = next((a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, dest, None) not in sub.choices:
            break
        chosen = sub.choices[getattr(args, dest)]
    options = [o for a in chosen._actions for o in a.option_strings]
    unknown = next((e for e in extras if e.startswith("-")), extras[0])
    typed = unknown.split("=", 1)[0]
    near = [typed.replace("_", "-")] if typed.replace("_", "-") in options else \
        difflib.get_close_matches(typed, options, n=1, cutoff=0.6)
    # ArgumentParser.error prints the command's usage and the message, and exits with status 2.
    return chosen.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {near[0]}?)" if near else ""))


@contextlib.contextmanager
def _progress_bars(show: bool):
    """With --no-progress, no bar at all: also those of transformers (\"Loading weights\"), huggingface_hub and
    datasets, which read these variables when first imported, or are told directly when imported already."""
    if show:
        yield
        return
    names = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "1" for name in names})
    hf_logging = sys.modules.get("transformers.utils.logging")
    was_on = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if was_on:
            hf_logging.enable_progress_bar()


def main(argv: Sequence[str] | None = None, whole_process: bool = False) -> int:
    """Entry point of the `ffkv` command. `whole_process`: it is the whole process (`console`): the thread pools
    are sized for the machine found (`ffkv.threads`) where the command does model work, and `ffkv serve` ends the
    process at once on Ctrl-C; called in-process without it, only ``--threads`` sizes them, and the count is
    restored when the command ends."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    analyzing = command == "analyze"
    if command in PLUGIN_COMMANDS:
        from ffkv.experiments.registry import load_plugin

        try:
            for path in _plugins_named(argv):  # the user's own code, named on this command line
                load_plugin(path)
        except FfkvError as exc:
            print(f"ffkv: error: {exc}", file=sys.stderr)
            return exc.exit_code
    parser = build_parser(experiments=analyzing)
    args = _parse(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    undo_threads = lambda: None  # noqa: E731
    with warnings.catch_warnings(record=True) as caught, _progress_bars(not getattr(args, "no_progress", False)), \
            command_line():
        warnings.simplefilter("always", FfkvWarning)
        try:
            args.whole_process = whole_process
            if args.command not in NO_THREADS and (whole_process or args.threads is not None):
                undo_threads = threads.apply(threads.choose(args.threads))
            code = COMMANDS[args.command](args)
        except FfkvError as exc:
            print(f"ffkv: error: {exc}", file=sys.stderr)
            code = exc.exit_code
        except BrokenPipeError:  # the reader of the output went away (`ffkv status RUN | head -1`)
            _quiet_stdout()
            code = 141
        except OSError as exc:  # the disk, not the input: full, read-only, no permission
            print(f"ffkv: error: {one_line(exc)}", file=sys.stderr)
            code = StorageError.exit_code
        except KeyboardInterrupt as exc:
            said = str(exc) if isinstance(exc, Interrupted) else "interrupted"
            print(f"\nffkv: {said}", file=sys.stderr)
            code = 130
        finally:
            if not whole_process:
                undo_threads()
            for w in caught:
                if issubclass(w.category, FfkvWarning):
                    print(f"ffkv: warning: {w.message}", file=sys.stderr)
    return code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (a test's capture)
        pass


def console() -> int:
    """The `ffkv` executable (and `python -m ffkv.cli`): `main` in a process whose allocator keeps
    freed memory for reuse (`ffkv.allocator`); called in-process, `main` leaves the allocator alone."""
    keep_freed_memory()
    return main(whole_process=True)


if __name__ == "__main__":
    sys.exit(console())
