"""Offline τ: held-out acceptance of any drafter from stored target samples, without decoding.

With point-mass drafts a speculative decode's blocks are a function of (prompt, response, drafter), and the
response is a target sample whatever the drafter (decoding is lossless). So store target samples of the eval
prompts at each point-mass eval setting once (`opd gen-samples --eval`), and rebuild any drafter's blocks on them
(opd/sources/rebuild.py): τ, per-position acceptance and the first-rejection histogram are exactly what decoding would
give, in distribution. When the samples were decoded by drafter D with the eval's keyed random numbers, D's
offline blocks equal its decoded ones block by block.

The target's view of the samples (their features) does not depend on the drafter, so it is computed once and
cached, in memory, keyed by the target's files and the samples file's content and bounded in bytes: evaluating
n drafters then costs one target pass plus n drafter walks, where decoding costs n full speculative decodes.
Settings with `draft: sample` cannot be rebuilt (their drafts are random) and the speedup is a wall-clock
measurement: both still decode.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.data.prompts import Prompt, prompt_key
from opd.decoding.record import SequenceRecord
from opd.errors import OpdError
from opd.eval.acceptance import AcceptanceStats
from opd.eval.acceptance_diagnostic import Diagnosis
from opd.eval.ceiling import oracle_records, text_view
from opd.eval.expected import point_mass_settings
from opd.eval.row import EvalRow
from opd.models.build import Models
from opd.models.target import Target
from opd.progress import progress_bar
from opd.sources.provenance import Provenance
from opd.sources.rebuild import rebuild_records
from opd.sources.store import GEN_CHUNK, SampleStore, Wanted, sampler_draw, setting_key
from opd.spec import SamplingSpec

CACHE_BYTES = 4 * 1024**3  # the target views kept in memory per process; older ones are dropped first
# Sequences walked at once: each walk step is one drafter call for every live row, so wider batches amortise the
# per-step overhead (on the tiny CPU models 64 beat 8, and wider did not help; measured once, commit 8f27d6f, and held
# in no file of bench/results); memory is the batch's features and drafter context cache, ~5 GB at Qwen3-4B shapes, 2048
# tokens, bf16.
BATCH = 64


@dataclass
class SettingView:
    """One eval setting's stored samples (as records without blocks) and the target's features of each."""

    setting: SamplingSpec
    samples: list[SequenceRecord]
    features: list[torch.Tensor]
    argmax: list[torch.Tensor]  # the target's argmax at each response position, from the same forward (ceiling)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.features)


_views: OrderedDict[tuple, SettingView] = OrderedDict()


def cached_view(key: tuple, make) -> SettingView:
    """The view under `key`, made by `make()` when absent; least recently used views leave past CACHE_BYTES (the
    newest always stays: at Qwen3-4B shapes one setting's 200 samples are ~12 GB of bf16 features)."""
    if key in _views:
        _views.move_to_end(key)
        return _views[key]
    view = _views[key] = make()
    while len(_views) > 1 and sum(v.nbytes for v in _views.values()) > CACHE_BYTES:
        _views.popitem(last=False)
    return view


def target_identity(target: Target) -> tuple:
    """What names the target's view: its directory and the size and mtime of every file in it (a retrained or
    replaced target changes them), or the object itself when it was not loaded from files; and which layers it
    captures in which dtype (a DFlash and an EAGLE-3 drafter read different layers of the same target)."""
    capture = ("layers", *target.layer_ids, str(target.dtype))
    name = getattr(target.model.config, "_name_or_path", "")
    if not name or not Path(name).is_dir():
        return ("object", id(target), *capture)
    path = Path(name)
    files = sorted(f for f in path.iterdir() if f.is_file())
    return (str(path.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files), *capture)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_samples_file(path: str | Path | None, field: str) -> str | Path:
    """`path`, once held-out samples exist there, or one line naming the draw that writes them there; commands
    call it before loading any model and go on with the path it returns, no longer optional."""
    if not path:
        raise OpdError(f"{field}: no held-out target samples given (expected a file; draw them with "
                       "`opd gen-samples CONFIG --eval` and pass its --out here)")
    if not Path(path).is_file():
        raise OpdError(f"{field}: {path} is not a file (expected held-out target samples; draw them with "
                       f"`opd gen-samples CONFIG --eval --out {path}`)")
    return path


def stale_advice(field: str) -> str | None:
    """What to do about held-out samples this run cannot read, phrased to work when followed: drawing into a
    file made under other settings cannot mend it, so the draw goes to a new file, which `field` then names.
    None for a reader this module cannot advise (the store's own wording applies)."""
    use = {"eval.samples_path": "--set eval.samples_path=NEW.jsonl", "--samples": "--samples NEW.jsonl"}
    if field not in (*use, "--out"):
        return None
    then = f", then pass `{use[field]}`" if field in use else ""
    decode = ", or decode instead of reading samples: `--set eval.samples_path=null`" if field == "eval.samples_path" \
        else ""
    return f"draw this run's into a new file with `opd gen-samples CONFIG --eval --out NEW.jsonl`{then}{decode}"


def check_eval_samples(spec, prompts: list[Prompt], path: str | Path, field: str, *, complete: bool = True) -> None:
    """The held-out samples in `path` were made as `spec` makes them and (`complete`) hold every one its eval of
    `prompts` reads, or StaleSamples with the working advice (other problems as OpdError). Cheap: reads the file,
    loads no model, so a command calls it before any compute."""
    settings = [s for s in spec.eval.sampling if s.draft == "argmax"]
    store = SampleStore.of(spec, path, settings, prompts, spec.eval.max_new_tokens, field=field, pool_name=None,
                           redraw="opd gen-samples CONFIG --eval", stale=stale_advice(field))
    if complete:
        store.fetch([Wanted(p, i, 0) for i in range(len(settings)) for p in prompts])


class OfflineEval:
    """Held-out τ of any drafter on the stored samples in `path` of `prompts`, for every point-mass setting in
    `settings` (the others are the caller's to decode)."""

    def __init__(self, models: Models, path: str | Path, prompts: list[Prompt], settings: list[SamplingSpec],
                 made: Provenance, *, batch_size: int = BATCH, field: str = "eval.samples_path",
                 redraw: str = "opd gen-samples CONFIG --eval") -> None:
        """`made`: what the samples must have been made by (`Provenance.of(spec, spec.eval.max_new_tokens)`);
        `redraw`: the command a refusal names to draw them again."""
        self.models, self.batch_size = models, batch_size
        self.settings = [s for s in settings if s.draft == "argmax"]
        check_samples_file(path, field)
        store = SampleStore(path, self.settings, prompts, made, vocab_size=models.target.vocab_size, field=field,
                            pool_name=None, redraw=redraw, stale=stale_advice(field))
        # the view depends on the target, the samples' bytes, which prompts are read and at which setting
        base = (target_identity(models.target), file_digest(store.path), tuple(p.id for p in prompts))
        self.views = [cached_view((*base, setting_key(s), s.name), lambda i=i, s=s: self._view(store, prompts, i, s))
                      for i, s in enumerate(self.settings)]

    def evaluate(self, drafter, *, diagnose: bool = False, draft_version: int = 0,
                 names: set[str] | None = None) -> list[EvalRow]:
        """One row per point-mass setting (or those in `names`); `diagnose`: the expected-acceptance diagnostic on
        the rebuilt states beside the realised τ (as `opd.eval.online.evaluate` gives it on decoded states)."""
        rows = []
        for view in self.views:
            if names is not None and view.setting.name not in names:
                continue
            records = self.records(view, drafter, draft_version)
            stats = AcceptanceStats.from_records(records, drafter.block_size)
            diagnosis = Diagnosis(Models(self.models.target, drafter, self.models.tokenizer),
                                  point_mass_settings(self.settings) if diagnose else {})
            for start in range(0, len(records), self.batch_size):
                diagnosis.add(records[start : start + self.batch_size])
            rows.append(EvalRow(sampling=view.setting.name, prompts=len(records), tau=stats.tau,
                                tau_token_weighted=stats.tau_token_weighted, survival=stats.survival,
                                first_rejection=stats.first_rejection, spec_tokens_per_s=None, ar_tokens_per_s=None,
                                speedup=None, greedy_match=None, expected=diagnosis.result(), tau_ci=stats.tau_ci,
                                offline=True, ceiling=self.ceiling(view, drafter.block_size).tau))
        return rows

    def records(self, view: SettingView, drafter, draft_version: int = 0) -> list[SequenceRecord]:
        """`drafter`'s blocks on one setting's samples, as its decoding would have recorded them."""
        return rebuild_records(self.models.target, drafter, view.samples, features=view.features,
                               batch_size=self.batch_size, draft_version=draft_version)

    def ceiling(self, view: SettingView, block_size: int) -> AcceptanceStats:
        """The argmax oracle's acceptance on one setting's samples (opd/eval/ceiling.py)."""
        return AcceptanceStats.from_records(oracle_records(view.samples, view.argmax, block_size), block_size)

    def _view(self, store: SampleStore, prompts: list[Prompt], index: int, setting: SamplingSpec) -> SettingView:
        stored = store.fetch([Wanted(p, index, 0) for p in prompts])
        eos = self.models.eos_id
        samples = [SequenceRecord.from_text(prompt_key(p.id), p.ids, s.response, eos) for p, s in zip(prompts, stored)]
        return SettingView(setting, samples, *text_view(self.models.target, samples, self.batch_size))


def draw_eval_samples(spec, sampler, prompts: list[Prompt], path: str | Path, *, field: str = "eval.samples_path",
                      redraw: str = "opd gen-samples CONFIG --eval", stale: str | None = None) -> Path:
    """Store one target sample of each held-out prompt at every point-mass eval setting in `path` (resumable),
    drawn by `sampler` (opd/sources/samplers.py) with the eval's length, seed and keys: drawn by the speculative
    decoder with drafter D, they are exactly D's decodes, so D's offline τ is its decoded τ. `field` and `redraw`
    name the file and the command that draws it in refusals, `stale` the advice when it holds samples made
    otherwise (see `SampleStore`)."""
    settings = [s for s in spec.eval.sampling if s.draft == "argmax"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    store = SampleStore.of(spec, path, settings, prompts, spec.eval.max_new_tokens, field=field,
                           pool_name="the held-out prompts", redraw=redraw, stale=stale)
    wanted = [Wanted(p, i, 0) for i in range(len(settings)) for p in prompts]
    draw = sampler_draw(sampler, settings, spec.eval.max_new_tokens, spec.seed)
    with progress_bar() as bar:
        task = bar.add_task("held-out samples", total=len(wanted))
        for start in range(0, len(wanted), GEN_CHUNK):
            store.fetch(wanted[start : start + GEN_CHUNK], draw)
            bar.advance(task, len(wanted[start : start + GEN_CHUNK]))
    return Path(path)
