"""hotpool: a self-hosted serverless GPU platform for language models."""

__version__ = "0.1.0"
