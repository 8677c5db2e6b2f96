"""The `fw` command line (also `python -m framework`).

Commands that read a config take `--config FILE` (repeatable, merged left to right) and dotted
overrides `--section.key=value`. User errors print one line each on stderr and exit with code 2;
`--debug` (or FW_DEBUG=1) adds the traceback. An error that every process of a multi-process `fw fit`
raises together (`FwError.quiet` on ranks other than global rank 0) is printed by global rank 0 alone; one that a
single process raises, by that process alone, as `global rank N: ...`, the others ending at once with the same exit
code (framework.callbacks.StopEveryRankOnError).
`fw fit` stopped by SIGTERM / SIGINT / SIGUSR1 exits with 143 / 130 / 138 after saving its step
(framework/signals.py).
Each command imports only what it needs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from framework.config import dump_config, load_config, schema_path, schema_text
from framework.errors import ConfigError, FwError
from framework.imports import built_once
from framework.signals import Stopped

# Commands whose leftover `--a.b=v` arguments are config overrides.
_WITH_CONFIG = ("fit", "validate", "print-config", "generate", "plan", "eval")


def _reference() -> str:
    return (f"Config reference: the JSON Schema {os.path.realpath(schema_path())} (print it with `fw schema`); "
            "`fw print-config --config FILE` shows every resolved value.")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as every other user error of fw is, instead of the usage
    text followed by the error; the line names the command's --help, where the usage is."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)


def _usage_error(prog: str, message: str) -> NoReturn:
    """A usage error of `prog` ("fw", "fw plan") as one line, exit code 2."""
    command = prog.removeprefix("fw").strip()
    sys.stderr.write(f"fw: error: {command + ': ' if command else ''}{message} (see {prog} --help)\n")
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    # --debug is accepted before and after the command; SUPPRESS keeps `fw --debug fit` from being reset
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show Python tracebacks (also FW_DEBUG=1)")
    configs = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    configs.add_argument("--config", action="append", metavar="FILE", default=[],
                         help="YAML config; repeat to merge several, later files win (mappings merge, lists replace)")

    overrides = "Dotted overrides such as --trainer.max_steps=10 --optimizer.lr=1e-4 follow the options."
    parser = _Parser(
        prog="fw", allow_abbrev=False,
        description="fw: declarative post-training (SFT, GRPO, PPO) for Qwen3 on PyTorch Lightning.",
        epilog=_reference())
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks (also FW_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, parents: list, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=parents, allow_abbrev=False,
                              description=(description or help), epilog=_reference())

    fit = add("fit", "train: run the recipe of the config", [common, configs],
              "Train with the recipe of the config and write the resolved config.yaml into run_dir. " + overrides)
    fit.add_argument("--resume", metavar="last|PATH",
                     help="continue from the newest checkpoint of run_dir ('last') or a checkpoint directory; "
                          "changed settings apply where a resume can apply them, else the run is refused")
    skip_help = ("with {}: when the run's newest checkpoint is damaged (a file missing, truncated or corrupt: every "
                 "file's sha256 is checked), say so and use the newest intact older one instead of stopping; refused "
                 "with a checkpoint directory, the one checkpoint there is to use")
    fit.add_argument("--skip-damaged", action="store_true", help=skip_help.format("--resume last or a run directory"))
    run_dir = "a run directory as --checkpoint"
    add("validate", "check a config without running it (exit 0 when valid, 2 with every problem)",
        [common, configs], "Check a config without running it. " + overrides)
    add("print-config", "print the resolved config (every default filled in) as YAML",
        [common, configs], "Print the resolved config as YAML. " + overrides)
    plan = add("plan", "print the memory the job will need on each GPU, row by row (exit 2 when it does not fit)",
               [common, configs], "Print the memory plan: weights, gradients, optimizer states, reference and value "
               "models, KV cache, activations and logits per GPU, against the GPU's memory, trainer.memory_limit_gib "
               "or --gpu-gib; when it does not fit, the overrides to try. Exit 0 when it fits, 2 when it does not. "
               + overrides)
    plan.add_argument("--gpu-gib", type=float, metavar="N",
                      help="GiB of memory per GPU to plan against; under trainer.accelerator auto the plan is a GPU's "
                      "on a machine without one too")
    add("schema", "print the config's JSON Schema", [common])

    export = add("export", "write a checkpoint's policy as a Hugging Face model directory", [common])
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="checkpoint directory (step-...), or a run directory for its newest checkpoint")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument("--merge", action="store_true",
                        help="LoRA checkpoint: write the base with the adapters merged in (default: the adapters "
                             "in PEFT's format)")
    export.add_argument("--model.policy.path", dest="base", metavar="DIR",
                        help="LoRA checkpoint: where its base model is now, when it has moved from model.policy.path "
                             "of the checkpoint's config.yaml; checked against the checkpoint's record of its files "
                             "(--merge reads the base there; without it, the exported adapter_config.json names it)")
    export.add_argument("--skip-damaged", action="store_true", help=skip_help.format(run_dir))

    gen = add("generate", "generate text from a config's model or a checkpoint", [common, configs],
              "Generate a completion. With only --checkpoint, the checkpoint's own config.yaml is used, with the "
              "overrides on top; "
              "options left out come from the config (rollout.max_new_tokens, rollout.temperature, seed). "
              + overrides)
    gen.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory whose policy is used, or a run directory for its newest checkpoint")
    gen.add_argument("--skip-damaged", action="store_true", help=skip_help.format(run_dir))
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--max-new-tokens", type=int, metavar="N")
    how = gen.add_mutually_exclusive_group()
    how.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    how.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    gen.add_argument("--seed", type=int, metavar="S")

    ev = add("eval", "evaluate a checkpoint on held-out data as training does; print a table, write JSON",
             [common, configs], "Evaluate a checkpoint's policy with the eval: settings (RL: reward, accuracy, "
             "pass@k of eval.samples_per_prompt samples per prompt; SFT: loss, perplexity, token accuracy). Without "
             "--config, the checkpoint's own config.yaml is used, with the overrides on top. " + overrides)
    ev.add_argument("--checkpoint", required=True, metavar="DIR",
                    help="checkpoint directory, or a run directory for its newest checkpoint")
    ev.add_argument("--out", metavar="FILE", help="the JSON report (default: <run_dir>/eval/<checkpoint>.json, "
                    "<checkpoint>-<config hash>.json under settings other than the checkpoint's; keys eval does not "
                    "read, such as optimizer:, logging: or the loss settings, do not count)")
    ev.add_argument("--skip-damaged", action="store_true", help=skip_help.format(run_dir))

    plot = add("plot", "draw runs' metrics.jsonl curves into a PNG (needs matplotlib: pip install 'fw[plot]')",
               [common], "Plot metrics.jsonl of one or more runs, one panel per metric, steps on x; training "
               "curves smoothed, eval curves with markers.")
    plot.add_argument("--run", action="append", required=True, metavar="RUN_DIR",
                      help="a run directory (or its metrics.jsonl); repeat to compare runs on one figure")
    plot.add_argument("--metrics", metavar="A,B,...",
                      help="comma-separated metric names (default: loss / reward and eval metrics present)")
    plot.add_argument("--out", metavar="F.png", help="the PNG (default: <first run>/metrics.png)")
    plot.add_argument("--smooth", type=float, default=0.6, metavar="W",
                      help="moving-average weight of training curves in [0, 1); 0 = raw (default 0.6)")

    add("doctor", "report torch, CUDA and the state of the CUDA ops", [common])
    ops = add("ops", "CUDA ops tools", [common])
    ops_sub = ops.add_subparsers(dest="ops_command", metavar="OPS_COMMAND", required=True)
    ops_sub.add_parser("build", help="compile and load the CUDA ops", parents=[common], allow_abbrev=False)
    return parser


# fw plan's --gpu-gib at most (a PiB, far above any GPU): 1e300 GiB is no limit in bytes (it overflows to inf)
MAX_GPU_GIB = 1 << 20


# the options that name a file or directory, as their argparse destinations: an empty one would be read as the
# working directory (a path joined to it) or as a file named "", neither what was meant
_PATH_OPTIONS = {"config": ("--config", "a YAML config file"), "resume": ("--resume", "last or a checkpoint directory"),
                 "checkpoint": ("--checkpoint", "a checkpoint or run directory"), "out": ("--out", "a path to write"),
                 "run": ("--run", "a run directory")}


def _checked(paths: list[str], overrides: list[str], imports: tuple, policy: bool, eval_files: bool) -> dict:
    """The config of `fw generate` / `fw eval --config`, what they read of it (`validate.read_problems`) checked as fw
    validate checks it: every problem at its file, line and key."""
    from framework.config import load_located
    from framework.validate import read_problems

    located = load_located(paths, overrides, imports=imports)
    problems = read_problems(located, policy, eval_files)
    if problems:
        raise located.error(problems)
    return located.cfg


def _run(args: argparse.Namespace, overrides: list[str], program: bool) -> int:
    cmd = args.command
    for dest, (option, wanted) in _PATH_OPTIONS.items():
        value = getattr(args, dest, None)
        if "" in (value if isinstance(value, list) else [value]):
            raise FwError(f"{option} is empty; give {wanted}")
    # an option that would change nothing is refused rather than ignored: whoever gave it expects it to act
    if cmd == "fit" and args.skip_damaged and args.resume is None:
        raise FwError(_skip_damaged_alone("--resume", "last"))
    if cmd == "generate" and args.skip_damaged and args.checkpoint is None:
        raise FwError(_skip_damaged_alone("--checkpoint", "RUN_DIR"))
    if getattr(args, "skip_damaged", False):
        option, named = ("--resume", args.resume) if cmd == "fit" else ("--checkpoint", args.checkpoint)
        _refuse_skip_damaged_of_one(option, named)
    if cmd in ("validate", "print-config", "fit"):
        if not args.config:
            raise FwError(f"fw {cmd} needs --config FILE")
        if cmd == "print-config":
            cfg = load_config(args.config, overrides)
        else:   # the deep checks too; fit adds this machine's (accelerator, devices, strategy, precision)
            from framework.validate import validate_config

            cfg = validate_config(args.config, overrides, machine=cmd == "fit")
        if cmd == "validate":
            from framework.validate import process_assumption

            assumed = process_assumption(cfg)
            _out(f"{', '.join(args.config)}: valid (recipe {cfg['recipe']}{'; ' + assumed if assumed else ''})")
        elif cmd == "print-config":
            _written(sys.stdout.write, dump_config(cfg))
        else:
            from framework.trainer import fit

            # the process ends after fit: the models and optimizer states need not be copied to host memory first;
            # as the program, it ends with fit's signal handlers in place (`main`)
            fit(cfg, resume=args.resume, skip_damaged=args.skip_damaged, keep_on_device=True,   # writes config.yaml
                signals_until_exit=program)
    elif cmd == "plan":
        if not args.config:
            raise FwError("fw plan needs --config FILE")
        if args.gpu_gib is not None and not 0 < args.gpu_gib <= MAX_GPU_GIB:
            raise FwError(f"--gpu-gib is one GPU's memory in GiB: a number > 0 and at most {MAX_GPU_GIB}, got "
                          f"{args.gpu_gib:g}")
        from framework.config import load_located
        from framework.memory_plan import estimate
        from framework.validate import model_problems

        located = load_located(args.config, overrides, imports=("data",))
        problems = model_problems(located)   # at their keys, as fw validate says them
        if problems:
            raise located.error(problems)
        plan = estimate(located.cfg, gpu_gib=args.gpu_gib)
        _out(plan.table())
        if plan.fits is False:
            raise FwError(plan.refusal())
    elif cmd == "schema":
        _written(sys.stdout.write, schema_text())
    elif cmd == "export":
        from framework.export import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, skip_damaged=args.skip_damaged,
                                base=args.base)
        _out(f"exported {args.checkpoint} to {out or args.out}")
    elif cmd == "generate":
        if not args.config and not args.checkpoint:
            raise FwError("fw generate needs --config FILE or --checkpoint DIR")
        # without --config, the overrides apply on top of the checkpoint's own config.yaml
        cfg = _checked(args.config, overrides, (), policy=args.checkpoint is None, eval_files=False) \
            if args.config else None
        from framework.generate import generate_text

        temperature = 0.0 if args.greedy else args.temperature
        _out(generate_text(cfg, args.prompt, checkpoint=args.checkpoint, max_new_tokens=args.max_new_tokens,
                            temperature=temperature, seed=args.seed, skip_damaged=args.skip_damaged,
                            overrides=None if args.config else overrides))
    elif cmd == "eval":
        from framework.evaluation import EVAL_IMPORTS, evaluate_checkpoint, format_table

        # without --config, the overrides apply on top of the checkpoint's own config.yaml
        # the checkpoint's policy/ is what it evaluates (a LoRA checkpoint's base is checked as it loads)
        cfg = _checked(args.config, overrides, EVAL_IMPORTS, policy=False, eval_files=True) if args.config else None
        report, out = evaluate_checkpoint(args.checkpoint, cfg, out=args.out, skip_damaged=args.skip_damaged,
                                          overrides=None if args.config else overrides)
        _out(format_table(report))
        _out(f"wrote {out}")
    elif cmd == "plot":
        from framework.plot import plot_runs

        metrics = None
        if args.metrics is not None:
            metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
            if not metrics:   # a figure of no panel; the defaults are not what the option asked for
                raise FwError(f"--metrics {args.metrics!r} names no metric; give comma-separated names such as "
                              "loss,reward/mean, or leave --metrics out for the defaults")
        _out(f"wrote {plot_runs(args.run, args.out, metrics, args.smooth)}")
    elif cmd == "doctor":
        import ops_cuda

        _out(ops_cuda.doctor())
    elif cmd == "ops":
        import ops_cuda

        try:
            _out(ops_cuda.build())
        except RuntimeError as e:  # no CUDA / no compiler / a stale build lock: the message says which
            raise FwError(f"cannot build the CUDA ops: {e}") from e
    return 0


def _skip_damaged_alone(option: str, example: str) -> str:
    """The refusal of --skip-damaged without `option`, the checkpoints it would choose among."""
    return (f"--skip-damaged applies only with {option}: it passes over a run directory's damaged newest checkpoint "
            f"for its newest intact one; add {option} {example}, or leave --skip-damaged out")


def _refuse_skip_damaged_of_one(option: str, path: str) -> None:
    """FwError when `path` (given as `option` with --skip-damaged) is a checkpoint directory itself: the option
    would change nothing there, neither what is read (the one checkpoint) nor how (its files are not hashed)."""
    from framework.checkpoint.store import is_one_checkpoint

    if path == "last" or not is_one_checkpoint(path):
        return
    parent = Path(os.path.abspath(path)).parent   # `--checkpoint .` too
    run_dir = f"its run directory {parent.parent}" if parent.name == "checkpoints" else "a run directory"
    raise FwError(f"--skip-damaged applies only to a run directory: it passes over a run directory's damaged newest "
                  f"checkpoint for its newest intact one, and {option} {path} is one checkpoint; give {run_dir}, "
                  "or leave --skip-damaged out")


def _one_line(message: str) -> str:
    """A message as one line: lines after the first (a wrapped error's own report) joined with "; "."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def _joined(rest: list[str]) -> list[str]:
    """Overrides as `--a.b=v`: one written `--a.b v` (two arguments, as options take their values) joined."""
    out: list[str] = []
    for arg in rest:
        if out and out[-1].startswith("--") and "=" not in out[-1] and not arg.startswith("--"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _written(write: Any, *args: Any) -> None:
    """`write(*args)` on standard output; a failure there other than a closed pipe (a full disk) is one line."""
    try:
        write(*args)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise FwError(f"cannot write to standard output: {e.strerror or e}") from None


def _out(*values: Any) -> None:
    """print() of a command's result to standard output."""
    _written(print, *values)


def main(argv: list[str] | None = None) -> int:
    """Run `fw` with `argv` (default: sys.argv[1:]); returns the exit code. Without `argv` it is the `fw` program
    itself (the console script, `python -m framework`): a `fw fit` leaves its signal handlers in place, the process
    ending after it."""
    return _main(sys.argv[1:] if argv is None else list(argv), argv is None)


def _main(argv: list[str], program: bool) -> int:
    """`main`; `program`: this process ends after it (`fit`'s signal handlers may stay in place)."""
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
        rest = _joined(rest)
        if rest and args.command not in _WITH_CONFIG:
            _usage_error(" ".join(["fw", *filter(None, [args.command])]), f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # --help, or a usage error already printed (_usage_error)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    debug = args.debug or os.environ.get("FW_DEBUG", "") not in ("", "0")
    try:
        if sys.stdout is None and args.command != "fit":   # fd 1 closed: print() drops the result without a word
            raise FwError(f"standard output is closed; fw {args.command} writes its result there")
        with built_once():   # fit's run uses the user objects that its checks built
            code = _run(args, rest, program)
        if sys.stdout is not None:
            _written(sys.stdout.flush)   # here, not at exit: a write that fails is this command's error
        return code
    except FwError as e:
        if debug:
            traceback.print_exc()
        if e.quiet:   # every rank raised it, and global rank 0 prints it
            return 2
        if isinstance(e, ConfigError):
            for problem in e.problems:
                print(problem, file=sys.stderr)
        else:
            print(f"fw: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except Stopped as e:   # SIGTERM / SIGINT / SIGUSR1 during fit: the step finished and was saved
        if debug:
            traceback.print_exc()
        print(f"fw: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        from framework.imports import user_line

        # where the user's code was running (a module being imported, a constructor), when it was
        where = user_line(e)
        print(f"fw: interrupted: KeyboardInterrupt{where}" if where else "fw: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader of the output went away (`fw schema | head`), as it may
        if debug:
            traceback.print_exc()
        # the interpreter flushes stdout at exit: into the void, not into the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
