"""docker/kuberay/: the RayJob and RayCluster pass KubeRay's ray.io/v1 CRD schema and fit their recipe.

No Kubernetes API server here. Each RayJob and RayCluster document is validated with `jsonschema` against
the openAPIV3Schema of KubeRay's CRDs, vendored in tests/deploy/kuberay_schema/ (KubeRay v1.7.0; its
SOURCE.md says how to refresh it). The schema is made strict at load: the API server silently prunes
fields a structural schema does not declare, so a misspelled field would be lost without an error; here
it fails. CEL rules (x-kubernetes-validations) and formats (int32, date-time) are not checked. The pod
templates and the PVC are also checked against Kubernetes' own schema with `kubernetes-validate` when it
is installed, and the entrypoint against rlray's real config composition.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from jsonschema import Draft4Validator, ValidationError

if TYPE_CHECKING:
    from rlray.config import Config

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "docker" / "kuberay"
SCHEMAS = Path(__file__).resolve().parent / "kuberay_schema"
K8S_VERSION = "1.34.0"
GPU = "nvidia.com/gpu"
DOCS = [("rayjob.yaml", "RayJob"), ("raycluster.yaml", "RayCluster")]
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
Keys = tuple[str | int, ...]  # keys from a document down to one of its values
JOB_WORKER: Keys = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
JOB_HEAD: Keys = ("spec", "rayClusterSpec", "headGroupSpec")


def load(name: str) -> list[dict[str, Any]]:
    with (KUBERAY / name).open() as f:
        # through JSON, as kubectl sends them: YAML aliases (the shared GPU pod template) become copies
        return [json.loads(json.dumps(d)) for d in yaml.safe_load_all(f) if d is not None]


def one(name: str, kind: str) -> dict[str, Any]:
    docs = [d for d in load(name) if d.get("kind") == kind]
    assert len(docs) == 1, f"{name}: expected one {kind}, found {len(docs)}"
    return docs[0]


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    job = one("rayjob.yaml", "RayJob")
    cluster = one("raycluster.yaml", "RayCluster")
    return [("rayjob.yaml", job["spec"]["rayClusterSpec"]), ("raycluster.yaml", cluster["spec"])]


def vendored_schema(kind: str) -> dict[str, Any]:
    """spec.versions[v1].schema.openAPIV3Schema of KubeRay's CRD for `kind`, as vendored."""
    return json.loads((SCHEMAS / f"{kind.lower()}.v1.json").read_text())


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of the structural schema as plain JSON Schema that also rejects what the API server prunes."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", INT_OR_STRING)
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(kind: str) -> Draft4Validator:
    # OpenAPI 3.0 schema objects follow JSON Schema draft 4/5 (boolean exclusiveMinimum, no const).
    schema = strict(vendored_schema(kind))
    Draft4Validator.check_schema(schema)
    return Draft4Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[ValidationError]:
    return sorted(crd_validator(doc["kind"]).iter_errors(doc), key=lambda e: e.json_path)


def at(doc: dict[str, Any], path: Keys) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    """KubeRay runs Ray in the pod template's first container."""
    return template["spec"]["containers"][0]


def gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get(GPU, 0))


def compose_entrypoint(entrypoint: str) -> Config:
    """The typed Config that `python -m rlray.launch ARGS` would run (as under ray job submit)."""
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    argv = shlex.split(entrypoint)
    assert argv[:3] == ["python", "-m", "rlray.launch"], argv
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=argv[3:])
    return to_config(cfg)


def test_manifests_are_ray_io_v1() -> None:
    for name, kind in DOCS:
        obj = one(name, kind)
        assert obj["apiVersion"] == "ray.io/v1"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
        assert len(obj["metadata"]["name"]) <= 47  # KubeRay appends suffixes to derived names


@pytest.mark.parametrize("name, kind", DOCS, ids=["rayjob", "raycluster"])
def test_manifest_passes_the_strict_kuberay_crd_schema(name: str, kind: str) -> None:
    errors = crd_errors(one(name, kind))
    assert not errors, "\n".join(f"{name} {e.json_path}: {e.message}" for e in errors)


@pytest.mark.parametrize("path, key, typo", [
    (("spec",), "shutdownAfterJobFinishes", "shutdownAfterJobFinish"),
    ((*JOB_WORKER, "template", "spec", "containers", 0), "resources", "resource"),
], ids=["spec", "container"])
def test_strict_crd_schema_rejects_a_misspelled_field(path: Keys, key: str, typo: str) -> None:
    job = copy.deepcopy(one("rayjob.yaml", "RayJob"))
    obj = at(job, path)
    obj[typo] = obj.pop(key)
    assert not list(Draft4Validator(vendored_schema("RayJob")).iter_errors(job))  # the API server prunes it
    errors = crd_errors(job)
    assert [(tuple(e.absolute_path), e.validator) for e in errors] == [(path, "additionalProperties")]
    assert repr(typo) in errors[0].message


@pytest.mark.parametrize("path, key, value", [
    (JOB_WORKER, "replicas", "5"),
    ((*JOB_HEAD, "rayStartParams"), "num-gpus", 0),  # map[string]string: an unquoted number fails
], ids=["replicas", "rayStartParams"])
def test_strict_crd_schema_rejects_a_wrong_type(path: Keys, key: str, value: Any) -> None:
    job = copy.deepcopy(one("rayjob.yaml", "RayJob"))
    at(job, path)[key] = value
    assert [(tuple(e.absolute_path), e.validator) for e in crd_errors(job)] == [((*path, key), "type")]


def test_rayjob_runs_its_own_cluster_and_tears_it_down() -> None:
    spec = one("rayjob.yaml", "RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec.get("ttlSecondsAfterFinished", 0) >= 0
    assert spec["submissionMode"] == "K8sJobMode"  # `kubectl logs job/...` follows the submitter Job
    assert "rayClusterSpec" in spec and "clusterSelector" not in spec  # the job brings its own cluster
    assert "deletionStrategy" not in spec  # incompatible with shutdownAfterJobFinishes + TTL in rules mode


@pytest.mark.parametrize("name, spec", cluster_specs(), ids=["rayjob", "raycluster"])
def test_worker_groups_and_start_params(name: str, spec: dict[str, Any]) -> None:
    groups = spec["workerGroupSpecs"]
    assert groups, name
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names), names
    for g in groups:
        assert 0 <= g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], (name, g)
    for group in [spec["headGroupSpec"], *groups]:
        params = group.get("rayStartParams", {})
        assert "address" not in params, (name, params)  # KubeRay fills in the head's address itself


@pytest.mark.parametrize("name, spec", cluster_specs(), ids=["rayjob", "raycluster"])
def test_token_auth_and_ray_version(name: str, spec: dict[str, Any]) -> None:
    import ray

    assert spec["rayVersion"] == ray.__version__ == "2.60.0", name
    assert spec["authOptions"]["mode"] == "token", (name, spec["authOptions"])
    # KubeRay injects RAY_AUTH_MODE/RAY_AUTH_TOKEN itself; a hand-set one would override its secret.
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        env = {e["name"] for e in ray_container(template).get("env", [])}
        assert not env & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, (name, env)


@pytest.mark.parametrize("name, spec", cluster_specs(), ids=["rayjob", "raycluster"])
def test_pods_gpus_image_user_and_storage(name: str, spec: dict[str, Any]) -> None:
    head_t = spec["headGroupSpec"]["template"]
    worker_ts = [g["template"] for g in spec["workerGroupSpecs"]]
    head = ray_container(head_t)
    assert gpus(head) == 0 and spec["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0", name
    images = {ray_container(t)["image"] for t in [head_t, *worker_ts]}
    assert len(images) == 1, images  # one image for head and workers (docker/Dockerfile)
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"^ARG RAY_UID=(\d+)$", dockerfile, re.MULTILINE).group(1))
    claim = one("storage.yaml", "PersistentVolumeClaim")["metadata"]["name"]
    for t in [head_t, *worker_ts]:
        c = ray_container(t)
        sc = t["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid and sc["fsGroup"] == uid, name
        limits = c["resources"]["limits"]
        assert "cpu" in limits and "memory" in limits, name
        requests = c["resources"].get("requests", {})
        assert requests.get(GPU, limits.get(GPU)) == limits.get(GPU), name  # Kubernetes wants them equal
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/mnt/shared"]]["persistentVolumeClaim"]["claimName"] == claim, name
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
    for t in worker_ts:
        assert gpus(ray_container(t)) > 0, name
    env = {e["name"]: e for e in head.get("env", [])}
    ref = env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"], ref


def test_rayjob_entrypoint_runs_an_existing_recipe_that_fits_the_cluster() -> None:
    job = one("rayjob.yaml", "RayJob")
    entrypoint = job["spec"]["entrypoint"]
    recipes = re.findall(r"\+recipe=(\S+)", entrypoint)
    assert recipes == ["glm_moe"], entrypoint
    assert (ROOT / "recipes" / f"{recipes[0]}.yaml").is_file()
    c = compose_entrypoint(entrypoint)  # raises ConfigError on a bad override
    assert c.run.name == "glm_moe"
    assert c.run.dir.startswith("/mnt/shared/"), c.run.dir  # the run folder lands on the shared volume

    spec = job["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert sorted(groups) == ["rollout", "trainer"], sorted(groups)
    t, r = c.trainer, c.rollout
    # each group's Ray node labels are what the run selects for its placement groups
    assert groups["trainer"]["labels"] == t.node_labels and groups["rollout"]["labels"] == r.node_labels
    per_pod = {name: gpus(ray_container(g["template"])) for name, g in groups.items()}
    assert per_pod == {"trainer": 8, "rollout": 8}, per_pod
    trainer = groups["trainer"]
    assert trainer["minReplicas"] == trainer["replicas"] == trainer["maxReplicas"]  # the trainer does not scale
    assert trainer["replicas"] * 8 == t.num_ranks * t.gpus_per_rank == 24
    rollout = groups["rollout"]
    assert rollout["replicas"] * 8 == r.num_actors * r.gpus_per_actor == 16  # the pool's minimum, placed at start
    assert r.max_actors is not None and rollout["maxReplicas"] * 8 == r.max_actors * r.gpus_per_actor == 32
    cpus = {name: int(ray_container(g["template"])["resources"]["limits"]["cpu"]) for name, g in groups.items()}
    assert t.num_ranks * t.cpus_per_rank <= trainer["replicas"] * cpus["trainer"]
    assert r.max_actors * r.cpus_per_actor <= rollout["maxReplicas"] * cpus["rollout"]
    assert 8 % t.ep == 0 and 8 % r.gpus_per_actor == 0  # EP groups and engines within a node


@pytest.mark.parametrize("name, spec", cluster_specs(), ids=["rayjob", "raycluster"])
def test_autoscaling_scales_the_rollout_group_only(name: str, spec: dict[str, Any]) -> None:
    assert spec["enableInTreeAutoscaling"] is True, name
    assert spec["autoscalerOptions"]["version"] == "v2", name  # the autoscaler that reads label selectors
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert groups["rollout"]["maxReplicas"] > groups["rollout"]["replicas"], name
    assert groups["trainer"]["maxReplicas"] == groups["trainer"]["replicas"], name


def test_raycluster_matches_the_rayjob_cluster() -> None:
    job_spec = one("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"]
    cluster_spec = one("raycluster.yaml", "RayCluster")["spec"]
    for a, b in zip(job_spec["workerGroupSpecs"], cluster_spec["workerGroupSpecs"], strict=True):
        assert ray_container(a["template"])["resources"] == ray_container(b["template"])["resources"]
        assert a["replicas"] == b["replicas"] and a["maxReplicas"] == b["maxReplicas"] and a["labels"] == b["labels"]


def test_shared_volume_is_read_write_many() -> None:
    pvc = one("storage.yaml", "PersistentVolumeClaim")
    assert pvc["apiVersion"] == "v1"
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert re.fullmatch(r"\d+(Gi|Ti)", pvc["spec"]["resources"]["requests"]["storage"])
    for name in ("rayjob.yaml", "raycluster.yaml"):
        assert not [d for d in load(name) if d.get("kind") == "PersistentVolumeClaim"], \
            f"{name} must not own the PVC: deleting it would delete the checkpoints"


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, spec in cluster_specs():
        out.append((f"{name}:head", spec["headGroupSpec"]["template"]))
        out += [(f"{name}:{g['groupName']}", g["template"]) for g in spec["workerGroupSpecs"]]
    return out


@pytest.mark.parametrize("where, template", pod_templates(), ids=[w for w, _ in pod_templates()])
def test_pod_templates_pass_kubernetes_schema(where: str, template: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install "
                             "kubernetes-validate) to check pod templates against Kubernetes' schema")
    kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                K8S_VERSION, strict=True)


def test_pvc_passes_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    kv.validate(one("storage.yaml", "PersistentVolumeClaim"), K8S_VERSION, strict=True)


def test_kubernetes_schema_check_catches_a_typo() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    template = pod_templates()[0][1]
    container = {**ray_container(template), "resorces": {}}
    bad = {**template, "spec": {**template["spec"], "containers": [container]}}
    with pytest.raises(kv.ValidationError):
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": bad},
                    K8S_VERSION, strict=True)
