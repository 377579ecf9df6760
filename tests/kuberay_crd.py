"""The fields of KubeRay's RayCluster CRD (``ray.io/v1``) as a JSON schema, transcribed from
KubeRay's Go types (``RayClusterSpec``, ``HeadGroupSpec``, ``WorkerGroupSpec``,
``AutoscalerOptions``): no package registry ships the CRD itself. Pod templates are left to
Kubernetes' own ``PodTemplateSpec`` schema; this checks what is around them."""

from __future__ import annotations

from typing import Any

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_COUNT = {"type": "integer", "minimum": 0}
_OBJECT = {"type": "object"}
RAYCLUSTER_SPEC: dict[str, Any] = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "autoscalerOptions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "idleTimeoutSeconds": _COUNT,
                "version": {"enum": ["v1", "v2"]},
                "image": {"type": "string"},
                "imagePullPolicy": {"type": "string"},
                "resources": _OBJECT,
                "securityContext": _OBJECT,
                "env": {"type": "array"},
                "envFrom": {"type": "array"},
                "volumeMounts": {"type": "array"},
            },
        },
        "headServiceAnnotations": _STRINGS,
        "suspend": {"type": "boolean"},
        "managedBy": {"type": "string"},
        "gcsFaultToleranceOptions": _OBJECT,
        "headGroupSpec": {
            "type": "object",
            "required": ["template"],
            "additionalProperties": False,
            "properties": {
                "rayStartParams": _STRINGS,
                "template": _OBJECT,
                "serviceType": {"type": "string"},
                "headService": _OBJECT,
                "enableIngress": {"type": "boolean"},
            },
        },
        "workerGroupSpecs": {
            "type": "array",
            "items": {
                "type": "object",
                # rayStartParams and the bounds were required by older operators: always set.
                "required": [
                    "groupName",
                    "template",
                    "rayStartParams",
                    "minReplicas",
                    "maxReplicas",
                ],
                "additionalProperties": False,
                "properties": {
                    "groupName": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                    "replicas": _COUNT,
                    "minReplicas": _COUNT,
                    "maxReplicas": _COUNT,
                    "idleTimeoutSeconds": _COUNT,
                    "numOfHosts": {"type": "integer", "minimum": 1},
                    "suspend": {"type": "boolean"},
                    "rayStartParams": _STRINGS,
                    "template": _OBJECT,
                    "scaleStrategy": _OBJECT,
                },
            },
        },
    },
}
