"""The `opd` command line: one entry point, one small function per subcommand.

Each command's function imports its module lazily, so `opd --help` and `opd validate` start fast and never
pull in torch or Ray. A user error (`OpdError`) is printed as `error: ...` lines and exits 2; a traceback only
ever means a bug in this project.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from opd.errors import OpdError

if TYPE_CHECKING:
    from opd.spec import ExperimentSpec


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, --set and --no-path-check: shared by every command that runs from a spec."""
    parser.add_argument("config", metavar="CONFIG", help="YAML experiment spec, e.g. configs/tiny.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, value parsed as YAML (repeatable), e.g. --set optim.lr=1e-4")
    parser.add_argument("--no-path-check", action="store_true",
                        help="do not require model and data paths to exist (e.g. validating a cluster config)")


def _load(args: argparse.Namespace) -> ExperimentSpec:
    from opd.spec import load_spec

    return load_spec(args.config, args.overrides, check_paths=not args.no_path_check)


def _validate(args: argparse.Namespace) -> int:
    """With path checks, also everything `opd train` checks before it starts (opd/commands/preflight.py): a spec that
    validates does not then fail on its inputs. Derived fields are printed resolved (opd/commands/validate.py)."""
    from opd.commands.validate import resolved_yaml, run_length

    spec = _load(args)
    if not args.no_path_check:
        from opd.commands.preflight import check_inputs
        from opd.run_dir import writable_problem

        if problem := writable_problem(spec.run_dir):
            raise OpdError(problem)
        first = check_inputs(spec)
    sys.stdout.write(resolved_yaml(spec) + run_length(spec))
    if not args.no_path_check:  # what the target sees, as YAML comments so the output stays a loadable spec
        sys.stdout.write(f"# the first training prompt as the target sees it (data.render: {spec.data.render}, "
                         f"{len(first.ids)} tokens; the target writes on from the end of the last line):\n")
        sys.stdout.write("".join(f"#   {line}\n" for line in first.text.split("\n")))
    return 0


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--draft", metavar="PATH", help="drafter dir in its family's public format, or 'random' "
                        "(default: models.drafter_path)")
    parser.add_argument("--prompts", metavar="FILE", help="jsonl prompts (default: data.eval_prompts)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--samples", metavar="FILE", help="offline: rebuild the drafter's blocks on these stored "
                        "target samples (opd gen-samples --eval) instead of decoding (default: eval.samples_path)")


def _is_drafter(path: str) -> bool:
    """Whether `path` holds a drafter of a registered family (anything else is left to the command's own checks,
    which name --draft)."""
    import json

    from opd.formats import detect_section

    try:
        return detect_section(json.loads(Path(path, "config.json").read_text())) is not None
    except (OSError, ValueError):
        return False


def _eval(args: argparse.Namespace) -> int:
    """`--draft` is the drafter the spec describes, in place of the config's warm one, before the spec's family
    checks read it (a P-EAGLE --draft on a DFlash config, with models.drafter.kind set to match)."""
    from opd.eval.online import run_eval

    if args.draft and _is_drafter(args.draft):  # the spec then describes --draft's checkpoint
        args.overrides = [f"models.drafter_path={args.draft}", "models.drafter={}", *(args.overrides or [])]
    elif args.draft == "random":  # a fresh drafter of the spec's section replaces the warm one, unread
        args.overrides = ["models.drafter_path=", *(args.overrides or [])]
    return run_eval(_load(args), args.draft, args.prompts, args.json, args.samples)


def _gap_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--draft", dest="drafts", action="append", required=True, metavar="[LABEL=]PATH",
                        help="a drafter dir to diagnose (repeatable)")
    parser.add_argument("--samples", metavar="FILE", help="held-out target samples (default: eval.samples_path)")
    parser.add_argument("--json", metavar="OUT", help="also write the tables as JSON")


def _gap(args: argparse.Namespace) -> int:
    from opd.commands.gap import run_gap
    from opd.commands.suite import parse_drafts

    return run_gap(_load(args), parse_drafts(args.drafts), args.samples, args.json)


def _train(args: argparse.Namespace) -> int:
    from opd.commands.run import run_train

    return run_train(_load(args))


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--out", metavar="DIR", help="where to save the drafter (default: RUN_DIR/drafter)")


def _sft(args: argparse.Namespace) -> int:
    from opd.train.sft import run_sft

    return run_sft(_load(args), args.out)


def _run(args: argparse.Namespace) -> int:
    from opd.commands.run import run_main

    return run_main(_load(args))


def _reproduce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="YAML reproduce spec, e.g. configs/reproduce/tiny.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a top-level field (repeatable), e.g. --set seeds=[0] --set opd_steps=20")


def _reproduce(args: argparse.Namespace) -> int:
    from opd.reproduce import run_reproduce

    return run_reproduce(args.config, args.overrides)


def _build_tiny_arguments(parser: argparse.ArgumentParser) -> None:
    """The builder parses its own options (--steps, --out-dir, ...): they are forwarded untouched."""
    parser.set_defaults(forwards_options=True)


def _build_tiny(args: argparse.Namespace) -> int:
    from opd.tiny.build import main as build_tiny

    return build_tiny(args.forwarded)


def _gen_sft_data_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf (the default): batched decoding in this process; vllm: vLLM's offline engine (GPU "
                             "extra)")
    parser.add_argument("--out", metavar="FILE",
                        help="jsonl to write (default: sft.samples_path, else RUN_DIR/sft_data.jsonl, where opd "
                             "sft reads)")


def _gen_sft_data(args: argparse.Namespace) -> int:
    """An alias of `opd gen-samples --sft`: hf is the autoregressive sampler."""
    from opd.commands.gen_samples import run_gen_samples
    from opd.outputs import check_output_file

    if args.out:
        check_output_file(args.out, "--out", "the SFT data")
    engine = "autoregressive" if args.engine == "hf" else args.engine
    return run_gen_samples(_load(args), engine, 1, args.out, purpose="sft")


def _gen_samples_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--engine", choices=("speculative", "autoregressive", "vllm"), default=None,
                        help="the target sampler (default: rollout.sampler); all are lossless")
    parser.add_argument("--samples", type=int, default=1, metavar="N",
                        help="samples per prompt at each sampled rollout setting (default 1; greedy ones get 1)")
    parser.add_argument("--out", metavar="FILE", help="jsonl to write or finish (default: rollout.samples_path, "
                        "else RUN_DIR/samples.jsonl; with --eval RUN_DIR/eval_samples.jsonl; with --sft "
                        "sft.samples_path, else RUN_DIR/sft_data.jsonl)")
    purpose = parser.add_mutually_exclusive_group()
    purpose.add_argument("--eval", action="store_true",
                         help="held-out prompts at every point-mass eval setting, for offline evaluation")
    purpose.add_argument("--sft", action="store_true",
                         help="one response per training prompt at the SFT setting: the data opd sft trains on")
    parser.add_argument("--prompts", metavar="FILE", help="with --eval: another held-out prompt family")


def _gen_samples(args: argparse.Namespace) -> int:
    from opd.commands.gen_samples import run_gen_samples
    from opd.outputs import check_output_file

    if args.prompts and not args.eval:
        raise OpdError("--prompts: only with --eval (training samples are of data.train_prompts)")
    if args.out:
        check_output_file(args.out, "--out", "the SFT data" if args.sft else "the target samples")
    purpose = "eval" if args.eval else "sft" if args.sft else "rollout"
    return run_gen_samples(_load(args), args.engine, args.samples, args.out, purpose=purpose,
                           prompts_file=args.prompts)


def _import_samples_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSONL logs of served chat completions")
    parser.add_argument("--config", required=True, metavar="SPEC",
                        help="the spec whose target, tokenizer, rendering and rollout.max_new_tokens the rows must fit")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field of SPEC (repeatable)")
    parser.add_argument("--out", required=True, metavar="FILE", help="the sample rows to write (jsonl)")
    parser.add_argument("--prompts-out", metavar="FILE",
                        help="the prompts the rows name (default: FILE with the suffix .prompts.jsonl)")
    parser.add_argument("--format", choices=("openai", "vllm", "plain"), default=None,
                        help="the logs' format (default: detected per file from its first row)")
    parser.add_argument("--model", help="import only rows served by this model (the log's `model` field)")
    parser.add_argument("--temperature", type=float, help="the setting of rows whose request names none")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature (default 0: off)")


def _import_samples(args: argparse.Namespace) -> int:
    from opd.commands.import_samples import run_import_samples
    from opd.outputs import check_output_file
    from opd.spec import load_spec

    check_output_file(args.out, "--out", "the imported samples")
    sampling = None if args.temperature is None else {"temperature": args.temperature, "top_p": args.top_p,
                                                      "top_k": args.top_k}
    return run_import_samples(load_spec(args.config, args.overrides), args.logs, args.out, args.prompts_out,
                              args.format, args.model, sampling)


def _prompt_pool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="writes prompts.jsonl, eval_prompts.jsonl and card.json there")
    parser.add_argument("--file", dest="files", action="append", default=[], metavar="SOURCE=PATH",
                        help="a source (gsm8k, math, aops, codealpaca) from a local jsonl/json/parquet in its "
                             "dataset's columns (repeatable; default: the hub through `datasets`)")
    parser.add_argument("--math500", metavar="PATH", help="the MATH-500 problems to leave out of MATH "
                                                          "(default: HuggingFaceH4/MATH-500 from the hub)")
    parser.add_argument("--count", dest="counts", action="append", default=[], metavar="SOURCE=N",
                        help="a source's count (the paper's: gsm8k 2000, math 5000, aops 4000, codealpaca 5000)")
    parser.add_argument("--heldout", type=int, default=50, metavar="N", help="held-out prompts per source (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")


def _prompt_pool(args: argparse.Namespace) -> int:
    from opd.data.pool import run_prompt_pool

    return run_prompt_pool(args.out, args.files, args.counts, args.math500, args.heldout, args.seed)


def _serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    _spec_arguments(parser)
    parser.add_argument("--draft", metavar="DIR", action="append", required=True,
                        help="exported drafter directory, of any family (repeatable)")
    parser.add_argument("--concurrency", default="1,4,8,16,32", metavar="N,N,...",
                        help="requests in flight, one measurement per level (default: 1,4,8,16,32)")
    parser.add_argument("--no-baseline", action="store_true", help="skip serving the target alone (no speedup column)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")


def _serve_bench(args: argparse.Namespace) -> int:
    from opd.commands.serve_bench import run_serve_bench

    return run_serve_bench(_load(args), args.draft, args.concurrency, args.json, baseline=not args.no_baseline)


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a drafter directory of any family: a run's "
                        "checkpoints/step-N, an opd sft output or an exported drafter")
    parser.add_argument("--to", required=True, choices=("public", "speculators", "target", "zlab"),
                        help="public: the family's own public layout (z-lab's for DFlash and DFlash 2, SpecForge's "
                             "for EAGLE-3); speculators: vLLM's speculators layout (every family); target: an MTP "
                             "head in the target's own layout, its files linked (vLLM serves --out as the model); "
                             "zlab: the old name of public, kept as an alias")
    parser.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory to write it to")
    parser.add_argument("--target", metavar="PATH", help="the target model's directory (default: the spec's "
                        "models.target_path, else the one the checkpoint's run recorded)")
    parser.add_argument("--config", metavar="SPEC", help="a spec to take the target and models.drafter from")


def _export(args: argparse.Namespace) -> int:
    from opd.commands.export import run_export

    return run_export(args.checkpoint, "public" if args.to == "zlab" else args.to, args.out, args.target,
                      args.config)


def _suite_arguments(parser: argparse.ArgumentParser) -> None:
    """`opd suite build` and `opd suite eval`, as subcommands of their own."""
    sub = parser.add_subparsers(dest="suite_command", required=True, metavar="SUBCOMMAND")
    build_help = "write a suite's prompt files (one per benchmark) and its card"
    build = sub.add_parser("build", help=build_help, description=build_help)
    build.add_argument("--suite", required=True, metavar="NAME",
                       help="configs/suites/NAME.yaml (paper, tiny) or a suite YAML's path")
    build.add_argument("--out", required=True, metavar="DIR", help="writes <benchmark>.jsonl and card.json there")
    build.add_argument("--file", dest="files", action="append", default=[], metavar="BENCH=PATH",
                       help="a benchmark's source from a local jsonl/json/parquet in the source's own columns "
                            "(repeatable; default: an installed package's file, else the hub through `datasets`)")
    eval_help = "τ of each drafter per benchmark and setting, beside the ceiling"
    evaluate = sub.add_parser("eval", help=eval_help, description=eval_help)
    _spec_arguments(evaluate)
    evaluate.add_argument("--suite", required=True, metavar="DIR", help="a directory `opd suite build` wrote")
    evaluate.add_argument("--draft", dest="drafts", action="append", required=True, metavar="[LABEL=]PATH",
                          help="a drafter directory, or random (repeatable; the label names its table row)")
    evaluate.add_argument("--out", metavar="DIR", help="samples, table.md, suite.json, tau.png and the MLflow "
                                                       "store (default: SUITE/results/<experiment name>-<digest of "
                                                       "the target, tokenizer and rendering>)")
    evaluate.add_argument("--no-mlflow", action="store_true", help="do not log an MLflow run")
    evaluate.add_argument("--speedup-prompts", type=int, default=0, metavar="N",
                          help="decode each drafter and the target alone on each benchmark's first N prompts for "
                               "the speedup column (default 0: τ only)")


def _suite(args: argparse.Namespace) -> int:
    from opd.commands.suite import run_suite_build, run_suite_eval

    if args.suite_command == "build":
        return run_suite_build(args.suite, args.out, args.files)
    if args.speedup_prompts < 0:
        raise OpdError(f"--speedup-prompts: {args.speedup_prompts} (expected 0 or more prompts per benchmark)")
    return run_suite_eval(_load(args), args.suite, args.drafts, args.out, track=not args.no_mlflow,
                          speedup_prompts=args.speedup_prompts)


# name -> (one-line help, argument setup, handler); each handler imports its module inside the function.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "validate": ("check a spec and print it fully resolved as YAML", _spec_arguments, _validate),
    "eval": ("measure τ, acceptance and speedup of a drafter on held-out prompts", _eval_arguments, _eval),
    "run": ("the main job: τ of the warm drafter, Draft-OPD training, τ after, plot and MLflow run",
            _spec_arguments, _run),
    "train": ("train a drafter with Draft-OPD (engine local or ray); resumes from the last checkpoint",
              _spec_arguments, _train),
    "sft": ("SFT a drafter on target responses (the warm start, or continued SFT with sft.max_flops)",
            _sft_arguments, _sft),
    "reproduce": ("the paper's claims in miniature: every arm from the warm drafter at matched FLOPs, over seeds",
                  _reproduce_arguments, _reproduce),
    "build-tiny": ("rebuild the shipped tiny target (tokenizer, prompts, weights, card); resumable",
                   _build_tiny_arguments, _build_tiny),
    "gen-sft-data": ("the SFT data: an alias of `opd gen-samples --sft` (hf or vLLM); resumable",
                     _gen_sft_data_arguments, _gen_sft_data),
    "prompt-pool": ("build the paper's prompt pool (GSM8K, MATH without MATH-500, AoPS, CodeAlpaca) with its card",
                    _prompt_pool_arguments, _prompt_pool),
    "gen-samples": ("draw target samples into the sample store: rollouts (every rollout setting), --eval (held-out "
                    "prompts) or --sft (the SFT data)", _gen_samples_arguments, _gen_samples),
    "import-samples": ("served chat completions (OpenAI-style, vLLM with token ids, or plain rows) into the sample "
                       "store, so a run trains on the traffic you serve with no decoding", _import_samples_arguments,
                       _import_samples),
    "gap": ("where each drafter loses to the ceiling (the argmax oracle), slot by slot, on stored held-out samples",
            _gap_arguments, _gap),
    "export": ("write a drafter in the layout vLLM serves (z-lab's or speculators'), print the speculative_config "
               "to serve it with and the command that checks it in the client's code", _export_arguments, _export),
    "serve-bench": ("serve the target with each exported drafter in vLLM: tokens/s, τ and speedup per concurrency",
                    _serve_bench_arguments, _serve_bench),
    "suite": ("benchmark suites: build the prompt files (GSM8K, MATH-500, AIME, MBPP, HumanEval, MT-Bench), then "
              "the paper's τ table of several drafters with the ceiling", _suite_arguments, _suite),
}


def build_parser() -> argparse.ArgumentParser:
    """The `opd` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="opd", description="Draft-OPD: on-policy distillation of speculative-decoding drafters (DFlash, DFlash 2, "
                                "DSpark, XPress, EAGLE-3, P-EAGLE, MTP heads).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in COMMANDS.items():
        forwards = add_arguments is _build_tiny_arguments
        command = sub.add_parser(name, help=help_text, description=help_text, add_help=not forwards)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `opd` command; returns the process exit code."""
    parser = build_parser()
    args, forwarded = parser.parse_known_args(argv)
    if forwarded and not getattr(args, "forwards_options", False):
        parser.error(f"unrecognized arguments: {' '.join(forwarded)}")
    args.forwarded = forwarded
    try:
        return args.handler(args)
    except OpdError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
