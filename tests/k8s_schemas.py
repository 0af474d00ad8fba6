"""JSON Schemas (draft 2020-12) of the two custom resources deploy/k8s uses, written for these tests
from the APIs' documented field lists: InferencePool (inference.networking.k8s.io/v1, Gateway API
Inference Extension v1.5.0) and HTTPRoute (gateway.networking.k8s.io/v1, Gateway API v1.5, standard
channel: its experimental fields, such as a rule's retry and sessionPersistence, are refused).

They are not the upstream CRDs, which a cluster installs (docs/KUBERNETES.md). What they cover:

- every object on the path from the resource down to each field our manifests set is closed
  (`additionalProperties: false`) and lists all the fields the API documents for it, so a
  misspelled or unknown field fails, as it does under `kubectl apply --validate=strict`;
- the fields our manifests set are typed with the API's bounds and enums, and each object's
  required fields are required;
- fields the API has but our manifests do not set (HTTPRoute filters, header and query matches,
  the status written by controllers, ...) are accepted by name with their type only: their
  contents are not checked;
- of the APIs' CEL rules, only "endpointPickerRef.port is required when its kind is Service" is
  expressed (as if/then); the others are left to the API server (`kubectl apply --dry-run=server`).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def closed(properties: Schema, required: tuple[str, ...] = ()) -> Schema:
    """An object with exactly these fields, of which `required` must be present."""
    out: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


def string(max_length: int, min_length: int = 1, **extra: Any) -> Schema:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, **extra}


def array(items: Schema, max_items: int, min_items: int = 0) -> Schema:
    out: Schema = {"type": "array", "items": items, "maxItems": max_items}
    if min_items:
        out["minItems"] = min_items
    return out


OBJECT: Schema = {"type": "object"}  # a field the API has, whose contents these schemas do not check
ARRAY: Schema = {"type": "array"}
PORT_NUMBER: Schema = {"type": "integer", "minimum": 1, "maximum": 65535}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
# A DNS subdomain (RFC 1123): API groups, object names.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GROUP = string(253, min_length=0, pattern=r"^$|" + DNS_SUBDOMAIN)  # "" is the core group
KIND = string(63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
OBJECT_NAME = string(253)
NAMESPACE = string(63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SECTION_NAME = string(253, pattern=DNS_SUBDOMAIN)
# Gateway API's Duration (GEP-2257): one to four number-unit pairs, e.g. 600s, 1h30m, 500ms.
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}

# ObjectMeta, as a manifest may write it (the server-set fields are listed so that they pass too).
OBJECT_META = closed(
    {
        "name": OBJECT_NAME,
        "generateName": {"type": "string"},
        "namespace": NAMESPACE,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "ownerReferences": ARRAY,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "uid": {"type": "string"},
        "resourceVersion": {"type": "string"},
        "generation": {"type": "integer"},
        "creationTimestamp": {"type": ["string", "null"]},
        "deletionTimestamp": {"type": ["string", "null"]},
        "deletionGracePeriodSeconds": {"type": "integer"},
        "selfLink": {"type": "string"},
        "managedFields": ARRAY,
    }
)


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **closed(
            {
                "apiVersion": {"const": api_version},
                "kind": {"const": kind},
                "metadata": OBJECT_META,
                "spec": spec,
                "status": OBJECT,
            },
            required=("apiVersion", "kind", "metadata", "spec"),
        ),
    }


# ------------------------------------------------------------- InferencePool (inference.networking.k8s.io/v1)
INFERENCE_POOL_PORT = closed({"number": PORT_NUMBER}, required=("number",))

INFERENCE_POOL = resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    closed(
        {
            # Label matching only (no matchExpressions), like a Service's selector.
            "selector": closed(
                {"matchLabels": {**STRING_MAP, "minProperties": 1, "maxProperties": 64}},
                required=("matchLabels",),
            ),
            # Port numbers must be unique: as a Port has no other field, uniqueItems says so.
            "targetPorts": {**array(INFERENCE_POOL_PORT, max_items=8, min_items=1), "uniqueItems": True},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                **closed(
                    {
                        "group": GROUP,
                        "kind": KIND,  # defaults to Service
                        "name": OBJECT_NAME,
                        "port": INFERENCE_POOL_PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},  # defaults to FailClose
                    },
                    required=("name",),
                ),
                # The port is required when the picker is a Service, as it is when kind is left out.
                "if": {"anyOf": [{"not": {"required": ["kind"]}}, {"properties": {"kind": {"const": "Service"}}}]},
                "then": {"required": ["port"]},
            },
        },
        required=("selector", "targetPorts", "endpointPickerRef"),
    ),
)

# ------------------------------------------------------------------ HTTPRoute (gateway.networking.k8s.io/v1)
PARENT_REFERENCE = closed(
    {
        "group": GROUP,  # defaults to gateway.networking.k8s.io
        "kind": KIND,  # defaults to Gateway
        "namespace": NAMESPACE,
        "name": OBJECT_NAME,
        "sectionName": SECTION_NAME,
        "port": PORT_NUMBER,
    },
    required=("name",),
)

HTTP_PATH_MATCH = closed(
    {
        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},  # defaults to PathPrefix
        "value": string(1024, min_length=0),  # defaults to "/"
    }
)

HTTP_ROUTE_MATCH = closed(
    {
        "path": HTTP_PATH_MATCH,
        "headers": ARRAY,
        "queryParams": ARRAY,
        "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]},
    }
)

HTTP_BACKEND_REF = closed(
    {
        "group": GROUP,  # "" (core) by default
        "kind": KIND,  # defaults to Service
        "name": OBJECT_NAME,
        "namespace": NAMESPACE,
        "port": PORT_NUMBER,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},  # defaults to 1
        "filters": ARRAY,
    },
    required=("name",),
)

HTTP_ROUTE_RULE = closed(
    {
        "name": SECTION_NAME,
        "matches": array(HTTP_ROUTE_MATCH, max_items=64),
        "filters": array(OBJECT, max_items=16),
        "backendRefs": array(HTTP_BACKEND_REF, max_items=16),
        "timeouts": closed({"request": DURATION, "backendRequest": DURATION}),
    }
)

HTTP_ROUTE = resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    closed(
        {
            "parentRefs": array(PARENT_REFERENCE, max_items=32),
            "hostnames": array(string(253), max_items=16),
            "rules": array(HTTP_ROUTE_RULE, max_items=16),
        }
    ),
)

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
}
