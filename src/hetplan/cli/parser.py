"""The command line: one `_add_<command>` per command, the options several share as parents
(`--json`; the planning problem of `plan` and `compare`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from hetplan.cli._shared import allows_none
from hetplan.cli.describe import cmd_catalog, cmd_import_pipedream, cmd_info
from hetplan.cli.planning import cmd_compare, cmd_plan, cmd_replay, cmd_simulate
from hetplan.cli.profiling import cmd_profile
from hetplan.cli.reporting import cmd_report
from hetplan.cli.running import cmd_calibrate, cmd_demo, cmd_run
from hetplan.cost.table import ROUTINGS
from hetplan.graph import GRANULARITIES
from hetplan.io.pipedream import DEFAULT_DEVICE_TYPE, INPUT_TIMES
from hetplan.plan import OBJECTIVES
from hetplan.planners import PLANNERS, RL_PLANNERS
from hetplan.planners.kit import FAITHFUL_BUDGET_S, LEARN_BUDGET_S, SEARCH_BUDGET_S
from hetplan.planners.options import (
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    SEQUENCE_PARALLEL_CHOICES,
    SHARD_CHOICES,
    PlanOptions,
)
from hetplan.precision import PRECISIONS
from hetplan.runtime.settings import BACKENDS
from hetplan.runtime.settings import DEFAULTS as RUN
from hetplan.zoo import zoo_names
from hetplan.zoo.llm import SHAPES as LLM_SHAPES

PLAN = PlanOptions()  # the planning flags' defaults, read here and nowhere else (`_default`)

DESCRIPTION = """\
hetplan plans how to split the training of a PyTorch model across a mixed set of devices,
predicts how fast and how expensive each plan is, and runs it.

workflow:
  1. a graph of the model:  hetplan profile gpt2-tiny --device cpu:1 --device cpu:2 -o g.json
                            (or import one: hetplan import pipedream resnet50/graph.txt -o r50.json)
  2. a cluster:             a YAML file, or a preset such as hetero-4 (hetplan catalog lists them)
  3. a plan:                hetplan plan r50.json --cluster hetero-4 -o plan.json   (planner dp)
                            hetplan compare r50.json --cluster hetero-4              (all planners)
  4. its predicted step:    hetplan simulate plan.json --graph r50.json --cluster hetero-4 --gantt step.png
  5. a look at any of them: hetplan info r50.json | hetplan info hetero-4 | hetplan info plan.json
                            hetplan report plan.json    (one HTML page: graph, timeline, tables)
  6. a real run:            hetplan run plan.json --model gpt2-tiny --graph g.json   (a plan for local CPU
                            workers or a cluster file with bindings; predicted against measured)

Every command takes --json and then prints one JSON object."""

Subparsers = argparse._SubParsersAction  # what `add_subparsers` returns


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line, like every other error of hetplan's (the
    usage block argparse prints first is `--help`'s to show); its subcommands' parsers are of this
    class too (`add_subparsers` makes its own type)."""

    def error(self, message: str):
        self.exit(2, f"hetplan: error: {self.prog}: {message}; see {self.prog} --help\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the `command` a command line names, only that command's
    options are made, every other command is listed by its name and help (all that `--help` and a
    misspelt command read): argparse makes a help formatter and looks for translations with each
    option it adds, which for every command is most of an in-process call's parsing."""
    common = _common_options()
    parser = OneLineParser(prog="hetplan", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hetplan {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    whole = command not in COMMANDS
    planning = _planning_options() if whole or command in PLANNING_COMMANDS else None
    for name, add in _ADDERS:
        made = sub if whole or name == command else _Listed(sub)
        if name in PLANNING_COMMANDS:
            add(made, common, planning)
        else:
            add(made, common)
    return parser


def command_named(argv: Sequence[str]) -> str | None:
    """The command a command line names: its first word that is not an option (the options before
    it are hetplan's own, which take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


class _Listed:
    """A command as the list of commands shows it, without its options: takes whatever its
    `_add_<command>` gives it and keeps nothing but the command's name and help."""

    def __init__(self, sub: Subparsers) -> None:
        self.sub = sub

    def add_parser(self, name: str, **kwargs):
        self.sub.add_parser(name, help=kwargs.get("help"))
        return _Ignored()


class _Ignored:
    """A listed command's parser: every call made to it does nothing."""

    def __getattr__(self, _name: str):
        return lambda *args, **kwargs: self


def _version() -> str:
    from hetplan import __version__

    return __version__


def _common_options() -> argparse.ArgumentParser:
    """What every command takes."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return common


GLOBAL_BATCH_HELP = ("plan at a batch of N samples per step (default: the graph's): a pass takes its profiled fixed "
                     "part plus the rest scaled by N over the profile's batch; activations scale too")


def _default(name: str, none: str = "none") -> str:
    """A planning flag's "(default: X)", read off `PlanOptions` (`none`: what its None means)."""
    value = getattr(PLAN, name)
    shown = none if value is None else f"{value:g}" if isinstance(value, float) else value
    return f"(default: {shown})"


def _planning_options() -> argparse.ArgumentParser:
    """The planning problem and the planners' settings, of `plan` and `compare`. Each flag's
    default is `PlanOptions`' field (`cli._shared._options` turns the flags back into one)."""
    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument("graph", metavar="GRAPH", help="a graph JSON file")
    planning.add_argument("--cluster", required=True, metavar="C", help="a cluster file or preset")
    planning.add_argument("--global-batch", type=int, metavar="N", help=GLOBAL_BATCH_HELP)
    _add_plan_shape_options(planning)
    _add_objective_options(planning)
    _add_search_options(planning)
    _add_mdpe_options(planning)
    return planning


def _add_plan_shape_options(planning: argparse.ArgumentParser) -> None:
    """What the plan may be: micro-batches, schedule, memory choices, widths."""
    planning.add_argument("--microbatches", default=PLAN.microbatches, metavar="M|auto",
                          help="micro-batches per step, or auto: the planner chooses "
                               + _default("microbatches", none="auto"))
    planning.add_argument("--schedule", default=PLAN.schedule, choices=SCHEDULE_CHOICES,
                          help="pipeline schedule (auto: the planner's plan under the schedule its objective "
                               f"prefers) {_default('schedule')}")
    planning.add_argument("--recompute", default=PLAN.recompute, choices=RECOMPUTE_CHOICES,
                          help="which stages recompute their activations in their backward, and what each "
                               "rebuilds at once: where-needed (the stages over their devices' memory, the whole "
                               "stage, a block at a time, or per block all but its products' outputs "
                               "(selective), the fastest that fits), stage, block or selective (the same at "
                               f"that unit only), never, or always {_default('recompute')}")
    planning.add_argument("--shard", default=PLAN.shard, choices=SHARD_CHOICES,
                          help="replicated: the replicas of every stage of two or more shard its optimizer state "
                               "(ZeRO-1: an r-th of Adam's state each, a reduce-scatter and an all-gather instead "
                               "of the all-reduce); where-needed: the same, and a stage that does not fit so shards "
                               "its gradients (ZeRO-2) or its weights too (ZeRO-3), node by node, the first that fits; "
                               f"never {_default('shard')}")
    planning.add_argument("--precision", choices=PRECISIONS,
                          help="the arithmetic the plan runs in: fp32, or bf16/fp16 mixed precision; the graph "
                               "must be profiled in it (default: the graph's)")
    planning.add_argument("--max-replicas", type=int, default=PLAN.max_replicas, metavar="N",
                          help="at most N devices per stage (1: a straight pipeline) "
                               + _default("max_replicas", none="no limit"))
    auto = "; auto: up to a host's GPUs of one type" if allows_none("max_tp") else ""
    planning.add_argument("--max-tp", default=PLAN.max_tp, metavar="N|auto" if auto else "N",
                          help="replicas may be tensor-parallel groups of up to N devices of one type on one host "
                               f"(1: none{auto}) {_default('max_tp', none='auto')}")
    planning.add_argument("--sequence-parallel", default=PLAN.sequence_parallel, choices=SEQUENCE_PARALLEL_CHOICES,
                          help="tensor-parallel: every tensor-parallel stage splits its values along the tokens too "
                               "(norms and dropout on a share of them; an all-gather and a reduce-scatter in place "
                               "of each all-reduce: a device keeps less of its blocks' activations) "
                               f"{_default('sequence_parallel')}")


def _add_objective_options(planning: argparse.ArgumentParser) -> None:
    planning.add_argument("--objective", default=PLAN.objective, choices=OBJECTIVES,
                          help="time: shortest step; cost: lowest price per sample above --min-samples-per-s; "
                               "mdpe: Trinity's runtime + communication + memory model; throughput: PipeDream's "
                               f"steady state, the slowest stage or cut {_default('objective')}")
    planning.add_argument("--min-samples-per-s", type=float, default=PLAN.min_samples_per_s, metavar="X",
                          help=f"throughput floor of --objective cost {_default('min_samples_per_s')}")
    planning.add_argument("--routing", default=PLAN.routing, choices=ROUTINGS,
                          help="how the simulator scoring plans sends tensors between stages (relay: as the "
                               f"runtime does) {_default('routing')}")


def _add_search_options(planning: argparse.ArgumentParser) -> None:
    """The settings of the planners that search or learn."""
    planning.add_argument("--seed", type=int, default=PLAN.seed, help=f"seed of search planners {_default('seed')}")
    budgets = (f"{SEARCH_BUDGET_S:g} for local-search, {LEARN_BUDGET_S:g} for the RL planners, "
               f"{FAITHFUL_BUDGET_S:g} with --faithful")
    planning.add_argument("--budget-s", type=float, default=PLAN.budget_s, metavar="T",
                          help=f"time budget of search planners {_default('budget_s', none=budgets)}")
    planning.add_argument("--max-iters", type=int, default=PLAN.max_iters, metavar="N",
                          help="iterations of search planners instead of a time budget (the same plan every run) "
                               + _default("max_iters", none="the time budget"))
    planning.add_argument("--faithful", action="store_true", default=PLAN.faithful,
                          help="RL planners: the paper's set-up (cold start) instead of a warm start from dp")


def _add_mdpe_options(planning: argparse.ArgumentParser) -> None:
    mdpe = planning.add_argument_group("mdpe objective")
    mdpe.add_argument("--alpha", type=float, default=PLAN.alpha, help=f"weight of the step time {_default('alpha')}")
    mdpe.add_argument("--beta", type=float, default=PLAN.beta,
                      help=f"weight of communication over tolerance {_default('beta')}")
    mdpe.add_argument("--gamma", type=float, default=PLAN.gamma,
                      help=f"weight of memory over tolerance {_default('gamma')}")
    mdpe.add_argument("--comm-tolerance", type=float, default=PLAN.comm_tolerance,
                      help=f"busiest link's share of the step tolerated {_default('comm_tolerance')}")
    mdpe.add_argument("--mem-tolerance", type=float, default=PLAN.mem_tolerance,
                      help=f"share of a device's memory tolerated {_default('mem_tolerance')}")


def _add_info(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("info", parents=[common], help="summarise a graph, cluster or plan file, or a preset")
    p.add_argument("target", metavar="FILE|PRESET")
    p.set_defaults(func=cmd_info)


def _add_import(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("import", help="import another tool's profile into a hetplan graph")
    fmt = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    q = fmt.add_parser("pipedream", parents=[common], help="a PipeDream profiler graph.txt")
    q.add_argument("path", type=Path, metavar="PATH/graph.txt")
    q.add_argument("-o", "--output", type=Path, required=True, help="the graph JSON to write")
    q.add_argument("--name", help="graph name (default: the profile's folder name)")
    q.add_argument("--device-type", default=DEFAULT_DEVICE_TYPE,
                   help=f"device type the profile was taken on (default: {DEFAULT_DEVICE_TYPE})")
    q.add_argument("--batch-size", type=int, help="batch size of the profile (read off image inputs if omitted)")
    q.add_argument("--input-time", default="keep", choices=INPUT_TIMES,
                   help="the Input nodes' data-loading time: keep it as work of the first stage (default), or "
                        "zero it as PipeDream's optimizer does")
    q.set_defaults(func=cmd_import_pipedream)


def _add_plan(sub: Subparsers, common: argparse.ArgumentParser, planning: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plan", parents=[common, planning], help="split a graph over a cluster with a planner")
    p.add_argument("--planner", default="dp", choices=list(PLANNERS), metavar="NAME",
                   help=f"one of: {', '.join(PLANNERS)} (default: dp)")
    p.add_argument("-o", "--output", type=Path, help="the plan JSON to write")
    p.add_argument("--curve", type=Path, metavar="PREFIX",
                   help="RL planners: write the learning curve to PREFIX.csv and PREFIX.png (and TensorBoard "
                        "events under PREFIX-tb/ when tensorboard is installed)")
    p.add_argument("--explain", action="store_true",
                   help="after the plan, why this plan: where dp's winner came from and why each of its best "
                        "runners-up lost (with --json it is already in the plan's meta.dp.explain)")
    p.set_defaults(func=cmd_plan)


def _add_compare(sub: Subparsers, common: argparse.ArgumentParser, planning: argparse.ArgumentParser) -> None:
    p = sub.add_parser("compare", parents=[common, planning], help="run several planners on one problem, side by side")
    p.add_argument("--planners", metavar="A,B,...",
                   help=f"planners to run, of: {', '.join(PLANNERS)} (default: all but the RL planners "
                        f"{', '.join(RL_PLANNERS)}, which take their budget each, and milp unless "
                        "--objective throughput)")
    p.set_defaults(func=cmd_compare)


def _add_replay(sub: Subparsers, common: argparse.ArgumentParser, planning: argparse.ArgumentParser) -> None:
    p = sub.add_parser("replay", parents=[common, planning],
                       help="train through a trace of devices coming and going: three policies side by side",
                       description="Replay a trace of the devices of each type available over time: a static plan, "
                                   "a new plan at every change, and a new plan when its gain outweighs the restart "
                                   "(hetplan.availability).")
    p.add_argument("--trace", required=True, metavar="T.json",
                   help='{"horizon_s": S, "points": [{"t_s": 0, "counts": {"TYPE": N, ...}}, ...]}')
    p.add_argument("--planner", default="dp", choices=list(PLANNERS), metavar="NAME",
                   help="the planner of each change (default: dp)")
    p.add_argument("--restart-s", type=float, default=120.0,
                   help="seconds from a stop to training again (default: 120)")
    p.add_argument("--checkpoint-every-s", type=float, default=600.0,
                   help="seconds between checkpoints: a plan stopped by a loss redoes half of it (default: 600)")
    p.set_defaults(func=cmd_replay)


def _add_simulate(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("simulate", parents=[common], help="predict a plan's step: time, memory, traffic, price",
                       description="Replay one training step of a plan with the event-driven simulator.")
    p.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    p.add_argument("--graph", required=True, metavar="G", help="the graph JSON the plan was made for")
    p.add_argument("--cluster", required=True, metavar="C", help="a cluster file or preset")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="samples per step (default: the batch the plan was made at, else the graph's); "
                        "times scaled from the profile's fixed and per-sample parts")
    p.add_argument("--routing", default=PLAN.routing, choices=ROUTINGS,
                   help="relay: only neighbouring stages talk, as in hetplan's runtime; direct: each tensor goes "
                        "straight to the stages that use it, branches run in parallel (default: the planners', "
                        f"{PLAN.routing})")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="check that the plan and graph are in this precision (default: the plan's)")
    p.add_argument("--gantt", type=Path, metavar="OUT.png", help="write a Gantt chart of the step (.png/.svg/.pdf)")
    p.add_argument("--trace", type=Path, metavar="OUT.json",
                   help="write the timeline as a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--actions", action="store_true",
                   help="print each worker's list of the step, in torch's action format: its passes (1F0), "
                        "messages (1SEND_F0->2, 2RECV_F0<-1, with rows where replicas split a micro-batch), "
                        "gradient sums (0REDUCE_GRAD(0,1)) and optimizer steps, checked by a dry run")
    p.set_defaults(func=cmd_simulate)


def _add_run(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="train with a plan on workers; measured against predicted",
                       description="Run a plan for real: one worker process per stage replica, each "
                                   "running its stage's scheduled actions and messages (gloo, or NCCL between GPUs).")
    p.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    p.add_argument("--model", required=True, help=f"the profiled model: a zoo model ({', '.join(zoo_names())}) "
                                                  "or module.path:factory")
    p.add_argument("--graph", metavar="G", help="the graph the plan was made for (for the prediction and the shapes)")
    p.add_argument("--cluster", metavar="C", help="cluster file or preset (default: the plan's, e.g. local)")
    p.add_argument("--batch-size", "--global-batch", type=int, dest="batch_size",
                   help="samples per step (default: the batch the plan was made at, else the graph's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the graph's)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="fp32, or bf16/fp16 mixed precision (autocast, fp32 master weights; fp16 with a loss "
                        "scaler); it must be the plan's (default: the plan's)")
    p.add_argument("--granularity", choices=GRANULARITIES, help="as profiled (default: the graph's)")
    p.add_argument("--block-class", action="append", metavar="CLASS",
                   help="as profiled (default: the graph's, else the model's own blocks)")
    # no defaults here: a flag not given takes RunSettings' (`RunSettings.from_args`)
    p.add_argument("--steps", type=int, help=f"training steps (default: {RUN.steps})")
    p.add_argument("--warmup", type=int, help=f"steps left out of the timing (default: {RUN.warmup})")
    p.add_argument("--data", choices=("synthetic", "text"),
                   help="synthetic random batches, or text: the Python standard library's sources, byte-level "
                        f"(default: {RUN.data})")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help=f"(default: {RUN.optimizer})")
    p.add_argument("--lr", type=float, help=f"(default: {RUN.lr:g})")
    p.add_argument("--seed", type=int, help=f"(default: {RUN.seed})")
    p.add_argument("--no-dropout", action="store_true",
                   help="no dropout however the model draws it (dropout layers, functional dropout's "
                        "probabilities, LayerDrop, SpecAugment), so that the run can equal one process's training")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="save every K steps, K >= 1 (with --checkpoint-dir; default: the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir, written by this plan or any other "
                        "plan of the same training")
    p.add_argument("--elastic", action="store_true",
                   help="when a worker dies, re-plan (dp) on the devices left and go on from the last checkpoint "
                        "(needs --graph and --checkpoint-dir; local launcher)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="with --elastic, re-plan at most N times (default: 3)")
    p.add_argument("--timeout-s", type=float,
                   help=f"stop every worker when none moves for this long (default: {RUN.timeout_s:g})")
    p.add_argument("--backend", choices=BACKENDS,
                   help="how workers talk: auto (NCCL between GPU workers, gloo where a CPU takes part or two "
                        "workers share a GPU), gloo, or nccl (every worker on a GPU of its own) "
                        f"(default: {RUN.backend})")
    p.add_argument("--out", type=Path, default=RUN.out_dir,
                   help=f"the run folder: logs, run.json, result (default: {RUN.out_dir})")
    p.add_argument("--dry-run", action="store_true",
                   help="write the run folder's run.json and print the torchrun command of each machine")
    p.add_argument("--trace", action="store_true",
                   help="record the last step: trace_measured.json (Chrome trace) and gantt.png (predicted above "
                        "measured) in the run folder")
    p.set_defaults(func=cmd_run)


def _add_calibrate(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("calibrate", parents=[common],
                       help="measure on this machine what the simulator charges besides the model: gloo, "
                            "all-reduces, optimizer steps, co-running, the runtime's cost per action")
    p.add_argument("--cluster", default="local", metavar="C", help="a cluster file or preset (default: local)")
    p.add_argument("--steps", type=int, default=15, help="steps per run of the probe pipeline (default: 15)")
    p.add_argument("-o", "--output", type=Path, required=True, help="the calibrated cluster JSON to write")
    p.set_defaults(func=cmd_calibrate)


def _add_demo(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="profile, plan, simulate and run gpt2-tiny on this machine")
    p.add_argument("--out", type=Path, default=Path("out/demo/report"), help="the report folder")
    p.add_argument("--steps", type=int, default=12, help="training steps per run, 3 of them warm-up (default: 12)")
    p.add_argument("--budget-s", type=float, default=3.0, help="local-search's budget (default: 3)")
    p.add_argument("--cluster", default="local", metavar="C",
                   help="local, or its calibrated file from `hetplan calibrate --cluster local` (default: local)")
    p.set_defaults(func=cmd_demo)


def _add_report(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("report", parents=[common], help="one HTML page of a plan, run, comparison or demo",
                       description="Write a self-contained HTML page (no network needed): the plan on the model's "
                                   "graph, the step's timeline (predicted, and measured for a run), the planners' "
                                   "table and the RL planners' learning curves.")
    p.add_argument("path", metavar="PATH", help="a plan file, a compare --json output, a run folder (hetplan run "
                                                "--out) or a demo folder")
    p.add_argument("-o", "--output", type=Path, help="the page to write (default: PATH/report.html for a folder, "
                                                     "else PATH with .html)")
    p.add_argument("--graph", metavar="G", help="the graph JSON (default: the one the plan or comparison was made "
                                                "from)")
    p.add_argument("--cluster", metavar="C", help="cluster file or preset (default: the plan's)")
    p.set_defaults(func=cmd_report)


def _add_profile(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("profile", parents=[common], help="profile a model's training step into a graph")
    p.add_argument("model", metavar="MODEL", help=f"a zoo model ({', '.join(zoo_names())}) or module.path:factory")
    p.add_argument("--batch-size", type=int, help="samples per batch (default: the zoo entry's)")
    p.add_argument("--seq-len", type=int, help="sequence length of language models (default: the zoo entry's)")
    p.add_argument("--device", action="append", metavar="D",
                   help="cpu, cpu:N (N threads), cuda or cuda:K; repeat to profile on several (default: cpu)")
    p.add_argument("--granularity", default="layer", choices=GRANULARITIES,
                   help="layer: one node per leaf module; block: one per repeated block (default: layer)")
    p.add_argument("--block-class", action="append", metavar="CLASS",
                   help="class name of the repeated block, for --granularity block on your own model")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats of the pieces in sequence; each node keeps its median (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="time the step in fp32, or in bf16/fp16 mixed precision (autocast: 16-bit products and "
                        "activations, fp32 weights and optimizer state) (default: fp32)")
    p.add_argument("--check", action="store_true",
                   help="also time the unsplit step and print the ratio of the sum of node times to it")
    p.add_argument("--tp-degrees", type=int, nargs="+", metavar="T", default=(),
                   help="also time each node on a tensor-parallel group of T CPU workers (as many threads each as "
                        "the --device's), for plans to use over the projection: e.g. --tp-degrees 2")
    p.add_argument("--roofline", action="append", metavar="TYPE",
                   help="count a model too big to run here instead of timing it: MODEL is a transformer shape "
                        f"({', '.join(LLM_SHAPES)}) or a transformers config.json, times from the roofline model "
                        "of device TYPE (a catalog name); repeat for several types")
    p.add_argument("-o", "--output", type=Path, required=True, help="the graph JSON to write")
    p.set_defaults(func=cmd_profile)


def _add_catalog(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("catalog", parents=[common], help="list device types, cluster presets and planners")
    p.set_defaults(func=cmd_catalog)


# every command, in the order `hetplan --help` lists them; those that take the planning problem
_ADDERS = (("info", _add_info), ("import", _add_import), ("plan", _add_plan), ("compare", _add_compare),
           ("replay", _add_replay), ("simulate", _add_simulate), ("run", _add_run), ("calibrate", _add_calibrate),
           ("demo", _add_demo), ("report", _add_report), ("profile", _add_profile), ("catalog", _add_catalog))
COMMANDS = tuple(name for name, _ in _ADDERS)
PLANNING_COMMANDS = ("plan", "compare", "replay")
