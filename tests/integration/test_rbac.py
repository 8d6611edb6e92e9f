"""The ClusterRole grants exactly what the operator's code and Kopf call, and nothing else."""

from __future__ import annotations

import ast

from batchpilot_operator import kube
from batchpilot_operator.handlers import KOPF_PERMISSIONS

from tests.support import ROOT
from tests.support.manifests import (
    ENTRY_POINTS,
    Grant,
    cluster_role,
    granted_by_cluster_role,
    grants,
    operator_object,
    render,
    render_manifests,
    served_namespaces,
)


def declared() -> set[Grant]:
    tables = (kube.PERMISSIONS, KOPF_PERMISSIONS)
    return {
        (kind.group, kind.plural + (f"/{sub}" if sub else ""), verb)
        for table in tables
        for (kind, sub), verbs in table.items()
        for verb in verbs
    }


def test_cluster_role_grants_exactly_the_declared_calls() -> None:
    assert granted_by_cluster_role() == declared()


def test_nothing_can_list_or_watch_secrets_in_any_entry_point() -> None:
    # list and watch return every Secret's data: as good as reading them all. The operator
    # gets its admin token by name; no account of any variant may do more.
    for entry, directory in ENTRY_POINTS.items():
        for doc in render(directory):
            if doc["kind"] in ("Role", "ClusterRole"):
                secret_verbs = {verb for group, resource, verb in grants(doc)
                                if (group, resource) == ("", "secrets")}
                assert not secret_verbs & {"list", "watch", "*"}, (entry, doc["metadata"]["name"])


def test_the_operator_neither_watches_nor_lists_secrets() -> None:
    secret_grants = {grant for grant in declared() if grant[1] == "secrets"}
    assert secret_grants == {("", "secrets", "get"), ("", "secrets", "create")}


def test_the_namespaced_variant_grants_the_same_only_where_it_serves() -> None:
    docs = render(ENTRY_POINTS["namespaced"])
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role, binding = operator_object(docs, "Role"), operator_object(docs, "RoleBinding")
    assert grants(role) == declared()
    args = operator_object(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert served_namespaces(args) == {role["metadata"]["namespace"]}
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert binding["roleRef"]["kind"] == "Role"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = operator_object(docs, "ServiceAccount")
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (
        account["metadata"]["name"], account["metadata"]["namespace"],
    )


def test_no_wildcards_and_no_unused_rule_fields() -> None:
    for rule in cluster_role()["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert set(rule) == {"apiGroups", "resources", "verbs"}


def test_binding_gives_the_role_to_the_operator_account() -> None:
    docs = render_manifests()
    binding = operator_object(docs, "ClusterRoleBinding")
    account = operator_object(docs, "ServiceAccount")
    deployment = operator_object(docs, "Deployment")
    assert binding["roleRef"]["name"] == cluster_role()["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (
        account["metadata"]["name"], account["metadata"]["namespace"],
    )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert deployment["metadata"]["namespace"] == account["metadata"]["namespace"]


def test_every_kind_the_code_calls_is_declared() -> None:
    # The table is only exact if the code calls nothing outside it: find every
    # `<client>.<verb>(KIND, ...)` in the operator package and check its kind is declared.
    declared_kinds = {name for name in vars(kube) if isinstance(getattr(kube, name), kube.Kind)}
    used: set[tuple[str, str]] = set()
    for path in (ROOT / "operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"get", "list", "create", "patch", "delete"}
                and node.args
                and isinstance(first := node.args[0], ast.Name | ast.Attribute)
            ):
                name = first.id if isinstance(first, ast.Name) else first.attr
                if name in declared_kinds:
                    used.add((name, node.func.attr))
    kinds = {name: getattr(kube, name) for name in declared_kinds}
    for name, verb in used:
        allowed = set().union(
            *(verbs for (kind, _), verbs in kube.PERMISSIONS.items() if kind == kinds[name])
        )
        assert verb in allowed, f"{verb} {name} is called but not in kube.PERMISSIONS"
