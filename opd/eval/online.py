"""`opd eval`: acceptance length and speedup of a drafter on held-out prompts.

Speculative and autoregressive decoding run on the same prompts, batch by batch and interleaved in one process,
so the speedup is a side-by-side ratio rather than two timings taken minutes apart on a noisy machine.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from opd.data.prompts import Prompt, prompt_key, spec_prompts
from opd.decoding.autoregressive import generate_autoregressive
from opd.decoding.sampling import Sampling
from opd.decoding.speculative import SpeculativeDecoder
from opd.eval.acceptance import AcceptanceStats
from opd.eval.acceptance_diagnostic import Diagnosis
from opd.eval.ceiling import full_acceptance
from opd.eval.expected import point_mass_settings
from opd.eval.row import EvalRow
from opd.models.build import Models, build_models
from opd.outputs import check_output_file, write_text_atomic
from opd.progress import progress_bar, table_console
from opd.sources.provenance import Provenance
from opd.spec import ExperimentSpec, SamplingSpec


def evaluate(models: Models, prompts: list[Prompt], samplings: list[SamplingSpec], *, max_new_tokens: int,
             batch_size: int, seed: int = 0, baseline: bool = True, draft_version: int = 0,
             static_cache: bool = False, compiled: bool = False, diagnose: bool = False) -> list[EvalRow]:
    """One row per sampling setting. `diagnose`: also replay each setting's records through the target and give
    the expected acceptance of every point-mass setting on those states (`EvalRow.expected`)."""
    decoder = SpeculativeDecoder(models.target, models.drafter, eos_id=models.eos_id, draft_version=draft_version,
                                 static_cache=static_cache, compiled=compiled)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    rows = []
    with progress_bar() as bar:
        for setting in samplings:
            task = bar.add_task(f"eval {setting.name}", total=len(batches))
            rows.append(_evaluate_setting(models, decoder, batches, setting, max_new_tokens, seed, baseline,
                                          lambda: bar.advance(task), samplings if diagnose else []))
    return rows


def _evaluate_setting(models, decoder, batches, setting, max_new_tokens, seed, baseline, tick,
                      diagnosed: list[SamplingSpec]) -> EvalRow:
    sampling = Sampling.of(setting, sample_drafts=setting.draft == "sample")
    records, spec_time, ar_time, ar_tokens, matches = [], 0.0, 0.0, 0, 0
    # Point-mass rules apply to any point-mass decoding's drafts; a q-sampled setting's own rule to its own states.
    sampled = {setting.name: sampling} if diagnosed else {}
    expected = Diagnosis(models, point_mass_settings(diagnosed) if setting.draft == "argmax" else sampled)
    for batch in batches:
        ids, keys = [p.ids for p in batch], [prompt_key(p.id) for p in batch]
        t0 = time.perf_counter()
        out = decoder.generate(ids, sampling, max_new_tokens=max_new_tokens, seed=seed, keys=keys)
        spec_time += time.perf_counter() - t0
        records += out
        expected.add(out)
        if baseline:
            t0 = time.perf_counter()
            ar = generate_autoregressive(models.target, ids, sampling, max_new_tokens=max_new_tokens,
                                         eos_id=models.eos_id, seed=seed, keys=keys)
            ar_time += time.perf_counter() - t0
            ar_tokens += sum(len(r) for r in ar)
            matches += sum(a == r.response_ids for a, r in zip(ar, out))
        tick()
    block_size = models.drafter.block_size
    stats = AcceptanceStats.from_records(records, block_size)
    # a sampled-draft setting's ceiling is full acceptance (q = p) on the text it decoded; a point-mass one's needs
    # the target's argmax on stored samples (opd/eval/offline.py)
    ceiling = (AcceptanceStats.from_records(full_acceptance(records, block_size), block_size).tau
               if setting.draft == "sample" else None)
    spec_tps = sum(len(r.response_ids) for r in records) / spec_time
    ar_tps = ar_tokens / ar_time if baseline else None
    return EvalRow(
        sampling=setting.name, prompts=len(records), tau=stats.tau, tau_token_weighted=stats.tau_token_weighted,
        survival=stats.survival, first_rejection=stats.first_rejection, spec_tokens_per_s=spec_tps,
        ar_tokens_per_s=ar_tps, speedup=spec_tps / ar_tps if ar_tps is not None else None,
        greedy_match=matches / len(records) if baseline and sampling.greedy else None, expected=expected.result(),
        tau_ci=stats.tau_ci, ceiling=ceiling)


def print_rows(rows: list[EvalRow], console: Console | None = None) -> None:
    console = console or table_console()
    main = Table(title="Speculative decoding on held-out prompts")
    for column in ("sampling", "n", "τ (95% CI over prompts)", "τ tok-wt", "ceiling", "how", "spec tok/s",
                   "AR tok/s", "speedup", "greedy=AR"):
        main.add_column(column, justify="right")
    for r in rows:
        main.add_row(r.sampling, str(r.prompts), f"{r.tau:.3f} ± {r.tau_ci:.3f}", f"{r.tau_token_weighted:.3f}",
                     _opt(r.ceiling, "{:.3f}"), "offline" if r.offline else "decoded", _opt(r.spec_tokens_per_s, "{:.1f}"),
                     _opt(r.ar_tokens_per_s, "{:.1f}"), _opt(r.speedup, "{:.2f}x"), _opt(r.greedy_match, "{:.0%}"))
    console.print(main)
    console.print("τ: mean of per-response means (z-lab's Average Acceptance length); τ tok-wt: written tokens / "
                  "verification steps (a final block counts only the tokens it wrote); ceiling: τ of the "
                  "argmax oracle on the same samples (sampled drafts: full acceptance, q = p); offline: blocks "
                  "rebuilt on stored target samples (exact in distribution), decoded: speculative decoding.")
    drafted = len(rows[0].survival)
    survival = Table(title="Per-position acceptance P(accepted >= k)")
    hist = Table(title="First rejected position (share of blocks)")
    survival.add_column("sampling")
    hist.add_column("sampling")
    for k in range(1, drafted + 1):
        survival.add_column(str(k), justify="right")
        hist.add_column(str(k), justify="right")
    hist.add_column("full accept", justify="right")
    for r in rows:
        survival.add_row(r.sampling, *(f"{x:.2f}" for x in r.survival))
        hist.add_row(r.sampling, *(f"{x:.1%}" for x in r.first_rejection))
    console.print(survival)
    console.print(hist)
    if any(r.expected for r in rows):
        print_expected(rows, console)


def print_expected(rows: list[EvalRow], console: Console) -> None:
    """The diagnostic: on the states each setting's decoding visited, the exact expected τ and per-position
    acceptance a_k of every point-mass setting. The diagonal predicts the measured τ above."""
    names = list(next(r.expected for r in rows if r.expected))
    table = Table(title="Expected τ from p and q (rows: whose decoding visited the states; columns: acceptance "
                        "rule)")
    table.add_column("states from")
    table.add_column("measured τ tok-wt", justify="right")
    for name in names:
        table.add_column(f"expected τ {name}", justify="right")
    for r in rows:
        table.add_row(r.sampling, f"{r.tau_token_weighted:.3f}",
                      *(f"{r.expected[n].tau_token_weighted:.3f}" if n in r.expected else "-" for n in names))
    console.print(table)
    drafted = len(rows[0].survival)
    slots = Table(title="Expected acceptance a_k at drafted position k (given the drafted prefix)")
    slots.add_column("states from")
    slots.add_column("rule")
    for k in range(1, drafted + 1):
        slots.add_column(str(k), justify="right")
    for r in rows:
        for name, e in r.expected.items():
            slots.add_row(r.sampling, name, *(f"{a:.2f}" for a in e.slot))
    console.print(slots)


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def run_eval(spec: ExperimentSpec, draft: str | None, prompts_file: str | None, json_out: str | None,
             samples: str | None = None) -> int:
    """`opd eval`: decode, or with stored samples (`samples`, else eval.samples_path unless eval.offline is false)
    rebuild offline every point-mass setting and decode only the others (`draft: sample`)."""
    from opd.eval.offline import OfflineEval, check_samples_file

    field = "--samples" if samples else "eval.samples_path"  # the one the user set, named in a refusal
    samples = samples or (spec.eval.samples_path if spec.eval.offline else None)  # eval.offline false: decode
    if samples:
        check_samples_file(samples, field)
    if json_out:
        check_output_file(json_out, "--json", "the results")
    models = build_models(spec, draft)
    prompts = spec_prompts(spec.data, prompts_file or spec.data.eval_prompts, models.tokenizer, spec.eval.num_prompts)
    e = spec.eval
    offline = (OfflineEval(models, samples, prompts.prompts, e.sampling, Provenance.of(spec, e.max_new_tokens),
                           field=field).evaluate(models.drafter, diagnose=True) if samples else [])
    drafter = draft or spec.models.drafter_path
    print(f"drafter: {models.drafter.kind}, "
          f"{'a fresh one of the spec' if drafter in (None, 'random') else drafter} (target {spec.models.target_path})")
    decoded = [s for s in e.sampling if s.name not in {r.sampling for r in offline}]
    rows = offline + (evaluate(models, prompts.prompts, decoded, max_new_tokens=e.max_new_tokens,
                               batch_size=e.batch_size, seed=spec.seed, static_cache=spec.rollout.static_cache,
                               compiled=spec.rollout.compile, diagnose=True) if decoded else [])
    print_rows(rows)
    if json_out:
        write_text_atomic(json_out, json.dumps({"draft": drafter, "kind": models.drafter.kind,
                                                "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0
