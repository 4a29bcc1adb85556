"""`layerbus wire-quality`: what each wire codec costs in quality on a model, teacher-forced over a
corpus against the float32 wire (mean KL divergence, same top token, perplexity change), at the
cuts of a plan; `--save` keeps the table for `--wire auto`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_model, command_parser, non_negative_int, positive_int, resolve_model

CODECS = ("float16", "bfloat16", "int8", "int4")  # each against float32, the reference


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "wire-quality", main, help="measure what each wire codec costs in quality",
                        description="Teacher-forced over a corpus, the model split at the cuts of a plan, "
                                    "each codec round-trips the hidden states at every cut; compared with "
                                    "the float32 wire on the same prompts: mean KL divergence, same top "
                                    "token %%, perplexity change.") as parser:
        add_model(parser, "Hugging Face model directory (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--corpus", metavar="PATH", type=Path, default=None,
                            help="a folder of .txt documents (rendered as summarize prompts) or a plain-text file "
                                 "(default: the bundled sample corpus as summarize prompts)")
        parser.add_argument("--cuts", metavar="L[,L...]", default=None,
                            help="layer indices where one stage hands over to the next (default: every boundary of "
                                 "the balanced plan for --stages)")
        parser.add_argument("--stages", metavar="N", type=positive_int, default=3,
                            help="plan whose boundaries are the default cuts (default: 3)")
        parser.add_argument("--codecs", metavar="C[,C...]", default=",".join(CODECS),
                            help=f"codecs to measure (default: {','.join(CODECS)})")
        parser.add_argument("--documents", metavar="N", type=non_negative_int, default=0,
                            help="score only the first N documents (default: 0 = all)")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument("--save", action="store_true",
                            help="also save the table where `--wire auto` looks for this model's")


def main(args: argparse.Namespace) -> int:
    from layerbus.planner.wire_choice import saved_table_path
    from layerbus.jobs.corpus import SAMPLE_CORPUS, corpus_prompts
    from layerbus.models.model_info import load_tokenizer, read_model_info
    from layerbus.stages.wire_quality import quality_report
    from layerbus.wire.codecs import CODEC_NAMES

    model_dir = resolve_model(args.model)
    config = read_model_info(model_dir).files.config
    cuts = plan_cuts(args, config)
    codec_names = tuple(name.strip() for name in args.codecs.split(","))
    bad = [name for name in codec_names if name not in CODEC_NAMES]
    if bad:
        raise UsageError(f"--codecs: {', '.join(bad)} not among {', '.join(CODEC_NAMES)}")
    if args.corpus is not None and not args.corpus.exists():
        raise UsageError(f"--corpus {args.corpus}: no such file or folder")

    def progress(done: int, total: int) -> None:
        print(f"\rlayerbus wire-quality: {done}/{total} prompts", end="", file=sys.stderr, flush=True)

    prompts = corpus_prompts(load_tokenizer(model_dir), args.corpus)
    if args.documents:
        prompts = prompts[:args.documents]
    report = quality_report(model_dir, prompts, str(args.corpus or SAMPLE_CORPUS), cuts, codec_names,
                            progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.save:
        path = saved_table_path(model_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"layerbus wire-quality: saved for --wire auto in {path}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else quality_table(report))
    return EXIT_OK


def plan_cuts(args: argparse.Namespace, config) -> list[int]:
    """--cuts as given, else the boundaries of the balanced plan for --stages (also `layerbus quality`'s)."""
    from layerbus.planner.partition import balanced_partition, model_cost_from_config

    if args.cuts:
        try:
            cuts = [int(part) for part in args.cuts.split(",")]
        except ValueError:
            raise UsageError(f"--cuts {args.cuts}: give layer indices separated by commas, e.g. --cuts 10,20") from None
    else:
        if args.stages < 2 or args.stages > config.num_hidden_layers:
            raise UsageError(f"--stages {args.stages}: need 2 to {config.num_hidden_layers} stages for a cut")
        spans = balanced_partition(model_cost_from_config(config), args.stages)
        cuts = [span.start for span in spans[1:]]
    bounds = [0, *cuts, config.num_hidden_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise UsageError(f"--cuts {cuts}: need strictly increasing layer indices between 1 and "
                         f"{config.num_hidden_layers - 1}")
    return cuts


def quality_table(report: dict) -> str:
    first = next(iter(report["codecs"].values()), {})
    lines = [f"{report['model']}: {report['prompts']} prompts, {first.get('positions', 0)} positions scored, cuts "
             f"{report['cuts']}; float32 wire perplexity {first.get('ppl_float32', 0):.3f}",
             "codec     bytes/hop  mean KL    max KL    same top  PPL change"]
    for name, q in report["codecs"].items():
        lines.append(f"{name:<9} {q['bytes_ratio']:>8.3f}x  {q['mean_kl']:<9.2e}  {q['max_kl']:<8.2e}  "
                     f"{q['same_top']:>7.2%}  {q['ppl_change']:>+9.3%}")
    return "\n".join(lines)
