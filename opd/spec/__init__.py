"""Experiment specs, split by role: the schema (`schema`), loading YAML with `base:` and `--set` (`load`), the one
reading of the files a spec names (`resolve`), and flattening for MLflow (`export`). The names below are what the
rest of the project imports."""

from opd.spec.export import field_default, flatten
from opd.spec.load import load_spec, validate_spec
from opd.spec.resolve import path_problems, shard_degree_issues
from opd.spec.schema import (
    ClusterSpec,
    DataSpec,
    EvalSpec,
    ExperimentSpec,
    LossSpec,
    ModelsSpec,
    OptimSpec,
    ReplaySpec,
    ResourcesSpec,
    RoleSpec,
    RolloutSampling,
    RolloutSpec,
    SamplingSpec,
    ServingSpec,
    SftSpec,
    SpecError,
    TrackingSpec,
    with_eval_samples,
)

__all__ = ["ClusterSpec", "DataSpec", "EvalSpec", "ExperimentSpec", "LossSpec", "ModelsSpec",
           "OptimSpec", "ReplaySpec", "ResourcesSpec", "RoleSpec", "RolloutSampling", "RolloutSpec", "SamplingSpec",
           "ServingSpec", "SftSpec", "SpecError", "TrackingSpec", "path_problems", "shard_degree_issues", "field_default", "flatten", "load_spec", "validate_spec", "with_eval_samples"]
