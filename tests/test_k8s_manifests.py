"""deploy/k8s checked without a cluster (these machines have none): every Kubernetes object
against Kubernetes' own schemas (kubernetes-validate, strict), the KubeRay RayCluster against
the fields of its CRD with its pod templates as Kubernetes pod templates, and the references
between the objects (labels, ports, ConfigMap keys, Secrets, the Ray head's Service)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    CONTROL_PLANE,
    K8S,
    WORKER,
    Doc,
    build_args,
    check_cli,
    default_process,
    find,
    load_manifests,
    values,
    walk,
)
from kuberay_crd import RAYCLUSTER_SPEC

# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CUSTOM_KINDS = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(scope="module")
def kustomization() -> Doc:
    loaded = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def manifests() -> list[Doc]:
    return load_manifests()


def pod_spec(manifests: list[Doc]) -> Doc:
    """The control plane's pod."""
    spec = find(manifests, "Deployment", "hotpool")["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def pod_templates(raycluster: Doc) -> Iterator[Doc]:
    spec = raycluster["spec"]
    yield spec["headGroupSpec"]["template"]
    for group in spec["workerGroupSpecs"]:
        yield group["template"]


def test_kustomization_lists_the_manifests(kustomization: Doc) -> None:
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # servicemonitor.yaml is opt-in: it needs the Prometheus Operator's CRD.
    assert set(kustomization["resources"]) == on_disk - {"servicemonitor.yaml"}
    images = {i["name"] for i in kustomization["images"]}
    assert images == {"hotpool/control-plane", "hotpool/worker"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(
    manifests: list[Doc], version: str
) -> None:
    checked = 0
    for doc in manifests:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue  # not Kubernetes' own kinds: checked against their CRDs' fields below
        # strict: an unknown or misspelt field is an error, as `kubectl --validate` makes it.
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 6


def test_the_schemas_catch_a_misspelt_field(manifests: list[Doc]) -> None:
    deployment = find(manifests, "Deployment", "hotpool")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    broken = {**container, "envfrom": container["envFrom"]}
    spec = {**deployment["spec"]["template"]["spec"], "containers": [broken]}
    template = {**deployment["spec"]["template"], "spec": spec}
    bad = {**deployment, "spec": {**deployment["spec"], "template": template}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_raycluster_has_the_fields_of_kuberays_crd(manifests: list[Doc]) -> None:
    ray = find(manifests, "RayCluster")
    jsonschema.Draft202012Validator(RAYCLUSTER_SPEC).validate(ray["spec"])
    for template in pod_templates(ray):
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate({**pod, "template": template}, version, strict=True)
    spec = ray["spec"]
    assert spec["rayVersion"] == build_args(WORKER)["RAY_VERSION"]
    # The head takes no worker; each pod of the GPU group is one GPU, one worker.
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (gpu,) = spec["workerGroupSpecs"]
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    (container,) = gpu["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    config = find(manifests, "ConfigMap", "hotpool-config")["data"]
    assert int(config["HOTPOOL_MAX_WORKERS"]) <= gpu["maxReplicas"]
    assert config["HOTPOOL_DEVICE"] == "cuda"  # a GPU even while the group is at zero
    for template in pod_templates(ray):
        for c in template["spec"]["containers"]:
            assert c["image"].startswith("hotpool/worker:")  # Ray nodes run the worker image


def test_control_plane_runs_migrations_then_serves(manifests: list[Doc]) -> None:
    deployment = find(manifests, "Deployment", "hotpool")
    pod = pod_spec(manifests)
    (container,) = pod["containers"]
    (init,) = pod["initContainers"]
    entrypoint, _ = default_process(CONTROL_PLANE)
    assert entrypoint == ["hotpool"]
    for c, args in ((init, ["db", "upgrade"]), (container, ["serve"])):
        assert c["image"].startswith("hotpool/control-plane:")
        assert "command" not in c and c["args"] == args  # the image's entrypoint runs them
        check_cli(c["args"])
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one control plane per spool
    # The image's own user, so the volume's fsGroup and the image's files agree.
    (user,) = values(CONTROL_PLANE, "USER")
    assert pod["securityContext"]["runAsUser"] == int(user.split(":")[0])


def test_control_plane_objects_reference_each_other(manifests: list[Doc]) -> None:
    deployment = find(manifests, "Deployment", "hotpool")
    pod = pod_spec(manifests)
    (container,) = pod["containers"]
    # The Service reaches the pod, and is what workers are told to call.
    service = find(manifests, "Service", "hotpool")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    config = find(manifests, "ConfigMap", "hotpool-config")["data"]
    url = f"http://{service['metadata']['name']}:{port['port']}"
    assert config["HOTPOOL_CONTROL_PLANE_URL"] == url
    # Ray Client at KubeRay's head Service (<cluster>-head-svc), on the head's client port.
    ray = find(manifests, "RayCluster")
    (head,) = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    client = next(p["containerPort"] for p in head["ports"] if p["name"] == "client")
    assert config["HOTPOOL_RAY_ADDRESS"] == f"ray://{ray['metadata']['name']}-head-svc:{client}"
    assert config["HOTPOOL_BACKEND"] == "ray"
    # Secrets are referenced, never stored; every ConfigMap key and claim referenced exists.
    assert not [m for m in manifests if m["kind"] == "Secret"]
    secrets = {d["secretKeyRef"]["name"] for d in walk(manifests) if "secretKeyRef" in d}
    assert secrets == {"hotpool-database", "hotpool-s3"}
    configmaps = {m["metadata"]["name"]: m["data"] for m in manifests if m["kind"] == "ConfigMap"}
    for d in walk(manifests):
        if "configMapKeyRef" in d:
            assert d["configMapKeyRef"]["key"] in configmaps[d["configMapKeyRef"]["name"]]
        if "configMapRef" in d:
            assert d["configMapRef"]["name"] in configmaps
    claims = {m["metadata"]["name"] for m in manifests if m["kind"] == "PersistentVolumeClaim"}
    assert {d["claimName"] for d in walk(pod["volumes"]) if "claimName" in d} <= claims


def test_prometheus_finds_the_control_plane(manifests: list[Doc], kustomization: Doc) -> None:
    template = find(manifests, "Deployment", "hotpool")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    (container,) = template["spec"]["containers"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) in {
        p["containerPort"] for p in container["ports"]
    }
    assert annotations["prometheus.io/path"] == "/metrics"
    scrape = find(manifests, "ConfigMap", "hotpool-prometheus-scrape")["data"]
    (job,) = yaml.safe_load(scrape["hotpool-scrape.yml"])["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [kustomization["namespace"]]
    component = template["metadata"]["labels"]["app.kubernetes.io/component"]
    assert any(r.get("regex") == component for r in job["relabel_configs"])
    for r in job["relabel_configs"]:
        if "regex" in r:
            re.compile(r["regex"])  # Prometheus takes RE2; these use nothing beyond it
    # The Prometheus Operator's way: a ServiceMonitor on the Service's labels and port.
    monitor = find(manifests, "ServiceMonitor")
    service = find(manifests, "Service", "hotpool")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == annotations["prometheus.io/path"]
