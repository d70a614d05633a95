"""The rules between sections: what no one section can check alone, run by `ExperimentSpec`'s validator.

Each rule returns one line per problem, `section.field: what is wrong (what is expected)`, so every problem of a
spec is reported in one pass. Two also fill in what the spec leaves implied: the rollout decodes in the serving
setting, and `steps` is the run's length however it was given.
"""

from __future__ import annotations

import math
from typing import Protocol

from opd.spec.inputs import DataSpec, ModelsSpec
from opd.spec.reporting import EvalSpec
from opd.spec.resources import ResourcesSpec
from opd.spec.rollout import RolloutSpec
from opd.spec.sampling import SamplingSpec, ServingSpec, TargetSampling
from opd.spec.training import LossSpec, OptimSpec, ReplaySpec, SftSpec


class Experiment(Protocol):
    """The experiment as the rules read it: `ExperimentSpec`, which runs them in its validator and so cannot be
    imported here."""

    steps: int | None
    rollout_batches: int | None
    epochs: float | None
    models: ModelsSpec
    data: DataSpec
    rollout: RolloutSpec
    replay: ReplaySpec
    loss: LossSpec
    sft: SftSpec
    optim: OptimSpec
    resources: ResourcesSpec
    eval: EvalSpec
    serving: ServingSpec | None

    @property
    def batches_per_step(self) -> int: ...


def experiment_issues(spec: Experiment) -> list[str]:
    """Every rule's problems, in the order they are reported; the run's length is filled in only once the batch
    sizes, the token budgets and the serving mode hold, since it counts whole updates."""
    issues = _updates_that_do_not_split(spec) + _token_budgets_below_one_sequence(spec)
    if spec.serving is None:
        issues += _options_that_need_a_serving_section(spec)
    else:
        issues += _rollout_takes_the_serving_setting(spec.rollout, spec.serving)
        issues += _evaluation_includes_the_serving_setting(spec.eval, spec.serving)  # the mode trained for
        issues += _training_at_odds_with_the_serving_mode(spec, spec.serving)
    if not issues:
        issues += _fill_steps_from_the_run_length(spec)
    return (issues + _anchors_the_drafter_cannot_train_at(spec) + _selector_term_without_the_full_teacher(spec)
            + _fresh_start_over_a_warm_drafter(spec)
            + _topk_teacher_the_drafter_cannot_read(spec) + _evaluation_on_a_rollout_without_a_target(spec)
            + _random_anchors_with_a_rebuilt_source(spec))


def _a(word: str) -> str:
    """`word` with its article: a dflash drafter, an eagle3 drafter, an xpress drafter."""
    return f"{'an' if word[0] in 'aeioux' else 'a'} {word}"


def _whole_updates(updates: float) -> int:
    """A run length in (fractional) updates, rounded up to whole ones and never below one: a tiny `epochs` still
    trains, and the resolved `steps` it fills in loads again. Rounded to 9 places first, so float noise such as
    7 x 16,000 / 210 computed inexactly does not add an update."""
    return max(1, math.ceil(round(updates, 9)))


# ------------------------------------------------------------------------------------------ batches and budgets


def _updates_that_do_not_split(spec: Experiment) -> list[str]:
    """An update is whole rollout batches, and its sequences must split over the learner ranks."""
    o, replicas = spec.optim, spec.resources.learner.least
    issues = []
    if o.batch_size % spec.rollout.batch_size:
        issues.append(f"optim.batch_size: {o.batch_size} is not a multiple of rollout.batch_size "
                      f"{spec.rollout.batch_size} (a step trains on whole rollout batches)")
    if o.micro_batch_tokens is None and o.batch_size % (o.micro_batch_size * replicas):
        per_step = o.micro_batch_size * replicas
        issues.append(f"optim.batch_size: {o.batch_size} is not divisible by optim.micro_batch_size "
                      f"{o.micro_batch_size} x resources.learner.replicas {replicas} = {per_step} (expected a "
                      f"multiple of {per_step})")
    if o.micro_batch_tokens is not None and o.batch_size % replicas:
        issues.append(f"optim.batch_size: {o.batch_size} sequences per update do not split over "
                      f"resources.learner.replicas {replicas} (expected a multiple of {replicas})")
    if o.micro_batch_tokens is not None and o.backend == "deepspeed" and replicas > 1:
        issues.append(f"optim.micro_batch_tokens: with backend deepspeed and {replicas} learner replicas "
                      "(ranks would take different numbers of micro-batches, which DeepSpeed's accumulation "
                      "cannot; expected backend torch, one replica, or micro_batch_size)")
    return issues


def _token_budgets_below_one_sequence(spec: Experiment) -> list[str]:
    """Token budgets must hold one block, and the longest sequence's unsplittable part: refused here, before
    any compute, rather than on the first long response hours into a run."""
    sft = spec.sft
    k, text = spec.models.drafter.block_size, spec.data.max_prompt_tokens + spec.rollout.max_new_tokens
    wanted = [("optim.micro_batch_tokens", spec.optim.micro_batch_tokens, text + k,
               f"the longest context, data.max_prompt_tokens + rollout.max_new_tokens = {text}, plus one block"),
              ("replay.micro_batch_tokens", spec.replay.micro_batch_tokens, text + k - 2,
               f"the longest text, data.max_prompt_tokens + rollout.max_new_tokens = {text}, plus one block's "
               f"{k - 2} packed slots"),
              ("sft.micro_batch_tokens", sft.micro_batch_tokens, sft.longest_sequence_tokens(k),
               f"one sequence of sft.max_length {sft.max_length} plus sft.anchors_per_seq "
               f"{sft.anchors_per_seq} blocks of {k}")]
    issues = []
    for field, budget, least, what in wanted:
        if budget is not None and budget < k:
            issues.append(f"{field}: {budget} tokens is smaller than one block of {k} (expected at least {least})")
        elif budget is not None and budget < least:
            issues.append(f"{field}: {budget} tokens is below {what} (expected at least {least})")
    return issues


def _fill_steps_from_the_run_length(spec: Experiment) -> list[str]:
    """Fill `steps` from `rollout_batches` or `epochs` (rounded up to whole updates), or cross-check them."""
    derived = {}
    if spec.rollout_batches is not None:
        derived["rollout_batches"] = -(-spec.rollout_batches // spec.batches_per_step)
    if spec.epochs is not None:
        pool = spec.data.train_pool_size
        if pool is None:
            return [f"epochs: {spec.epochs:g} but the prompt pool's size is unknown (expected "
                    "data.train_pool_size, or a readable data.train_prompts)"]
        derived["epochs"] = _whole_updates(spec.epochs * pool / spec.optim.batch_size)
    if spec.steps is None and not derived:
        return ["steps: missing (expected the run's length as steps, rollout_batches or epochs)"]
    values = {spec.steps, *derived.values()} - {None}
    if len(values) > 1:
        said = ", ".join([f"steps {spec.steps}"] * (spec.steps is not None) +
                         [f"{k} {getattr(spec, k):g} = {v} updates" for k, v in derived.items()])
        return [f"steps: the run's length is given twice and disagrees ({said}; expected one of them)"]
    spec.steps = values.pop()
    return []


# -------------------------------------------------------------------------------------------- the serving mode


def _options_that_need_a_serving_section(spec: Experiment) -> list[str]:
    """The acceptance terms and the served teacher are those of a served setting, which only `serving` names."""
    sft, loss, replay = spec.sft, spec.loss, spec.replay
    return ([f"sft.acceptance_weight: {sft.acceptance_weight:g} without a serving section (expected "
             "serving: {draft: sample, temperature: ...})"] * bool(sft.acceptance_weight) +
            [f"loss.objective: {loss.objective} without a serving section (expected serving: {{draft: "
             "sample, temperature: ...}: the acceptance is that of a served setting)"] * loss.on_acceptance +
            ["replay.teacher: served without a serving section (expected serving: {draft, temperature, top_p, "
             "top_k}, or teacher: target)"] * (replay.teacher == "served"))


def _rollout_takes_the_serving_setting(rollout: RolloutSpec, serving: ServingSpec) -> list[str]:
    """Rollouts decode in the serving setting: rollout.temperature/top_p/top_k follow it, and one set otherwise
    is refused rather than silently replaced."""
    issues = []
    for name in TargetSampling.model_fields:
        mine, served = getattr(rollout, name), getattr(serving, name)
        if name in rollout.model_fields_set and mine != served:
            issues.append(f"rollout.{name}: {mine:g} differs from serving.{name} {served:g} (expected it unset: "
                          "rollouts decode in the serving setting, rollout.mix adds others)")
        setattr(rollout, name, served)
    return issues


SERVING_EVAL = "serving"  # the eval setting the serving mode adds when no eval setting is it


def _evaluation_includes_the_serving_setting(evaluation: EvalSpec, serving: ServingSpec) -> list[str]:
    """The mode a drafter trains for is measured: an eval setting equal to the serving setting (its draft mode
    included) is added as `serving` when eval.sampling has none, beside the settings it names."""
    fields = [*TargetSampling.model_fields, "draft"]
    served = {name: getattr(serving, name) for name in fields}
    if any({name: getattr(s, name) for name in fields} == served for s in evaluation.sampling):
        return []
    if any(s.name == SERVING_EVAL for s in evaluation.sampling):
        return [f"eval.sampling: the setting named {SERVING_EVAL!r} differs from the serving section (expected it "
                "equal to serving, or another name: the serving mode's own setting is evaluated under that name)"]
    evaluation.sampling = [*evaluation.sampling, SamplingSpec(name=SERVING_EVAL, **served)]
    return []


def _training_at_odds_with_the_serving_mode(spec: Experiment, serving: ServingSpec) -> list[str]:
    """What trains for the serving mode must be able to: an acceptance objective scores drafts sampled from q
    against the full teacher, and sampled drafts need a drafter with a realized q and a rollout that keeps it."""
    loss, replay, sft, drafter = spec.loss, spec.replay, spec.sft, spec.models.drafter
    issues = []
    if sft.acceptance_weight and not loss.on_acceptance:
        issues.append(f"sft.acceptance_weight: {sft.acceptance_weight:g} with loss.objective kl (the term is "
                      "an acceptance objective's; expected loss.objective: one of neg_log_alpha, one_minus_alpha, "
                      "lk, expected_length)")
    if loss.on_acceptance and serving.draft != "sample":
        issues.append(f"loss.objective: {loss.objective} with serving.draft argmax (α = Σ min(p̃, q) is the "
                      "acceptance of drafts sampled from q; expected serving.draft: sample, or objective: kl)")
    if loss.on_acceptance and replay.teacher_topk is not None:
        issues.append(f"replay.teacher_topk: {replay.teacher_topk} with loss.objective {loss.objective} (α needs "
                      "the teacher over the whole vocabulary; expected null)")
    if serving.draft == "sample" and not drafter.samples_from_q:
        issues.append(f"serving.draft: sample with {_a(drafter.kind)} drafter (its chain is fed its "
                      "argmax, so its sampled drafts have no realized q to train; expected argmax)")
    if serving.draft == "sample" and spec.rollout.rebuilt:
        issues.append(f"rollout.source: {spec.rollout.source} with serving.draft sample (the rebuild recovers "
                      "point-mass blocks from the text; drafts sampled from q need source: speculative)")
    truncated = serving.temperature == 0 or serving.top_k > 0 or serving.top_p < 1
    if replay.teacher == "served" and truncated and loss.kl_mode != "all_forward" and not loss.on_acceptance:
        issues.append(f"replay.teacher: served with loss.kl_mode {loss.kl_mode} (the served target gives tokens "
                      "probability 0, so a reverse KL is infinite; expected kl_mode: all_forward)")
    return issues


# ----------------------------------------------------------------------------- what the drafter can train with


def _anchors_the_drafter_cannot_train_at(spec: Experiment) -> list[str]:
    """A family that trains only at the anchors decoding chose takes no random ones."""
    drafter, anchors = spec.models.drafter, spec.replay.anchors
    return [f"replay.anchors: {anchors} with {_a(drafter.kind)} drafter (it trains at the anchors decoding chose; "
            "expected error)"] * (not drafter.random_anchors and anchors != "error")


def _selector_term_without_the_full_teacher(spec: Experiment) -> list[str]:
    """A candidate selector's term reads the teacher at its candidates, which a top-k teacher may lack."""
    drafter, weight, topk = spec.models.drafter, spec.loss.selector_weight, spec.replay.teacher_topk
    return [f"loss.selector_weight: {weight:g} with {_a(drafter.kind)} drafter and replay.teacher_topk {topk} (the "
            "selector's term reads the full teacher at its candidates; expected replay.teacher_topk: null, or "
            "loss.selector_weight: 0)"] * (drafter.has_selector and weight > 0 and topk is not None)


def _fresh_start_over_a_warm_drafter(spec: Experiment) -> list[str]:
    """sft.init_from starts a fresh drafter from a checkpoint's tensors; a warm drafter is already started."""
    init_from, models = spec.sft.init_from, spec.models
    return [f"sft.init_from: {init_from} with models.drafter_path {models.drafter_path} (it starts a fresh drafter; "
            "expected models.drafter_path empty, or sft.init_from: null)"] * (init_from is not None and models.warm)


def _topk_teacher_the_drafter_cannot_read(spec: Experiment) -> list[str]:
    """A family that reads every slot's full teacher takes no top-k one."""
    drafter, topk = spec.models.drafter, spec.replay.teacher_topk
    return [f"replay.teacher_topk: {topk} with {_a(drafter.kind)} drafter (it reads every slot's full teacher; "
            "expected null)"] * (not drafter.topk_teacher and topk is not None)


# ------------------------------------------------------------------------------------------------- the rollout


def _evaluation_on_a_rollout_without_a_target(spec: Experiment) -> list[str]:
    """`evaluate_on: rollout` decodes on rollout replica 0's target, which stored samples and vLLM do not load."""
    rollout = spec.rollout
    return [f"resources.evaluate_on: rollout with rollout.source {rollout.source} and sampler {rollout.sampler} "
            "(that rollout replica holds no target of ours to evaluate with; expected evaluate_on: evaluator)"] * (
        spec.resources.evaluate_on == "rollout" and not rollout.holds_target)


def _random_anchors_with_a_rebuilt_source(spec: Experiment) -> list[str]:
    """Random anchors are redrafted by a speculative rollout's drafter, which a rebuilt source has not."""
    return [f"replay.anchors: random with rollout.source {spec.rollout.source} (expected error anchors: random "
            "anchors are redrafted by a speculative rollout's drafter)"] * (
        spec.rollout.rebuilt and spec.replay.anchors == "random")
