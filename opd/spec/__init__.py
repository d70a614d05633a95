"""Experiment specs, split by role: the spec and its sections (`experiment`, with `inputs`, `sampling`, `rollout`,
`training`, `roles`, `resources`, `reporting`), the Ray placement arithmetic (`placement`), the rules between
sections (`rules`), loading YAML with `base:` and `--set` (`load`), the one reading of the files a spec names
(`resolve`), and flattening for MLflow (`export`). The names below are what the rest of the project imports."""

from opd.spec.experiment import ExperimentSpec, with_eval_samples
from opd.spec.inputs import DataSpec, ModelsSpec
from opd.spec.load import SpecError, load_spec, validate_spec
from opd.spec.mlflow_params import field_default, flatten
from opd.spec.reporting import EvalSpec, TrackingSpec
from opd.spec.resolve import path_problems, shard_degree_issues
from opd.spec.resources import ResourcesSpec
from opd.spec.roles import ClusterSpec, RestartsSpec, RoleSpec
from opd.spec.rollout import RolloutSpec
from opd.spec.sampling import RolloutSampling, SamplingSpec, ServingSpec, TargetSampling
from opd.spec.training import LossSpec, OptimSpec, ReplaySpec, SftSpec

__all__ = ["ClusterSpec", "DataSpec", "EvalSpec", "ExperimentSpec", "LossSpec", "ModelsSpec", "OptimSpec",
           "ReplaySpec", "ResourcesSpec", "RestartsSpec", "RoleSpec", "RolloutSampling", "RolloutSpec", "SamplingSpec", "ServingSpec",
           "SftSpec", "SpecError", "TargetSampling", "TrackingSpec", "path_problems", "shard_degree_issues",
           "field_default", "flatten", "load_spec", "validate_spec", "with_eval_samples"]
