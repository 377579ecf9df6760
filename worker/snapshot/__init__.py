"""Snapshots: manifests, object stores, the worker's local cache and the GGUF converter."""
