"""The one store of target samples: the files `opd gen-samples` writes, rollout reads (`rollout.source: samples`)
or fills as a shared cache (`rollout.source: target` with a `samples_path`), offline evaluation reads (held-out
prompts, `--eval`) and `opd sft` trains on (`--sft`: the SFT data).

A target sample does not depend on the drafter, so it can be drawn once (on vLLM, unpatched) and trained on by any
number of runs: every arm of a seed in `opd reproduce`, and every epoch when rollouts are greedy. One jsonl row per
sample, carrying what made it (opd/sources/provenance.py) and what drawing it cost (every run that trains on it is
charged that):

    {"id": prompt id, "prompt_ids": [...], "response_ids": [...],
     "sampling": {"temperature": T, "top_p": P, "top_k": K}, "sample": j, "max_new_tokens": N,
     "made_by": {"target": digest, "tokenizer": digest, "render": "raw" | "chat", "enable_thinking": ...},
     "flops": {"target_forward": ..., "drafter_forward": ..., "drafter_train": 0}}

Every field is type-checked as the row is read, before any compute, and a row made under another provenance is
refused in one line naming the field and both values. Rows at other sampling settings are skipped, so one file
serves runs with different settings; two different rows for one (setting, prompt, sample) are refused.

Rollout batch i of a run reads, for each of its (prompt, epoch) pairs, sample `epoch` of that prompt at the batch's
setting (`rollout.settings`, i mod their count): the data cursor's order, so a resumed or re-produced batch reads
the same rows. A greedy sample is deterministic, so sample 0 serves every epoch; sampled ones may not repeat (a
repeated sample is not a fresh draw from the target), so the file must hold as many as the step budget reaches.
"""

from __future__ import annotations

import fcntl
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from opd.data.prompts import Prompt, prompt_key
from opd.decoding.sampling import Sampling
from opd.errors import OpdError
from opd.models.flops import FlopCounter
from opd.sources.provenance import Provenance, target_vocab_size
from opd.spec import ExperimentSpec, RolloutSampling, SamplingSpec

GEN_CHUNK = 64  # samples per sampler call while filling a file; the file is flushed after each
Key = tuple[tuple[float, float, int], str, int]  # (setting, prompt id, sample number)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _SamplingRow(_Strict):
    temperature: StrictFloat | StrictInt
    top_p: StrictFloat | StrictInt
    top_k: StrictInt


class _MadeByRow(_Strict):
    target: StrictStr
    tokenizer: StrictStr
    render: StrictStr
    enable_thinking: StrictBool | None
    served_from: list[StrictStr] | None = None  # imported rows: the digests of the logs (opd/sources/served.py)


class _FlopsRow(_Strict):
    target_forward: StrictFloat | StrictInt = 0.0
    drafter_forward: StrictFloat | StrictInt = 0.0
    drafter_train: StrictFloat | StrictInt = 0.0


class SampleRow(_Strict):
    """One stored sample as read from a file: every field typed, unknown ones refused."""

    id: StrictStr
    prompt_ids: list[StrictInt]
    response_ids: list[StrictInt]
    sampling: _SamplingRow
    sample: StrictInt
    max_new_tokens: StrictInt
    made_by: _MadeByRow
    flops: _FlopsRow = _FlopsRow()

    @property
    def provenance(self) -> Provenance:
        return Provenance(**self.made_by.model_dump(exclude={"served_from"}), max_new_tokens=self.max_new_tokens)


def setting_key(setting: RolloutSampling | SamplingSpec | Sampling | dict) -> tuple[float, float, int]:
    """(temperature, top_p, top_k): how a row's sampling is matched to a batch's."""
    get: Callable[[str], Any] = setting.get if isinstance(setting, dict) else lambda name: getattr(setting, name)
    return float(get("temperature")), float(get("top_p")), int(get("top_k"))


def describe(key: tuple[float, float, int]) -> str:
    return f"temperature {key[0]:g}, top_p {key[1]:g}, top_k {key[2]}"


def samples_needed(spec: ExperimentSpec, num_prompts: int) -> list[int]:
    """Per rollout setting, how many samples of every prompt the step budget reads: 1 for greedy, else one per
    epoch its batches reach (batch i holds global prompt positions i*size .. (i+1)*size-1; epoch = position // n)."""
    settings, size = spec.rollout.settings, spec.rollout.batch_size
    total = spec.total_steps * spec.batches_per_step
    out = []
    for s, setting in enumerate(settings):
        last = max((i for i in range(s, total, len(settings))), default=None)
        if setting.temperature == 0 or last is None:
            out.append(1)
        else:
            out.append(((last + 1) * size - 1) // num_prompts + 1)
    return out


@dataclass
class StoredSample:
    response: list[int]
    flops: FlopCounter  # what drawing it cost; a run that trains on it is charged this


@dataclass
class Wanted:
    """One sample a batch reads: `prompt` at rollout setting `setting` (an index into `rollout.settings`), draw `j`."""

    prompt: Prompt
    setting: int
    j: int


class StaleSamples(OpdError):
    """A file that cannot serve a run as it stands: its rows were made under another provenance, or it lacks a
    wanted sample. `reason` is the line without its advice, for a caller that draws fresh samples elsewhere
    instead of refusing (`opd train` and `opd run` with stale eval samples, opd/commands/launch.py)."""

    def __init__(self, reason: str, advice: str) -> None:
        super().__init__(f"{reason} ({advice})")
        self.reason = reason


# samples at one setting -> their responses and what each cost
Draw = Callable[[list[Wanted]], tuple[list[list[int]], list[FlopCounter]]]


def wanted(spec: ExperimentSpec, prompt: Prompt, setting: int, epoch: int) -> Wanted:
    """The sample a batch reads for `prompt` at `setting` in `epoch`: a greedy sample serves every epoch."""
    return Wanted(prompt, setting, 0 if spec.rollout.settings[setting].temperature == 0 else epoch)


ROLLOUT_STALE = ("draw this run's into a new file with `opd gen-samples CONFIG --out NEW.jsonl`, then pass "
                 "`--set rollout.samples_path=NEW.jsonl`")


class SampleStore:
    """The rows of one sample file that a run can use: those at its rollout settings, checked against its prompt
    pool. Rows at other settings are skipped, so one file can serve runs with different settings. With a `Draw`,
    `fetch` draws what the file lacks and appends it (a cache shared by every run that names the file)."""

    def __init__(self, path: str | Path, settings: list, prompts: list[Prompt], made: Provenance, *,
                 vocab_size: int | None = None, field: str = "rollout.samples_path",
                 pool_name: str | None = "data.train_prompts", redraw: str = "opd gen-samples CONFIG",
                 stale: str | None = None) -> None:
        """`settings`: the run's sampling settings (rollout's, eval's point-mass ones, or SFT's one), indexed by
        `Wanted`; `made`: what the run's samples must have been made by; token ids must be below `vocab_size`.
        `field` and `pool_name` name the file and the prompts in error messages, `redraw` the command that draws
        the file's samples, `stale` the advice for a file that cannot serve this run, its rows made otherwise or
        missing (default: draw them with `redraw`). A row of a prompt outside `prompts` is an error naming
        `pool_name`, or skipped when that is None (an eval reading a subset)."""
        self.path, self.field, self.pool_name, self.redraw = Path(path), field, pool_name, redraw
        self.stale = stale
        self.made, self.vocab_size = made, vocab_size
        self.settings = [setting_key(s) for s in settings]
        self.pool = {p.id: p for p in prompts}
        self.rows: dict[Key, StoredSample] = {}
        self._read = self._lines = 0  # bytes and lines of the file already read
        self.refresh()

    @classmethod
    def for_rollout(cls, spec: ExperimentSpec, prompts: list[Prompt]) -> SampleStore:
        """The rollout's samples. A file made otherwise cannot be mended by drawing into it (`opd gen-samples`
        writes to rollout.samples_path by default), so its advice names a new file and the setting that reads it."""
        assert spec.rollout.samples_path is not None  # callers ask only with one (source samples requires it)
        return cls.of(spec, spec.rollout.samples_path, spec.rollout.settings, prompts, spec.rollout.max_new_tokens,
                      stale=ROLLOUT_STALE)

    @classmethod
    def of(cls, spec: ExperimentSpec, path: str | Path, settings: list, prompts: list[Prompt], max_new_tokens: int,
           **kwargs) -> SampleStore:
        """The store of `spec`'s target, tokenizer and rendering at `max_new_tokens` (keywords as for `__init__`)."""
        return cls(path, settings, prompts, Provenance.of(spec, max_new_tokens),
                   vocab_size=target_vocab_size(spec.models.target_path), **kwargs)

    def fetch(self, wanted: list[Wanted], draw: Draw | None = None) -> list[StoredSample]:
        """The stored samples of `wanted`, in order. With `draw`, missing ones are drawn and appended first, under
        an exclusive lock on the file, so processes that share it never draw a sample twice."""
        if draw is not None and self.missing(wanted):
            with self.path.open("a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
                self._drop_partial_line(f)
                self.refresh()
                for group in _grouped(self.missing(wanted)):
                    responses, costs = draw(group)
                    for w, response, cost in zip(group, responses, costs):
                        row = {"id": w.prompt.id, "prompt_ids": w.prompt.ids, "response_ids": response,
                               "sampling": dict(zip(("temperature", "top_p", "top_k"), self.settings[w.setting])),
                               "sample": w.j, **self.made.as_row(), "flops": asdict(cost)}
                        f.write(json.dumps(row) + "\n")
                        self.rows[self._key(w)] = StoredSample(response, cost)
                    f.flush()
                self._read = f.tell()
        if missing := self.missing(wanted):
            w = missing[0]
            raise StaleSamples(f"{self.field}: {self.path} has no sample {w.j} of prompt {w.prompt.id!r} at "
                               f"{describe(self.settings[w.setting])}",
                               self.stale or f"expected `{self.redraw}` to have drawn it")
        return [self.rows[self._key(w)] for w in wanted]

    def check_budget(self, spec: ExperimentSpec) -> None:
        """Every prompt has the samples the step budget reads at every setting, or one error naming the count."""
        for key, count in zip(self.settings, samples_needed(spec, len(self.pool))):
            for prompt in self.pool.values():
                have = sum((key, prompt.id, j) in self.rows for j in range(count))
                if have < count:
                    rule = "" if key[0] == 0 else "; sampled samples may not repeat across epochs"
                    raise OpdError(f"{self.field}: {self.path} has {have} sample(s) of prompt {prompt.id!r} "
                                   f"at {describe(key)}, but the step budget needs {count} per prompt{rule} "
                                   f"(expected `{self.redraw} --samples {count}`)")

    def refresh(self) -> None:
        """Read the complete lines appended since the last read (other processes may be filling the file)."""
        if not self.path.exists():
            return
        try:
            with self.path.open("rb") as f:
                f.seek(self._read)
                data = f.read()
        except OSError as exc:
            raise OpdError(f"{self.field}: {self.path} cannot be read ({exc.strerror}; expected a jsonl file)") from None
        complete = data[: data.rfind(b"\n") + 1]
        for line in complete.decode().splitlines():
            self._lines += 1
            if line.strip():
                self._add(_parse(line, f"{self.field}: {self.path}", self._lines), self._lines)
        self._read += len(complete)

    def _add(self, raw: dict, line_no: int) -> None:
        where = f"{self.field}: {self.path} line {line_no}"
        row = self._typed(raw, where)
        key = setting_key(row.sampling.model_dump())
        if key not in self.settings:
            return  # another run's setting
        prompt = self.pool.get(row.id)
        if prompt is None and self.pool_name is None:
            return  # a prompt this reader does not evaluate
        if prompt is None:
            raise OpdError(f"{where}: prompt id {row.id!r} is not in {self.pool_name} (expected samples of "
                           f"this run's prompt pool, as `{self.redraw}` draws them)")
        if difference := self.made.mismatch(row.provenance):
            raise StaleSamples(f"{where}: {difference}",
                               f"expected samples made as this run makes them; {self._redraw_advice}")
        if row.prompt_ids != prompt.ids:
            raise StaleSamples(f"{where}: prompt {row.id!r} has other prompt_ids than this run renders",
                               "expected the same data.render, enable_thinking and tokenizer as the run that drew "
                               "it" + (f"; {self.stale}" if self.stale else ""))
        self._check_tokens(row, where)
        self._keep((key, row.id, row.sample), row, where)

    @property
    def _redraw_advice(self) -> str:
        return self.stale or f"redraw them with `{self.redraw}`"

    def _typed(self, raw: dict, where: str) -> SampleRow:
        if "sampling" in raw and "made_by" not in raw:
            raise StaleSamples(f"{where}: a row from before sample rows said what made them (no made_by)",
                               self._redraw_advice)
        if "sampling" not in raw and {"id", "prompt_ids", "response_ids"} <= raw.keys():
            raise OpdError(f"{where}: an SFT data row from before the sample store (no sampling); redraw it with "
                           "`opd gen-samples CONFIG --sft`")
        try:
            return SampleRow.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(str(part) for part in err["loc"]) or "row"
            raise OpdError(f"{where}: {name}: {err['msg'].lower()} (expected a sample row as `opd gen-samples` "
                           "writes it)") from None

    def _check_tokens(self, row: SampleRow, where: str) -> None:
        if not row.response_ids:
            raise OpdError(f"{where}: response_ids is empty (expected at least one token)")
        if len(row.response_ids) > row.max_new_tokens:
            raise OpdError(f"{where}: {len(row.response_ids)} response tokens, past its max_new_tokens "
                           f"{row.max_new_tokens}")
        bad = [t for t in row.response_ids if not 0 <= t < (self.vocab_size or math.inf)]
        if bad:
            raise OpdError(f"{where}: response token {bad[0]} is outside the target's vocabulary "
                           f"[0, {self.vocab_size}) (expected samples of this target)")

    def _keep(self, key: Key, row: SampleRow, where: str) -> None:
        """A repeat of a kept row is skipped (two writers may race to a line); a different one is refused."""
        if key in self.rows:
            if self.rows[key].response != row.response_ids:
                raise OpdError(f"{where}: a second, different row for sample {row.sample} of prompt {row.id!r} at "
                               f"{describe(key[0])} (expected one row per sample; remove one of them)")
            return
        self.rows[key] = StoredSample(row.response_ids, FlopCounter(**row.flops.model_dump()))

    def _key(self, w: Wanted) -> Key:
        return self.settings[w.setting], w.prompt.id, w.j

    def missing(self, wanted: list[Wanted]) -> list[Wanted]:
        """The wanted samples the file lacks (as last read), each once."""
        return list({self._key(w): w for w in wanted if self._key(w) not in self.rows}.values())

    def _drop_partial_line(self, f) -> None:
        """A writer killed mid-line leaves a fragment; cut it (under the lock, nobody else is writing)."""
        size = f.seek(0, 2)
        if not size:
            return
        with self.path.open("rb") as r:
            r.seek(size - 1)
            if r.read(1) == b"\n":
                return  # the usual case: one byte read, not the file
            r.seek(0)
            keep = r.read().rfind(b"\n") + 1
        f.truncate(keep)
        f.seek(0, 2)


def _parse(line: str, where: str, line_no: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise OpdError(f"{where} line {line_no} is not JSON ({exc.msg}; expected a jsonl file of sample rows, as "
                       "`opd gen-samples` writes)") from None
    if not isinstance(row, dict):
        raise OpdError(f"{where} line {line_no} is not a JSON object (expected a jsonl file of sample rows)")
    return row


def _grouped(wanted: list[Wanted]) -> list[list[Wanted]]:
    """Samples at one setting share a sampler call, at most GEN_CHUNK at a time."""
    groups: dict[int, list[Wanted]] = {}
    for w in wanted:
        groups.setdefault(w.setting, []).append(w)
    return [group[i : i + GEN_CHUNK] for group in groups.values() for i in range(0, len(group), GEN_CHUNK)]


def sampler_draw(sampler, settings: list, max_new_tokens: int, seed: int) -> Draw:
    """A `Draw` from a target sampler: sample j of a prompt is keyed by prompt_key(id, j), the key a rollout uses
    for that prompt in epoch j (and held-out evaluation for j = 0), and seeded by `seed` alone, so it does not
    depend on who draws it."""

    def draw(group: list[Wanted]) -> tuple[list[list[int]], list[FlopCounter]]:
        drawn = sampler([w.prompt.ids for w in group], Sampling.of(settings[group[0].setting]), max_new_tokens,
                        seed, [prompt_key(w.prompt.id, w.j) for w in group])
        return drawn.responses, drawn.flops

    return draw


def rollout_draw(spec: ExperimentSpec, sampler) -> Draw:
    return sampler_draw(sampler, spec.rollout.settings, spec.rollout.max_new_tokens, spec.seed)
