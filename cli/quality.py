"""`layerbus quality`: what each weight format and wire codec pair costs in quality against the
unquantized model (float32 weights, float32 wire), teacher-forced over a corpus: mean KL divergence,
same top token, top-5 overlap and perplexity change (stages/quality.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_model, command_parser, non_negative_int, positive_int, resolve_model

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "native")
WIRES = ("float32", "float16", "bfloat16", "int8", "int4")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "quality", main,
                        help="measure what each weight format and wire codec costs in quality",
                        description="Teacher-forced over CORPUS, the model split at the cuts of a plan, "
                                    "once per weight format (loaded as a stage loads it) and wire codec "
                                    "(round-tripping the hidden states at every cut); each pair against "
                                    "float32 weights on the float32 wire: mean KL divergence, same top "
                                    "token, top-5 overlap, perplexity change.") as parser:
        parser.add_argument("corpus", metavar="CORPUS", nargs="?", type=Path, default=None,
                            help="a folder of .txt documents (rendered as summarize prompts) or a plain-text file "
                                 "(default: the bundled sample corpus)")
        add_model(parser, "Hugging Face model directory (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--weights", metavar="F[,F...]", default=",".join(FORMATS),
                            help=f"weight formats to measure (default: {','.join(FORMATS)})")
        parser.add_argument("--wire", metavar="C[,C...]", default=",".join(WIRES),
                            help=f"wire codecs to measure (default: {','.join(WIRES)})")
        parser.add_argument("--cuts", metavar="L[,L...]", default=None,
                            help="layer indices where one stage hands over to the next (default: the balanced plan's "
                                 "for --stages)")
        parser.add_argument("--stages", metavar="N", type=positive_int, default=3,
                            help="plan whose boundaries are the default cuts (default: 3)")
        parser.add_argument("--documents", metavar="N", type=non_negative_int, default=0,
                            help="score only the first N documents (default: 0 = all)")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    from layerbus.cli.wire_quality import plan_cuts
    from layerbus.jobs.corpus import SAMPLE_CORPUS, corpus_prompts
    from layerbus.models.model_info import load_tokenizer, read_model_info
    from layerbus.stages.quality import quality_report
    from layerbus.wire.codecs import CODEC_NAMES

    model_dir = resolve_model(args.model)
    config = read_model_info(model_dir).files.config
    formats = _names(args.weights, FORMATS, "--weights")
    wires = _names(args.wire, CODEC_NAMES, "--wire")
    cuts = plan_cuts(args, config)
    if args.corpus is not None and not args.corpus.exists():
        raise UsageError(f"CORPUS {args.corpus}: no such file or folder")
    prompts = corpus_prompts(load_tokenizer(model_dir), args.corpus)
    if args.documents:
        prompts = prompts[:args.documents]

    def progress(done: int, total: int) -> None:
        print(f"\rlayerbus quality: {done}/{total} prompts", end="", file=sys.stderr, flush=True)

    report = quality_report(model_dir, prompts, str(args.corpus or SAMPLE_CORPUS), cuts, formats, wires,
                            progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else quality_table(report))
    return EXIT_OK


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    bad = [name for name in names if name not in known]
    if bad or not names:
        raise UsageError(f"{flag}: {', '.join(bad) or 'nothing given'}: choose among {', '.join(known)}")
    return names


def quality_table(report: dict) -> str:
    """The pairs as a Markdown table (the README's is this command's output)."""
    first = report["pairs"][0] if report["pairs"] else {}
    lines = [f"{report['model']}: {report['prompts']} prompts, {first.get('positions', 0)} positions scored, cuts "
             f"{report['cuts']}; against fp32 weights on the float32 wire (perplexity "
             f"{first.get('ppl_reference', 0):.3f})", "",
             "| weights | wire | mean KL | max KL | same top | top-5 overlap | PPL change |",
             "|---|---|---|---|---|---|---|"]
    for q in report["pairs"]:
        lines.append(f"| {q['weights']} | {q['wire']} | {q['mean_kl']:.4f} | {q['max_kl']:.3f} | {q['same_top']:.1%} "
                     f"| {q['top5']:.1%} | {q['ppl_change']:+.2%} |")
    return "\n".join(lines)
