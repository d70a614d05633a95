"""GPU first light: the checks a first GPU session must run, in one script that fits a few minutes of one GPU.

    python bench/gpu_first_light.py [--device cuda|cpu] [--tiny] [--budget-s 400] [--json OUT]

On the GPU machine run it through bench/gpu_first_light.sh, which installs the carried wheels first
(bench/results/gpu_first_light.md says how). Five sections, each with a deadline and recorded as passed, failed or
skipped, so one failure does not stop the others:

- lossless: the speculative decoder on the device against the exact law of a float64 micro target (8 tokens):
  greedy equal to autoregressive decoding token for token, and at T=0.6 and T=1.0 the joint law of the first three
  emitted tokens against the target's, enumerated on the CPU (tests/helpers/lossless.py's chi-square at 0.1%);
- replay_bf16: packed replay (`opd.distill.replay.score` + `student_hidden`) in bf16 against the same weights in
  fp32: teacher and student logits at every drafted slot, relative error within `BF16_REL_TOL`;
- learner: `Learner.train_step` (engine-local, no Ray) repeated on one scored sequence: every loss finite, no step
  skipped, the last loss below the first;
- decode: bench/gpu.py's decoding rows (autoregressive, speculative, static-cache speculative) at batch 1 and 16;
- memory: the replay's (scorer's) and the learner's peak memory against bench/projection.py's projection of the same
  roles at the same shapes and length (`scorer_role`, `learner_role`), as measured / projected.

Shapes: bench/gpu.py's plan, Qwen3-4B's target and 5-layer DFlash drafter (block 16) with random weights, or with
`--tiny` its tiny plan, which runs on a CPU in seconds (tests/test_gpu_first_light.py). Models are bf16 wherever
the run trains or decodes, on a CPU too, so the dry run takes the GPU's code paths. Section deadlines are
cumulative shares of the budget (time a section leaves is inherited by the next); a section still running
`GRACE_SHARE` of the budget past its deadline is stopped and fails. Writes one JSON (default
$OUT/gpu_first_light.json when OUT is set, else bench/results/; `_tiny` with --tiny) and prints one table. Exit
code 0 when every section that ran passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers, when the root is not on PYTHONPATH
import gpu  # noqa: E402  (bench/gpu.py, beside this script)
from projection import GB, Qwen3Shape, attention_fits, learner_role, scorer_role, sequence_bytes  # noqa: E402

from opd.decoding.autoregressive import generate_autoregressive  # noqa: E402
from opd.decoding.record import SequenceRecord  # noqa: E402
from opd.decoding.sampling import Sampling  # noqa: E402
from opd.decoding.speculative import SpeculativeDecoder  # noqa: E402
from opd.distill.replay import score, student_hidden  # noqa: E402
from opd.memory import peak_cpu_bytes  # noqa: E402
from opd.models.lm_head import teacher_head  # noqa: E402
from opd.models.protocol import Drafter  # noqa: E402
from opd.models.target import Target  # noqa: E402
from opd.spec import ExperimentSpec, validate_spec  # noqa: E402
from opd.tiny.micro import micro_drafter, micro_target  # noqa: E402
from opd.train.learner import Learner  # noqa: E402
from tests.helpers.decoding import EOS, MASK, MIXED_PROMPTS, PROMPT  # noqa: E402
from tests.helpers.lossless import chi_square, exact_joint, sampled_joint  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCALE_JSON = RESULTS / "scale.json"  # bench/scale.py's stored measurements, which the projection reads
SHARES = {"lossless": 0.10, "replay_bf16": 0.40, "learner": 0.55, "decode": 0.95, "memory": 1.0}  # cumulative
GRACE_SHARE = 0.05
MICRO_LAYERS = [0, 2, 3]  # tests/helpers/decoding.py's micro target
TEMPERATURES = (0.6, 1.0)
# bf16 keeps 8 significant bits (a unit roundoff of 2^-9 per rounding), compounded over the target's layers and then
# the drafter's; the tolerance sits well above that, so what fails it is a broken bf16 path (a tensor cast to the
# wrong dtype, a mask or rotary table in bf16), not rounding.
BF16_REL_TOL = 0.05
# The projection is read as a budget: a role may use less than projected, but not more than this much above it.
MEMORY_RATIO_MAX = 1.25
LEARNER_STEPS = 5


@dataclass(frozen=True)
class Settings:
    """What differs between the GPU run and the CPU dry run."""

    plan: gpu.Plan
    lossless_samples: int


FULL = Settings(gpu.FULL_PLAN, lossless_samples=20_000)
TINY = Settings(dataclasses.replace(gpu.TINY_PLAN, repeats=1), lossless_samples=400)


class SectionSkipped(Exception):
    """A section that cannot run for want of another's result; recorded as skipped, not failed."""


class Overrun(Exception):
    """A section still running `GRACE_SHARE` of the budget past its deadline."""


@dataclass
class Context:
    """What the sections share: the bf16 models (built once), the replayed records and the measured peaks."""

    settings: Settings
    device: torch.device
    budget_s: float
    peaks: dict[str, dict[str, float]] = field(default_factory=dict)
    spec: ExperimentSpec | None = None
    _models: tuple[Target, Drafter] | None = None
    _records: list[SequenceRecord] | None = None

    @property
    def plan(self) -> gpu.Plan:
        return self.settings.plan

    def models(self) -> tuple[Target, Drafter]:
        """bench/gpu.py's random bf16 target and drafter, built on first use (sdpa: packed replay needs it)."""
        if self._models is None:
            self._models = gpu.build(self.plan, self.device, torch.bfloat16, "sdpa")
        return self._models

    def records(self) -> list[SequenceRecord]:
        """One synthetic rollout record of the plan's replay length (bench/replay.py), the same for every section."""
        if self._records is None:
            target, drafter = self.models()
            self._records = gpu.replay_records(target, self.plan, 1, drafter.block_size)
        return self._records

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def peak_bytes(ctx: Context, fn: Callable[[], Any]) -> tuple[Any, int]:
    """`fn`'s result and the bytes it allocated at its peak above what was allocated when it started: the CUDA
    allocator's peak on a GPU, the profiler's allocator events on a CPU (as bench/scale_data_path.py measures)."""
    if ctx.device.type != "cuda":
        box: list[Any] = []
        peak = peak_cpu_bytes(lambda: box.append(fn()))
        return box[0], peak
    ctx.sync()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    start = torch.cuda.memory_allocated(ctx.device)
    out = fn()
    ctx.sync()
    return out, torch.cuda.max_memory_allocated(ctx.device) - start


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages among `tensors` (a tied embedding and LM head count once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------ sections


def lossless(ctx: Context, deadline: float) -> tuple[bool, dict]:
    """The decoder runs on the device; the exact law comes from an identical float64 copy on the CPU, so the test
    checks the device's decoding against arithmetic it does not share."""
    reference = micro_target(seed=0, vocab_size=8, layer_ids=MICRO_LAYERS)
    target = micro_target(seed=0, vocab_size=8, layer_ids=MICRO_LAYERS).to(ctx.device)
    drafter = micro_drafter(target, seed=1, block_size=4, mask_token_id=MASK).to(ctx.device)
    records = SpeculativeDecoder(target, drafter, eos_id=EOS).generate(MIXED_PROMPTS, Sampling(), max_new_tokens=24)
    baseline = generate_autoregressive(target, MIXED_PROMPTS, Sampling(), max_new_tokens=24, eos_id=EOS)
    greedy_equal = [r.response_ids for r in records] == baseline
    n = ctx.settings.lossless_samples
    accepted = sum(sum(r.accepted) for r in records)
    out: dict[str, Any] = {"greedy_equal": greedy_equal, "greedy_accepted_drafts": accepted, "samples": n,
                           "chi_square": {}}
    for temperature in TEMPERATURES:
        sampling = Sampling(temperature=temperature)
        counts = sampled_joint(target, drafter, PROMPT, sampling, n, length=3)
        stat, critical = chi_square(counts, exact_joint(reference, PROMPT, sampling, 3, EOS), n)
        out["chi_square"][f"T={temperature}"] = {"statistic": stat, "critical": critical, "passed": stat < critical,
                                                 "sequences_seen": len(counts)}
    tests = out["chi_square"]
    out["summary"] = f"greedy {'==' if greedy_equal else '!='} AR (drafts accepted: {accepted}); " + ", ".join(
        f"{k} chi2 {v['statistic']:.0f} {'<' if v['passed'] else '>='} {v['critical']:.0f}" for k, v in tests.items())
    return greedy_equal and all(t["passed"] for t in tests.values()), out


def replay_logits(target: Target, drafter: Drafter, records: list[SequenceRecord]) -> tuple[torch.Tensor, ...]:
    """Teacher and student logits at every drafted slot of `records` (fp32 copies), from the packed replay the
    scorer and the learner run."""
    with torch.no_grad():
        batch = score(target, records, block_size=drafter.block_size).to(target.device)
        teacher = teacher_head(target)(batch.teacher)
        return teacher.float(), drafter.logits(student_hidden(drafter, batch)).float()


def errors(reference: torch.Tensor, low: torch.Tensor) -> dict[str, float]:
    """Relative error by norm (the logits of random weights centre on 0, so the norm is their scale) and the
    largest absolute error of the logits and of the log-probs the loss reads."""
    diff = low - reference
    logprobs = torch.log_softmax(low, -1) - torch.log_softmax(reference, -1)
    return {"rel": (diff.norm() / reference.norm()).item(), "max_abs": diff.abs().max().item(),
            "logprob_max_abs": logprobs.abs().max().item(), "reference_rms": reference.pow(2).mean().sqrt().item()}


def replay_bf16(ctx: Context, deadline: float) -> tuple[bool, dict]:
    """The bf16 models take the fp32 models' weights, so only the arithmetic differs; they are built as bf16 (not
    cast from fp32), so their rotary tables stay fp32 as a loaded checkpoint's do. The fp32 copies are freed
    before the scorer's peak is measured."""
    reference_target, reference_drafter = gpu.build(ctx.plan, ctx.device, torch.float32, "sdpa")
    records = ctx.records()
    reference = replay_logits(reference_target, reference_drafter, records)
    target, drafter = ctx.models()
    target.model.load_state_dict(reference_target.model.state_dict())
    drafter.load_state_dict(reference_drafter.state_dict())
    del reference_target, reference_drafter
    ctx.free()
    with torch.no_grad():
        _, peak = peak_bytes(ctx, lambda: score(target, records, block_size=drafter.block_size))
    resident = unique_bytes(list(target.model.parameters()))
    ctx.peaks["scorer"] = {"transient": peak, "resident": resident}
    low = replay_logits(target, drafter, records)
    out = {name: errors(ref, got) for name, ref, got in zip(("teacher", "student"), reference, low)}
    out |= {"tolerance_rel": BF16_REL_TOL, "slots": int(reference[0].shape[0] * reference[0].shape[1]),
            "response_tokens": len(records[0].response_ids), "blocks": records[0].num_steps}
    out["summary"] = ", ".join(f"{k} rel {out[k]['rel']:.2e} max|Δ| {out[k]['max_abs']:.2e}"
                               for k in ("teacher", "student"))
    return all(out[k]["rel"] <= BF16_REL_TOL for k in ("teacher", "student")), out


def learner_spec() -> ExperimentSpec:
    """The paper's learner settings, with a constant learning rate so that the first steps move the weights."""
    return validate_spec({"steps": 1000, "models": {"target_path": "random"},
                          "data": {"train_prompts": "-", "eval_prompts": "-"},
                          "optim": {"schedule": "constant", "warmup_ratio": 0.0}}, check_paths=False)


def learner(ctx: Context, deadline: float) -> tuple[bool, dict]:
    """Steps on one repeated scored sequence: a working step lowers the loss on the batch it stepped on."""
    target, drafter = ctx.models()
    with torch.no_grad():
        scored = score(target, ctx.records(), block_size=drafter.block_size)
    ctx.spec = spec = learner_spec()
    seconds: list[float] = []

    def train() -> list:
        trainer, metrics = Learner(spec, drafter), []
        while len(metrics) < LEARNER_STEPS and time.monotonic() < deadline:
            t0 = time.perf_counter()
            metrics.append(trainer.train_step([scored]))
            ctx.sync()
            seconds.append(time.perf_counter() - t0)
        return metrics

    metrics, peak = peak_bytes(ctx, train)
    resident = unique_bytes([*drafter.parameters(), *target.embed_tokens.parameters(), *target.lm_head.parameters()])
    ctx.peaks["learner"] = {"transient": peak, "resident": resident}
    losses = [m.loss for m in metrics]
    out = {"losses": losses, "skipped_steps": sum(m.skipped for m in metrics), "step_seconds": seconds,
           "anchors": int(scored.block_valid.sum()), "lr": spec.optim.lr,
           "summary": f"{len(losses)} steps, loss " + " → ".join(f"{x:.4g}" for x in losses)}
    ok = (len(losses) == LEARNER_STEPS and all(math.isfinite(x) for x in losses) and out["skipped_steps"] == 0
          and losses[-1] < losses[0])
    return ok, out


class SectionClock(gpu.Clock):
    """bench/gpu.py's clock, its decode deadline this script's."""

    def __init__(self, budget_s: float, device: torch.device, until: float) -> None:
        super().__init__(budget_s, device)
        self.until = until

    def deadline(self, section: str) -> float:
        return self.until


def decode(ctx: Context, deadline: float) -> tuple[bool, dict]:
    """bench/gpu.py's decoding rows; random drafts are rarely accepted, so these are the cost side (tokens/s)."""
    target, drafter = ctx.models()
    drafter.eval()  # the learner left it in training mode
    clock = SectionClock(ctx.budget_s, ctx.device, deadline)
    rows = gpu.bench_decode(target, drafter, ctx.plan, clock)
    block = drafter.block_size
    speculative = {r["batch"] for r in rows if r["mode"] == "speculative"}
    ok = (speculative == set(ctx.plan.decode_batches) and not clock.skipped
          and all(r["tokens_per_s"] > 0 and 1 <= r.get("tau", 1) <= block for r in rows))
    summary = ", ".join(f"{r['mode']} b{r['batch']} {r['tokens_per_s']:.0f} tok/s" for r in rows)
    return ok, {"rows": rows, "skipped": clock.skipped, "block_size": block, "summary": summary}


def qwen3_shape(shapes: dict) -> Qwen3Shape:
    """bench/projection.py's shape of a target from its config fields (Qwen3-4B's equals TARGETS['Qwen3-4B'])."""
    return Qwen3Shape(hidden=shapes["hidden_size"], intermediate=shapes["intermediate_size"],
                      layers=shapes["num_hidden_layers"], kv_heads=shapes["num_key_value_heads"],
                      tied=shapes["tie_word_embeddings"], heads=shapes["num_attention_heads"],
                      head_dim=shapes["head_dim"], vocab=shapes["vocab_size"])


def projection(ctx: Context) -> dict[str, dict[str, float]]:
    """bench/projection.py's bytes by part for the scorer and the learner at this run's shapes, length and τ: one
    sequence per micro-batch and per rollout batch, as measured here, and no expected-acceptance diagnostic (the
    replay measured here does not compute it). Its measured inputs come from bench/results/scale.json."""
    stored = json.loads(SCALE_JSON.read_text())
    teacher, student = attention_fits(stored["attention"])
    target, _ = ctx.models()
    record = ctx.records()[0]
    tokens, tau = len(record.response_ids), len(record.response_ids) / record.num_steps
    spec = ctx.spec or learner_spec()
    fields = {"prompt": len(record.prompt_ids), "micro": 1, "rollout_rows": 1, "layout": "draft_opd",
              "drafter_layers": ctx.plan.drafter_layers, "features": len(target.layer_ids),
              "block": ctx.plan.block_size, "chunk": spec.optim.loss_chunk_size}
    q = qwen3_shape(ctx.plan.shapes)
    seq = sequence_bytes(q, fields, tokens, tau)
    return {"scorer": scorer_role(q, fields, tokens, tau, teacher, 0.0, seq),
            "learner": learner_role(q, fields, tokens, tau, student, stored["chunk_bytes_per_slot"], seq)}


def memory(ctx: Context, deadline: float) -> tuple[bool, dict]:
    """Measured = the weights the role's projection counts as resident (their real bytes) + the peak the section
    allocated above what it started with; the projection's parts are bench/projection.py's."""
    if not ctx.peaks:
        raise SectionSkipped("no peak measured: the replay_bf16 and learner sections did not get that far")
    projected = projection(ctx)
    out: dict[str, Any] = {"ratio_max": MEMORY_RATIO_MAX, "roles": {}}
    for role, peak in ctx.peaks.items():
        measured, parts = peak["resident"] + peak["transient"], projected[role]
        total = sum(parts.values())
        out["roles"][role] = {"measured_gb": measured / GB, "projected_gb": total / GB,
                              "ratio": measured / total, "measured_parts_gb": {k: v / GB for k, v in peak.items()},
                              "projected_parts_gb": {k: v / GB for k, v in parts.items()}}
    roles = out["roles"]
    out["summary"] = ", ".join(f"{role} {r['measured_gb']:.3g}/{r['projected_gb']:.3g} GB = {r['ratio']:.2f}"
                               for role, r in roles.items())
    return all(0 < r["ratio"] <= MEMORY_RATIO_MAX for r in roles.values()), out


@dataclass(frozen=True)
class Section:
    """A check, the function that runs it and its pass criterion as the table and the result file state it."""

    name: str
    run: Callable[[Context, float], tuple[bool, dict]]
    criterion: str


SECTIONS = (
    Section("lossless", lossless, "greedy == autoregressive; chi2 < 0.1% critical value at T=0.6 and T=1.0"),
    Section("replay_bf16", replay_bf16, f"bf16 vs fp32 logits: ‖Δ‖/‖fp32‖ ≤ {BF16_REL_TOL} (teacher, student)"),
    Section("learner", learner, f"{LEARNER_STEPS} steps on one batch: finite, none skipped, last loss < first"),
    Section("decode", decode, "every batch decoded in time, tokens/s > 0, 1 ≤ τ ≤ K"),
    Section("memory", memory, f"measured / bench/projection.py projection ≤ {MEMORY_RATIO_MAX} (scorer, learner)"),
)


def _overrun(signum: int, frame: object) -> None:
    raise Overrun("still running past the section's deadline and its grace")


def run_section(section: Section, ctx: Context, deadline: float, grace: float) -> dict:
    """One section, stopped by SIGALRM `grace` seconds past its deadline; any error is recorded, not raised."""
    t0 = time.monotonic()
    result: dict[str, Any] = {"criterion": section.criterion}
    if t0 >= deadline:
        return result | {"status": "skipped", "seconds": 0.0, "reason": "no time left in the budget"}
    signal.signal(signal.SIGALRM, _overrun)
    signal.setitimer(signal.ITIMER_REAL, deadline + grace - t0)
    try:
        ok, numbers = section.run(ctx, deadline)
        result |= {"status": "passed" if ok else "failed", **numbers}
    except SectionSkipped as exc:
        result |= {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # a failed section is a result; the sections after it still run
        result |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc().splitlines()[-16:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    ctx.free()
    return result | {"seconds": time.monotonic() - t0}


def environment(device: torch.device) -> dict:
    """Where the numbers came from: the device and the versions actually imported (the carried wheels or not)."""
    env = {"device": device.type, "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
           "transformers_path": str(Path(transformers.__file__).parent), "device_name": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device_name": props.name, "device_memory_gib": props.total_memory / 2**30}
    return env


def print_table(result: dict) -> None:
    env = result["environment"]
    table = Table(title=f"GPU first light: {env['device_name']}, torch {env['torch']}, transformers "
                        f"{env['transformers']}{', tiny shapes' if result['tiny'] else ''}, "
                        f"{result['elapsed_s']:.0f} s of {result['budget_s']:.0f}")
    for column in ("section", "status", "s", "result", "pass criterion"):
        table.add_column(column, overflow="fold")
    colour = {"passed": "green", "failed": "red", "skipped": "yellow"}
    for name, r in result["sections"].items():
        detail = r.get("summary") or r.get("error") or r.get("reason", "")
        table.add_row(name, f"[{colour[r['status']]}]{r['status']}[/]", f"{r['seconds']:.1f}", escape(detail),
                      escape(r["criterion"]))
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def default_output(tiny: bool) -> Path:
    name = "gpu_first_light_tiny.json" if tiny else "gpu_first_light.json"
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else RESULTS / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes: seconds on a CPU")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="wall time for all sections, model builds included (default 400)")
    parser.add_argument("--json", metavar="OUT", help="default: $OUT/gpu_first_light.json if OUT is set, else "
                                                      "bench/results/ (gpu_first_light_tiny.json with --tiny)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    ctx = Context(TINY if args.tiny else FULL, device, args.budget_s)
    start = time.monotonic()
    sections = {s.name: run_section(s, ctx, start + SHARES[s.name] * args.budget_s, GRACE_SHARE * args.budget_s)
                for s in SECTIONS}
    result = {"environment": environment(device), "tiny": args.tiny, "budget_s": args.budget_s,
              "elapsed_s": time.monotonic() - start, "plan": dataclasses.asdict(ctx.plan),
              "lossless_samples": ctx.settings.lossless_samples, "dtype": "bfloat16", "attn_implementation": "sdpa",
              "note": "random weights: τ and the learner's loss are meaningless beyond the pass criteria",
              "sections": sections}
    print_table(result)
    out = Path(args.json) if args.json else default_output(args.tiny)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["status"] != "failed" for r in sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
