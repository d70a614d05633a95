"""Ray placement arithmetic: how the roles' ranks become placement bundles, and whether Ray can place them.

A role Ray cannot place waits forever, so every rule here is checked when the resources section validates
(`opd.spec.resources`), against what the spec declares of the cluster: a fraction of a GPU above one, a learner
rank without a scorer rank to share a GPU with, a sharded replica that cannot be packed on one node, and roles
that need more than the cluster has.
"""

from __future__ import annotations

from opd.spec.roles import RoleSpec


def amount(x: float) -> str:
    """Format a resource amount without a spurious `.0`."""
    return f"{x:g}"


def learner_group_bundles(learner: RoleSpec, scorer: RoleSpec, colocate: bool) -> list[dict[str, float]]:
    """The learner placement group's bundles: the learner ranks' (0..N-1), then the scorer ranks'. With `colocate`
    (`resources.colocate_learner`), bundle i holds scorer rank i and learner rank i (i < N) together: a whole GPU
    (the fractions sum to 1, `colocated_ranks_that_cannot_pair`), so a pair shares it and no two scorer ranks share
    one."""
    if not colocate:
        return [learner.bundle] * learner.least + [scorer.bundle] * scorer.ranks
    gpu = {"GPU": 1.0} if learner.num_gpus or scorer.num_gpus else {}
    return [{"CPU": round(scorer.num_cpus + learner.num_cpus * (i < learner.least), 4)} | gpu
            for i in range(scorer.ranks)]


def as_placed(roles: dict[str, RoleSpec], colocate: bool) -> dict[str, RoleSpec]:
    """The roles' GPUs as their bundles hold them: with `colocate` each scorer rank's bundle is a whole GPU
    (learner ranks share the first ones), so the learner adds none."""
    scorer, learner = roles["scorer"], roles["learner"]
    if not (colocate and (scorer.num_gpus or learner.num_gpus)):
        return roles
    return roles | {"scorer": scorer.model_copy(update={"num_gpus": 1.0}),
                    "learner": learner.model_copy(update={"num_gpus": 0.0})}


def gpu_fractions_ray_cannot_place(roles: dict[str, RoleSpec]) -> list[str]:
    """Ray places a fraction of one GPU, or whole GPUs, never 1.5."""
    return [f"{name}.num_gpus: {amount(role.num_gpus)} (expected at most 1 or a whole number; Ray cannot "
            "place a fraction above 1)"
            for name, role in roles.items() if role.num_gpus > 1 and role.num_gpus % 1]


def colocated_ranks_that_cannot_pair(learner: RoleSpec, scorer: RoleSpec) -> list[str]:
    """colocate_learner puts learner rank i in scorer rank i's bundle: no more learner ranks than scorer ranks, and
    each bundle one whole GPU (a fraction could put two scorer ranks of one replica on one device, which nccl
    refuses)."""
    if learner.least > scorer.ranks:
        return [f"learner.replicas: {learner.least} with colocate_learner but the scorer has {scorer.ranks} ranks "
                "(expected at most one learner rank per scorer rank: learner rank i shares scorer rank i's GPU)"]
    pair = round(learner.num_gpus + scorer.num_gpus, 4)
    if pair not in (0, 1) or (pair == 1 and not (learner.num_gpus and scorer.num_gpus)):
        return [f"learner.num_gpus: {amount(learner.num_gpus)} + scorer.num_gpus {amount(scorer.num_gpus)} = "
                f"{amount(pair)} with colocate_learner (expected fractions summing to 1, e.g. 0.1 and 0.9: a learner "
                "rank and a scorer rank share each GPU; or 0 and 0 on CPU)"]
    return []


def ranks_that_cannot_pack(roles: dict[str, RoleSpec], gpus_per_node: int | None) -> list[str]:
    """A sharded replica is one rank per device, all on one node (its placement group is STRICT_PACK), and so are
    the learner's ranks (its replicas) with every scorer rank."""
    issues = [f"learner.gpus_per_replica: {roles['learner'].gpus_per_replica} (expected 1: the learner's ranks are "
              "its replicas, each a whole drafter)"] * (roles["learner"].gpus_per_replica != 1)
    for name, role in roles.items():
        if role.gpus_per_replica > 1 and not (role.num_gpus or role.num_cpus):
            issues.append(f"{name}.num_cpus: 0 and num_gpus 0 with gpus_per_replica {role.gpus_per_replica} (expected "
                          "CPUs or GPUs per rank: a placement group packs the ranks on one node, and Ray places no "
                          "empty bundle)")
        elif role.gpus_per_replica > 1 and role.num_gpus not in (0, 1):
            issues.append(f"{name}.num_gpus: {amount(role.num_gpus)} with gpus_per_replica {role.gpus_per_replica} "
                          "(expected 1, a GPU per rank, or 0 for CPU ranks)")
        elif gpus_per_node is not None and role.gpus_per_replica * role.num_gpus > gpus_per_node:
            issues.append(f"{name}.gpus_per_replica: {role.gpus_per_replica} GPUs, but a node has "
                          f"cluster.gpus_per_node {gpus_per_node} (a replica's ranks are packed on one node)")
    beside = roles["learner"].least * roles["learner"].num_gpus + roles["scorer"].ranks * roles["scorer"].num_gpus
    if gpus_per_node is not None and not issues and beside > gpus_per_node:
        issues.append(f"scorer: {roles['scorer'].ranks} ranks of {amount(roles['scorer'].num_gpus)} GPU beside the "
                      f"learner's {amount(roles['learner'].least * roles['learner'].num_gpus)} need {amount(beside)} "
                      f"GPUs on one node, but cluster.gpus_per_node is {gpus_per_node} (the learner's placement "
                      "group packs its scorers with it, so their batches never cross the network)")
    return issues


def roles_that_do_not_fit(roles: dict[str, RoleSpec], attr: str, available: float) -> list[str]:
    """Each role alone, then all roles together, must fit the cluster, or the run would hang unplaced."""
    unit = {"num_gpus": "GPUs", "num_cpus": "CPUs"}[attr]
    each = {name: getattr(role, attr) * role.gpus_per_replica for name, role in roles.items()}
    need = {name: role.least * each[name] for name, role in roles.items()}
    issues = [f"{name}: {role.least} replicas x {amount(each[name])} {unit} = {amount(need[name])} {unit}, "
              f"but the cluster declares {amount(available)} (a role that can never be placed)"
              for name, role in roles.items() if need[name] > available]
    if not issues and sum(need.values()) > available:
        parts = " + ".join(f"{name} {amount(n)}" for name, n in need.items() if n)
        issues.append(f"cluster.{attr}: the roles need {parts} = {amount(sum(need.values()))} {unit}, but the cluster "
                      f"declares {amount(available)} (expected the sum to fit; all roles run at once)")
    return issues
